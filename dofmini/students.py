"""Students: a teacher whose attention layers are swapped for linear attention, and their files.

A student shares every frozen tensor of its teacher (none is copied) and owns only its new
trainable tensors: PRF features z and a = log α per layer ("prf"), or DiJiang's decay, norm and gate
("dijiang"). A student is one safetensors file, written atomically: just those tensors, with its
record (kind, dims, seeds, the settings that trained it, the teacher's identity) as one JSON string
in sorted key order in the metadata, so the same student always gives the same bytes.
"""

import copy
import json

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .checkpoint import CheckpointError
from .dijiang import to_dijiang
from .files import atomic_write
from .linear_attention import replace_attention

KINDS = ("prf", "dijiang")


def sharing_copy(teacher):
    """A copy of the teacher's modules sharing every tensor: swapping its attention leaves the
    teacher intact."""
    shared = {id(t): t for t in (*teacher.parameters(), *teacher.buffers())}
    return copy.deepcopy(teacher, shared)


def make_student(teacher, kind: str, dims, feature_seed: int, orthogonal: bool = True):
    """An untrained student of `kind`: "prf" has dims[i] PRF features in layer i, drawn with seed
    feature_seed + i (FAVOR+ orthogonal blocks unless orthogonal=False; untrained, the Performer
    baseline); "dijiang" uses the head size everywhere."""
    dims = [int(m) for m in dims]
    if len(dims) != teacher.config.n_layer:
        raise ValueError(f"make_student: {len(dims)} dims for {teacher.config.n_layer} layers")
    if kind not in KINDS:
        raise ValueError(f"make_student: unknown kind {kind!r}; expected one of {KINDS}")
    student = sharing_copy(teacher)
    student.meta = {"kind": kind, "dims": dims, "feature_seed": feature_seed}
    if kind == "prf":
        replace_attention(student, dims, feature_seed, orthogonal)
        student.meta["orthogonal"] = orthogonal
    else:
        to_dijiang(student, feature_seed)
    return student


def trainable(model) -> dict:
    """{name: tensor} of the tensors training may change (requires_grad)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def save_tensors(tensors: dict, path, metadata: dict):
    """A safetensors file written atomically, `metadata` as one sorted JSON string under the key
    "dofmini" (safetensors writes a metadata dict in random order)."""
    tensors = {n: t.detach().cpu().contiguous() for n, t in sorted(tensors.items())}
    meta = {"dofmini": json.dumps(metadata, sort_keys=True)}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), meta))


def read_tensors(path):
    """(tensors, metadata with JSON-decoded values) of a file save_tensors wrote."""
    try:
        with safe_open(str(path), "pt") as f:
            tensors, raw = {n: f.get_tensor(n) for n in f.keys()}, f.metadata() or {}
        return tensors, json.loads(raw["dofmini"])
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {path}: {type(err).__name__}: {err}") from None


def save_student(student, path, meta=None):
    """The student's trainable tensors with its record: kind, dims, seeds, `meta` (loss, settings,
    ...) and the teacher's identity."""
    record = {**student.meta, **(meta or {}), "teacher": student.identity}
    save_tensors(trainable(student), path, record)


def load_student(teacher, path, expect=None):
    """Rebuild a saved student on `teacher`. Refuses a file made for another teacher, with other
    tensors, or whose record differs from `expect` (a dict, e.g. dims, feature_seed, loss)."""
    stored, meta = read_tensors(path)
    if meta.get("teacher") != teacher.identity:
        raise CheckpointError(
            f"{path} holds a student of teacher {meta.get('teacher')!r}; "
            f"this teacher is {teacher.identity!r}"
        )
    # JSON round trip: a tuple of dims compares equal to the list the file holds
    for field, value in json.loads(json.dumps(expect or {})).items():
        if meta.get(field) != value:
            raise CheckpointError(f"{path}: {field} is {meta.get(field)!r}; expected {value!r}")
    if meta.get("kind") not in KINDS:
        raise CheckpointError(f"{path}: student kind {meta.get('kind')!r}; expected one of {KINDS}")
    student = make_student(
        teacher, meta["kind"], meta["dims"], meta["feature_seed"], meta.get("orthogonal", True)
    )
    params = trainable(student)
    for name in sorted(params.keys() | stored.keys()):
        shapes = [tuple(t[name].shape) if name in t else None for t in (stored, params)]
        if shapes[0] != shapes[1]:
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {shapes[0]}, the student expects {shapes[1]}"
            )
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(stored[name])
    student.meta = {k: v for k, v in meta.items() if k != "teacher"}
    return student
