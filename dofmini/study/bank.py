"""The bank of layer units (issue 43): layerwise distillation trains layer l's features from that
layer's teacher q, k alone (seed + l, the same windows, Adam per tensor), so layer l trained with
M features is one tensor whichever student it sits in. Each (loss, layer, M, seed) is trained
once, resumably, into units/ under its key; a student is assembled from its layers' units, and a
rule costs only the units no earlier student had."""

import functools
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint import CheckpointError
from ..distill import distill_layer
from ..files import as_json
from ..students import make_student, read_tensors, save_student, save_tensors
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


def unit_key(run: Run, unit: Unit) -> dict:
    """What a unit's tensors depend on."""
    key = dict(loss=unit.loss, layer=unit.layer, n_features=unit.n_features, seed=unit.seed)
    return {**training_inputs(run, unit.seed), **key}


def trained(path: Path, key: dict, own: bool = True) -> bool:
    """Whether `path` holds a finished training (its record has "info") made with `key`; one
    that cannot be read (cut short, damaged) is not, and is named when it is the caller's `own`
    file (it is then trained again), not when it is only a candidate twin."""
    try:
        meta = read_tensors(path)[1] if path.is_file() else {}
    except CheckpointError as err:
        if own:
            log(f"redo: {err}")
        return False
    return meta.get("key") == as_json(key) and "info" in meta


def save_unit(features, path: Path, record: dict):
    tensors = {
        f"blocks.{record['layer']}.attn.features.{n}": p for n, p in features.named_parameters()
    }
    save_tensors(tensors, path, record)


def train_unit(run: Run, unit: Unit, log=log) -> bool:
    """Train one unit into its file unless it holds this key already (then it says so); an
    interrupted training resumes from its progress file. Whether it trained."""
    key = unit_key(run, unit)
    path = unit.path(run.cfg.out)
    if trained(path, key):
        log(f"unit {unit.name}: trained already ({path}), not again")
        return False
    train, tokens = settings(run, unit.seed), run.texts["train"]
    common = dict(loss=unit.loss, feature_seed=unit.seed, share=devices.shared)
    layer = (run.teacher, unit.layer, unit.n_features, tokens, train)
    fitting = functools.partial(distill_layer, *layer, **common)
    record = {"loss": unit.loss, "layer": unit.layer, "key": key}
    runs.train_into(path, record, train, tokens, fitting, log, save=save_unit)
    return True


def assemble(run: Run, spec: Student, path: Path, record: dict) -> dict:
    """A layerwise student saved at `path` with `record`, from its units (each trained first if
    no earlier student had it). Its info: the units' summed seconds and their mean loss curve,
    step by step (the number a joint training logs, to the bit)."""
    units = units_of(spec)
    for unit in units:
        train_unit(run, unit)
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


def plan(run: Run, specs: list) -> list:
    """The units of the layerwise students `specs` (dims known), each once, in training order:
    [{"unit", "file", "key", "done"}]."""
    units = dict.fromkeys(
        u for spec in specs if spec.loss in ("l2", "softmax") for u in units_of(spec)
    )
    found = []
    for unit in units:
        key, path = unit_key(run, unit), unit.path(run.cfg.out)
        found.append(dict(unit=unit.name, file=path, key=key, done=trained(path, key, own=False)))
    return found
