"""Every saved record and layer unit is checked on every reuse (issue 56): a fine-tuning stage, a
zero-shot record, an evaluation part, an evaluation's task score or a unit file that keeps its key
but not its shape (empty, a field missing or of the wrong type, a tensor of another shape, dtype
or name, a NaN) is named in a `redo:` line and made again, to the same numbers. (0.8.5 checked
the end-to-end record already: endtoend.py, beside what it checks.)"""

import json
import shutil

import pytest
from test_finetune import tuning_store
from test_reproduce import reproduce

from dofmini.study import task_train
from dofmini.tensor_files import read_tensors, save_tensors

RATES = ",".join(f"{task}=1e-4" for task in task_train.trainable_tasks())  # no grid
ARGS = ["--profile", "quick", "--variants", "fix", "--finetune", "--finetune-lr", RATES]
STUDENT = "students/fix-softmax-b8-s0.safetensors"
UNIT = "units/softmax-l0-m8-s0.safetensors"
REDO = "its result is not of the shape this stage writes"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A quick --finetune run of one Fix student on the tiny fixtures, every task fine-tuned."""
    root = tmp_path_factory.mktemp("base")
    model, env = tuning_store(root)
    done = reproduce(model, *ARGS, "--out", root / "out", env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return model, env, root / "out"


def result_of(change):
    """A damage that replaces a JSON record's result by change(result), its key kept."""

    def damage(path):
        record = json.loads(path.read_text())
        path.write_text(json.dumps(dict(record, result=change(record["result"]))))

    return damage


def without(field):
    return result_of(lambda result: {k: v for k, v in result.items() if k != field})


def part(name, result):
    """The teacher's evaluation undone but for one saved part, `result` under the right key."""

    def damage(path):
        key = json.loads(path.read_text())["key"]
        path.unlink()
        planted = path.parent / "eval" / "parts" / "teacher" / f"{name}.json"
        planted.parent.mkdir(parents=True)
        planted.write_text(json.dumps({"key": {**key, "part": name}, "result": result}))
        return planted

    return damage


def unit_edit(change):
    """The students assembled again from their units (none copied from a twin), one unit's
    tensors replaced by change(them)."""

    def damage(path):
        for student in (path.parent.parent / "students").glob("*.safetensors"):
            student.unlink()
        tensors, record = read_tensors(path)
        save_tensors(change(tensors), path, record)

    return damage


def renamed(tensors):  # layer 0's z and a under layer 1's names
    return {name.replace("blocks.0.", "blocks.1."): t for name, t in tensors.items()}


TUNED = "finetune/fix-softmax-b8-s0-arc_easy-lr0.0001-s0.json"
DAMAGES = {
    "a fine-tuning record emptied": (TUNED, result_of(lambda _: {})),
    "a fine-tuning record without acc": (TUNED, without("acc")),
    "a fine-tuning record, one example's score flipped": (TUNED, result_of(lambda r: dict(
        r, correct=[1 - r["correct"][0], *r["correct"][1:]]))),
    "a teacher's fine-tuning record a list": (TUNED.replace("fix-softmax-b8-s0", "teacher"),
                                              result_of(lambda r: list(r))),
    "a zero-shot record with acc a string": ("finetune/teacher-wsc-zero-shot.json",
                                             result_of(lambda r: dict(r, acc=str(r["acc"])))),
    "an evaluation part of a text, a string": ("teacher.json",
                                               part("wikitext2", {"result": "x", "seconds": 1})),
    "an evaluation part of a task, acc 2": ("teacher.json",
                                            part("arc_easy", {"result": {"acc": 2.0, "n": 4},
                                                              "seconds": 1.0})),
    "an evaluation's task score without n": ("teacher.json", result_of(lambda r: dict(
        r, tasks={**r["tasks"], "arc_easy": {"acc": 0.5}}))),
    "an end-to-end record a window short": ("eval/fix-softmax-b8-s0-e2e.json", result_of(
        lambda r: dict(r, windows=r["windows"][:-1]))),
    "a unit of 4 features, not 8": (UNIT, unit_edit(lambda t: {n: v[:, :4].clone()
                                                                  for n, v in t.items()})),
    "a unit under another layer's names": (UNIT, unit_edit(renamed)),
    "a unit of NaNs": (UNIT, unit_edit(lambda t: {n: v * float("nan") for n, v in t.items()})),
    "a unit in float64": (UNIT, unit_edit(lambda t: {n: v.double() for n, v in t.items()})),
}  # fmt: skip


def numbers(found):
    """What a run found, without its timings (any field named for seconds, at any depth)."""
    if isinstance(found, dict):
        return {k: numbers(v) for k, v in found.items() if "seconds" not in k}
    return [numbers(v) for v in found] if isinstance(found, list) else found


@pytest.mark.parametrize("name", DAMAGES)
def test_a_saved_record_or_unit_of_another_shape_is_redone(base, tmp_path, name, reproduce_here):
    model, env, out = base
    relative, damage = DAMAGES[name]
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    damaged = damage(copy / relative) or copy / relative
    again = reproduce_here(model, *ARGS, "--out", copy, env=env)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"redo: {damaged}: {REDO}" in again.stdout, again.stdout[-3000:]
    found, expected = (json.loads((o / "results.json").read_text()) for o in (copy, out))
    for part in ("students", "teacher", "finetune"):
        assert numbers(found[part]) == numbers(expected[part]), part
    if relative == UNIT:  # assembled from the unit trained again: the same tensors
        made, first = (read_tensors(o / STUDENT)[0] for o in (copy, out))
        assert made.keys() == first.keys()
        assert all(made[tensor].equal(first[tensor]) for tensor in first)
