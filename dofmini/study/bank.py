"""The bank of layer units (issue 43): layerwise distillation trains layer l's features from that
layer's teacher q, k alone (seed + l, the same windows, Adam per tensor), so layer l trained with
M features is one tensor whichever student it sits in. Each (loss, layer, M, seed) is trained
once, resumably, into units/ under its key; a student is assembled from its layers' units, and a
rule costs only the units no earlier student had."""

import functools
import hashlib
import json
from pathlib import Path

from ..checkpoint import CheckpointError
from ..distill import TERMS, distill_layers
from ..files import as_json
from ..linear_attention import PRFFeatures
from ..students import make_student, save_student
from ..tensor_files import read_tensors, save_tensors
from . import devices, store
from .run import Run, Student, has_fields, is_number
from .store import log


def units_of(run: Run, spec: Student) -> list:
    """The units a layerwise student is assembled from, layer by layer."""
    return [run.unit(spec.loss, i, m, spec.seed) for i, m in enumerate(spec.dims)]


def distinct_units(run: Run, specs: list) -> list:
    """The units of the layerwise students among `specs`, each once, in order of first use."""
    layerwise = [spec for spec in specs if spec.loss in TERMS]
    return list(dict.fromkeys(u for spec in layerwise for u in units_of(run, spec)))


def unit_tensors(run: Run, unit) -> tuple | None:
    """(tensors, record) of `unit`'s file when it holds exactly its layer's features' names, with
    their shapes and dtypes, finite, and its training's seconds and loss curve; else None."""
    try:
        tensors, record = read_tensors(unit.path(run.cfg.out))
    except CheckpointError:
        return None
    config = run.teacher.config
    drawn = PRFFeatures(config.n_head, config.head_dim, unit.n_features, unit.seed + unit.layer)
    prefix = f"blocks.{unit.layer}.attn.features."
    want = {prefix + n: (p.shape, p.dtype) for n, p in drawn.named_parameters()}
    if {n: (t.shape, t.dtype) for n, t in tensors.items()} != want:
        return None
    info = record.get("info")
    curve = has_fields(info, ("loss_curve",), lambda found: isinstance(found, list))
    trained = curve and has_fields(info, ("train_seconds",), is_number)
    finite = all(t.isfinite().all() for t in tensors.values())
    return (tensors, record) if trained and finite else None


def lookup(run: Run, unit) -> tuple:
    """store.lookup of `unit`'s file, its tensors and record checked (unit_tensors)."""
    valid = lambda _: unit_tensors(run, unit) is not None  # noqa: E731
    return store.lookup(unit.path(run.cfg.out), unit.key, valid)


def is_trained(run: Run, unit) -> bool:
    return lookup(run, unit)[0] is not None


def to_train(run: Run, spec: Student, together=(), done=None) -> list:
    """The units that train when `spec` is assembled: none when all of its own are trained (by
    done(unit), default: saved), else every untrained one of its own and of the students
    `together` (the run's others, dims known) of its loss and seed, each once: the teacher's pass,
    a step's fixed cost, then serves them all."""
    done = done or functools.partial(is_trained, run)
    own = units_of(run, spec)
    if all(map(done, own)):
        return []
    mates = [s for s in together if s.dims and (s.loss, s.seed) == (spec.loss, spec.seed)]
    return [unit for unit in distinct_units(run, [spec, *mates]) if not done(unit)]


def train_units(run: Run, units: list, log=log) -> list:
    """Train the `units` (one loss and seed) that no file holds with their key yet, together: one
    teacher pass a step serves every layer (the tensors are each unit's alone, bit for bit:
    distill_layers), resumable from one progress file; one line names the units trained already.
    Each unit's record: its own loss curve and an equal share of the joint training's seconds.
    The units trained."""
    ready = [unit for unit in units if is_trained(run, unit)]
    todo = [unit for unit in units if unit not in ready]
    if ready:
        names = ", ".join(unit.name for unit in ready)
        log(f"units trained already, not again (in {run.cfg.out / 'units'}): {names}")
    if not todo:
        return todo
    for unit in todo:
        if why := lookup(run, unit)[1]:
            log(why)
    loss, seed = todo[0].loss, todo[0].seed
    pairs = [(unit.layer, unit.n_features) for unit in todo]
    train, tokens = run.settings(seed), run.texts["train"]
    common = dict(loss=loss, feature_seed=seed, share=devices.shared)
    fitting = functools.partial(distill_layers, run.teacher, pairs, tokens, train, **common)
    keys = {unit.name: unit.key for unit in todo}
    group = run.cfg.out / "units" / f"training-{loss}-s{seed}-{digest(keys)}.safetensors"
    record = {"loss": loss, "units": list(keys), "key": keys}
    save = functools.partial(save_units, run, todo)
    store.train_into(group, record, train, tokens, fitting, log, save=save)
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
        meta = {"loss": unit.loss, "layer": unit.layer, "key": unit.key}
        unit_info = {"train_seconds": share, "loss_curve": curve}
        save_tensors(tensors, unit.path(run.cfg.out), {**meta, "info": unit_info})


def assemble(run: Run, spec: Student, path: Path, record: dict, together=()) -> dict:
    """A layerwise student saved at `path` with `record`, from its units, the untrained ones
    trained first with to_train's batch. Its info: the units' summed seconds and their mean loss
    curve, step by step (the number a joint training logs, to the bit)."""
    units = units_of(run, spec)
    train_units(run, [*units, *(u for u in to_train(run, spec, together) if u not in units)])
    devices.barrier()  # the writer has saved them
    student = make_student(run.teacher, "prf", spec.dims, spec.seed)
    seconds, curves = 0.0, []
    for unit in units:
        found = unit_tensors(run, unit)
        if found is None:  # trained or checked just now
            said = f"not layer {unit.layer}'s {unit.n_features} finite features and their record"
            why = "a training that diverged, or a file changed since it was checked"
            raise store.RunError(f"{unit.path(run.cfg.out)}: {said} ({why})")
        tensors, meta = found
        student.load_state_dict(tensors, strict=False)  # this layer's z and a alone: checked
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
    units = distinct_units(run, layerwise)
    seconds = 0.0
    for unit in units:
        record = read_tensors(unit.path(run.cfg.out), tensors=False)[1]
        seconds += record["info"]["train_seconds"]
    distinct = {(s.loss, s.seed, tuple(s.dims)) for s in layerwise}
    alone = sum(len(dims) for _, _, dims in distinct)
    found = dict(students=len({s.name for s in layerwise}), distinct_students=len(distinct))
    return dict(found, units=len(units), unit_train_seconds=seconds, layer_trainings_alone=alone)
