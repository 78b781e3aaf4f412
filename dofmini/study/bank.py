"""The bank of layer units (issue 43): layerwise distillation trains layer l's features from that
layer's teacher q, k alone (seed + l, the same windows, Adam per tensor), so layer l trained with
M features is one tensor whichever student it sits in. Each (loss, layer, M, seed) is trained
once, resumably, into units/ under its key; a student is assembled from its layers' units, and a
rule costs only the units no earlier student had."""

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint import CheckpointError
from ..distill import TERMS, distill_layers
from ..files import as_json
from ..students import make_student, save_student
from ..tensor_files import read_tensors, save_tensors
from . import devices, runs
from .keys import Run, Student, settings, training_inputs
from .runs import log


@dataclass(frozen=True)
class Unit:
    loss: str
    layer: int
    n_features: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.loss}/l{self.layer}/m{self.n_features}/s{self.seed}"

    def path(self, out: Path) -> Path:  # its z and a, with its key and record as metadata
        return out / "units" / f"{self.name.replace('/', '-')}.safetensors"


def units_of(spec: Student) -> list:
    """The units a layerwise student is assembled from, layer by layer."""
    return [Unit(spec.loss, i, m, spec.seed) for i, m in enumerate(spec.dims)]


def distinct_units(specs: list) -> list:
    """The units of the layerwise students among `specs`, each once, in order of first use."""
    layerwise = [spec for spec in specs if spec.loss in TERMS]
    return list(dict.fromkeys(u for spec in layerwise for u in units_of(spec)))


def unit_key(run: Run, unit: Unit) -> dict:
    """What a unit's tensors depend on."""
    key = dict(loss=unit.loss, layer=unit.layer, n_features=unit.n_features, seed=unit.seed)
    return {**training_inputs(run, unit.seed), **key}


def trained(path: Path, key: dict, own: bool = True) -> bool:
    """Whether `path` holds a finished training (its record has "info") made with `key`; one
    that cannot be read (cut short, damaged) is not, and is named when it is the caller's `own`
    file (it is then trained again), not when it is only a candidate twin."""
    try:
        meta = read_tensors(path, tensors=False)[1] if path.is_file() else {}
    except CheckpointError as err:
        if own:
            log(f"redo: {err}")
        return False
    return meta.get("key") == as_json(key) and "info" in meta


def train_units(run: Run, units: list, log=log) -> list:
    """Train the `units` (one loss and seed) that no file holds with their key yet, together: one
    teacher pass a step serves every layer (the tensors are each unit's alone, bit for bit:
    distill_layers), resumable from one progress file; one line names the units trained already.
    Each unit's record: its own loss curve and an equal share of the joint training's seconds.
    The units trained."""
    ready = [unit for unit in units if trained(unit.path(run.cfg.out), unit_key(run, unit))]
    todo = [unit for unit in units if unit not in ready]
    if ready:
        names = ", ".join(unit.name for unit in ready)
        log(f"units trained already, not again (in {run.cfg.out / 'units'}): {names}")
    if not todo:
        return todo
    loss, seed = todo[0].loss, todo[0].seed
    pairs = [(unit.layer, unit.n_features) for unit in todo]
    train, tokens = settings(run, seed), run.texts["train"]
    common = dict(loss=loss, feature_seed=seed, share=devices.shared)
    fitting = functools.partial(distill_layers, run.teacher, pairs, tokens, train, **common)
    keys = {unit.name: unit_key(run, unit) for unit in todo}
    group = run.cfg.out / "units" / f"training-{loss}-s{seed}-{digest(keys)}.safetensors"
    record = {"loss": loss, "units": list(keys), "key": keys}
    save = functools.partial(save_units, run, todo)
    runs.train_into(group, record, train, tokens, fitting, log, save=save)
    return todo


def digest(value) -> str:
    return hashlib.sha256(json.dumps(as_json(value), sort_keys=True).encode()).hexdigest()[:12]


def save_units(run: Run, units: list, layers: dict, _, record: dict):
    """Each of `units` into its own file with its own key (train_into's save)."""
    info = record["info"]
    share = info["train_seconds"] / len(units)
    for unit in units:
        pair = (unit.layer, unit.n_features)
        column = list(layers).index(pair)
        curve = [[step, means[column]] for step, means in info["layer_curves"]]
        tensors = {
            f"blocks.{unit.layer}.attn.features.{n}": p for n, p in layers[pair].named_parameters()
        }
        meta = {"loss": unit.loss, "layer": unit.layer, "key": unit_key(run, unit)}
        unit_info = {"train_seconds": share, "loss_curve": curve}
        save_tensors(tensors, unit.path(run.cfg.out), {**meta, "info": unit_info})


def batch(spec: Student, together: list) -> list:
    """The units that train in one pass when `spec` is assembled first: its own, then those of
    the students `together` (the run's others, dims known) of its loss and seed, each once."""
    mates = [s for s in together if s.dims and (s.loss, s.seed) == (spec.loss, spec.seed)]
    return distinct_units([spec, *mates])


def assemble(run: Run, spec: Student, path: Path, record: dict, together=()) -> dict:
    """A layerwise student saved at `path` with `record`, from its units. If some are not trained
    yet, they train in one pass with every untrained unit of batch(spec, together): the teacher's
    pass, a step's fixed cost, then serves them all. Its info: the units' summed seconds and
    their mean loss curve, step by step (the number a joint training logs, to the bit)."""
    units = units_of(spec)
    done = lambda u: trained(u.path(run.cfg.out), unit_key(run, u), own=False)
    first = not all(map(done, units))  # the first of its batch to train
    mates = [u for u in batch(spec, together) if first and u not in units and not done(u)]
    train_units(run, units + mates)
    devices.barrier()  # the writer has saved them
    student = make_student(run.teacher, "prf", spec.dims, spec.seed)
    seconds, curves = 0.0, []
    for unit in units:
        tensors, meta = read_tensors(unit.path(run.cfg.out))
        student.load_state_dict(tensors, strict=False)  # this layer's z and a
        seconds += meta["info"]["train_seconds"]
        curves.append(meta["info"]["loss_curve"])
    curve = [[rows[0][0], sum(r[1] for r in rows) / len(rows)] for rows in zip(*curves)]
    info = {"train_seconds": seconds, "loss_curve": curve}
    save_student(student, path, {**record, "info": info})
    return info


def cost(run: Run, specs: list) -> dict:
    """What the layerwise students among `specs` (dims known, all trained) cost: the units they
    are assembled from and those units' training seconds, beside the layer trainings the same
    students would take one at a time (each distinct (loss, seed, dims) trained whole once)."""
    layerwise = [s for s in specs if s.loss in TERMS]
    units = distinct_units(layerwise)
    seconds = 0.0
    for unit in units:
        record = read_tensors(unit.path(run.cfg.out), tensors=False)[1]
        seconds += record["info"]["train_seconds"]
    distinct = {(s.loss, s.seed, tuple(s.dims)) for s in layerwise}
    alone = sum(len(dims) for _, _, dims in distinct)
    found = dict(students=len({s.name for s in layerwise}), distinct_students=len(distinct))
    return dict(found, units=len(units), unit_train_seconds=seconds, layer_trainings_alone=alone)


def plan(run: Run, specs: list) -> list:
    """The units of the layerwise students `specs` (dims known), each once, in training order:
    [{"unit", "file", "key", "done"}]."""
    units = distinct_units(specs)
    found = []
    for unit in units:
        key, path = unit_key(run, unit), unit.path(run.cfg.out)
        found.append(dict(unit=unit.name, file=path, key=key, done=trained(path, key, own=False)))
    return found
