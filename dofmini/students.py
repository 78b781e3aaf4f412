"""Students: a teacher with linear attention swapped in, and their files. A student shares
its teacher's frozen tensors; its file (tensor_files) holds its trainable ones and record (kind,
dims, seed, training, teacher)."""

import copy

from .checkpoint import CheckpointError
from .checks import need_integers, need_one_of
from .dijiang import DiJiangAttention
from .files import as_json
from .linear_attention import LinearAttention
from .tensor_files import read_tensors, save_tensors

KINDS = ("prf", "dijiang")


def replace_attention(model, dims, seed: int, orthogonal: bool = True):
    """Block i's attn becomes LinearAttention (dims[i] features, seed + i), in place."""
    if len(dims) != len(model.blocks):
        raise ValueError(f"replace_attention: {len(dims)} dims for {len(model.blocks)} blocks")
    for i, (block, M) in enumerate(zip(model.blocks, dims)):
        block.attn = LinearAttention(block.attn, int(M), seed + i, orthogonal)
    return model


def make_student(teacher, kind: str, dims, feature_seed: int, orthogonal: bool = True):
    """An untrained student sharing the teacher's tensors: "dijiang", or "prf" with
    `replace_attention`'s features (FAVOR+ unless orthogonal=False)."""
    need_integers("make_student", **{f"dims[{i}]": m for i, m in enumerate(dims)})
    dims = [int(m) for m in dims]
    n_layer = teacher.config.n_layer
    if len(dims) != n_layer:
        raise ValueError(f"make_student: {len(dims)} dims for {n_layer} layers")
    need_one_of("make_student", KINDS, kind=kind)
    shared = (*teacher.parameters(), *teacher.buffers())
    student = copy.deepcopy(teacher, {id(t): t for t in shared})
    # what rebuilds it, for its file
    student.draw = {"kind": kind, "dims": dims, "feature_seed": feature_seed}
    if kind == "prf":
        student.draw["orthogonal"] = orthogonal
        return replace_attention(student, dims, feature_seed, orthogonal)
    for i, block in enumerate(student.blocks):
        block.attn = DiJiangAttention(block.attn, feature_seed + i)
    return student


def trainable(model) -> dict:
    """{name: tensor} of the tensors that train (requires_grad)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def save_student(student, path, record=None):
    """Its trainable tensors, draw, `record` and the teacher's identity."""
    record = {**student.draw, **(record or {}), "teacher": student.identity}
    save_tensors(trainable(student), path, record)


def load_student(teacher, path, expect=None):
    """(A saved student rebuilt on `teacher`, its record). Refuses a file of another
    teacher, with other tensors, or whose record differs from `expect` (e.g. dims, loss)."""
    stored, meta = read_tensors(path)
    wanted = {"teacher": teacher.identity, **as_json(expect or {})}  # tuples as lists
    for field, value in wanted.items():
        if (got := meta.get(field)) != value:
            raise CheckpointError(f"{path}: {field} is {got!r}; expected {value!r}")
    if (kind := meta.get("kind")) not in KINDS:
        raise CheckpointError(f"{path}: kind is {kind!r}; expected one of {KINDS}")
    drawn = [meta.get(k) for k in ("kind", "dims", "feature_seed")]
    student = make_student(teacher, *drawn, meta.get("orthogonal", True))
    shapes = [{n: tuple(t.shape) for n, t in d.items()} for d in (stored, trainable(student))]
    for name in sorted(shapes[0].keys() | shapes[1].keys()):
        if (got := shapes[0].get(name)) != (want := shapes[1].get(name)):
            raise CheckpointError(f"{path}: tensor {name!r} is {got}, the student's {want}")
    student.load_state_dict(stored, strict=False)  # checked above
    return student, meta
