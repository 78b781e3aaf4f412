"""Students: a teacher whose attention layers are swapped for linear attention, and their files.

A student shares every frozen tensor of its teacher (none is copied) and owns only its new
trainable tensors: PRF features z and a = log α per layer ("prf"), or DiJiang's decay, norm and gate
("dijiang"). A student file is a small safetensors file holding just those tensors, with JSON
metadata (kind, dims, seeds, the settings that trained it, the teacher's identity) written in sorted
key order, so the same student always gives the same bytes.
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
    """A copy of the teacher's modules sharing every tensor.

    Swapping the copy's attention leaves the teacher intact.
    """
    shared = {id(t): t for t in (*teacher.parameters(), *teacher.buffers())}
    return copy.deepcopy(teacher, shared)


def make_student(teacher, kind: str, dims, feature_seed: int, orthogonal: bool = True):
    """An untrained student of `kind`.

    "prf" has dims[i] PRF features in layer i, drawn with seed feature_seed + i (FAVOR+ orthogonal
    blocks unless orthogonal=False); "dijiang" uses the head size everywhere. Untrained "prf" is the
    Performer baseline.
    """
    dims = [int(m) for m in dims]
    if len(dims) != teacher.config.n_layer:
        raise ValueError(f"make_student: {len(dims)} dims for {teacher.config.n_layer} layers")
    student = sharing_copy(teacher)
    if kind == "prf":
        replace_attention(student, dims, feature_seed, orthogonal)
    elif kind == "dijiang":
        to_dijiang(student, feature_seed)
    else:
        raise ValueError(f"make_student: unknown kind {kind!r}; expected one of {KINDS}")
    student.meta = {"kind": kind, "dims": dims, "feature_seed": feature_seed}
    if kind == "prf":
        student.meta["orthogonal"] = orthogonal
    return student.to(next(teacher.parameters()).device)


def trainable(model) -> dict:
    """{name: tensor} of the tensors training may change (requires_grad)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def save_tensors(tensors: dict, path, metadata: dict):
    """A safetensors file written atomically. The metadata is one JSON string in sorted key order
    under the key "dofmini": safetensors writes a metadata dict in random order, so the same student
    would otherwise give different bytes."""
    tensors = {n: t.detach().cpu().contiguous() for n, t in sorted(tensors.items())}
    meta = {"dofmini": json.dumps(metadata, sort_keys=True)}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), meta))


def read_tensors(path):
    """(tensors, metadata with JSON-decoded values) of a file save_tensors wrote."""
    try:
        with safe_open(str(path), "pt") as f:
            tensors = {n: f.get_tensor(n) for n in f.keys()}
            raw = f.metadata() or {}
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from None
    try:
        return tensors, json.loads(raw["dofmini"])
    except (KeyError, json.JSONDecodeError) as err:
        raise CheckpointError(
            f"{path}: no dofmini metadata ({type(err).__name__}: {err})"
        ) from None


def save_student(student, path, meta=None):
    """The student's trainable tensors, its kind, dims and seeds, `meta` (loss, settings, ...) and
    the teacher's identity."""
    save_tensors(
        trainable(student), path, {**student.meta, **(meta or {}), "teacher": student.identity}
    )


def load_student(teacher, path):
    """Rebuild a saved student on `teacher`; refuses a file made for another teacher or with other
    tensors."""
    stored, meta = read_tensors(path)
    if meta.get("teacher") != teacher.identity:
        raise CheckpointError(
            f"{path} holds a student of teacher {meta.get('teacher')!r}; "
            f"this teacher is {teacher.identity!r}"
        )
    kind = meta.get("kind")
    if kind not in KINDS:
        raise CheckpointError(f"{path}: student kind {kind!r} unknown; expected one of {KINDS}")
    student = make_student(
        teacher, kind, meta["dims"], meta["feature_seed"], meta.get("orthogonal", True)
    )
    params = trainable(student)
    for name in sorted(params.keys() | stored.keys()):
        want = tuple(params[name].shape) if name in params else None
        got = tuple(stored[name].shape) if name in stored else None
        if want != got:
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {got}, the {kind} student expects {want}"
            )
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(stored[name])
    student.meta = {k: v for k, v in meta.items() if k != "teacher"}
    return student
