"""Fine-tuning (dofmini/study/finetune.py) on the tiny fixture: a made-up task a model can learn
is learnt, the epoch is chosen by the selection split alone, an interrupted fine-tuning resumes to
the same result, a bad --finetune-lr or --finetune-select is refused before any work; the
selection split is apart from the examples trained on and reported; the training splits load
where the data store holds them."""

import dataclasses
import json
import math
import random
import re
import shutil
import sys
import types
from pathlib import Path

import pytest
from conftest import FIXTURES, REPO, data_path, pin_row, tiny_store

from dofmini.students import make_student
from dofmini.study import data, finetune, finetune_stages, task_train
from dofmini.study.tasks import PINNED_UNREAD, TASK_FILES, DataError

sys.path.insert(0, str(REPO))
import reproduce  # noqa: E402

MARK, ANSWERS = 3, (90, 91, 92, 93)


def marked_task(n: int, seed: int) -> list:
    """Encoded examples: random tokens, then MARK and the answer; the choices are the four
    answer tokens, so a model that copies the marked token is right (chance: 1/4)."""
    rng, examples = random.Random(seed), []
    for _ in range(n):
        label = rng.randrange(len(ANSWERS))
        context = [rng.randrange(10, 80) for _ in range(5)] + [MARK, ANSWERS[label]]
        examples.append(([(context, [a]) for a in ANSWERS], label))
    return examples


SMALL = finetune.Settings(lr=1e-3, epochs=1, batch=2, part=1)
# (what is changed in a small fine-tuning, what fine_tune's refusal says after "fine_tune: ")
BAD_FINE_TUNING = [
    (dict(train=[]), "train is empty; expected encoded examples"),
    (dict(select=[]), "select is empty; expected encoded examples"),
    (dict(test=[]), "test is empty; expected encoded examples"),
    (dict(settings=dataclasses.replace(SMALL, batch=0)), r"settings.batch=0; expected an int"),
    (dict(settings=dataclasses.replace(SMALL, batch=True)), r"settings.batch=True; expected"),
    (dict(settings=dataclasses.replace(SMALL, part=0)), r"settings.part=0; expected an int"),
    (dict(settings=dataclasses.replace(SMALL, epochs=0)), r"settings.epochs=0; expected an int"),
    (dict(settings=dataclasses.replace(SMALL, save_every=0)), r"settings.save_every=0; expec"),
    (dict(settings=dataclasses.replace(SMALL, seed=-1)), r"settings.seed=-1; expected an in"),
    (dict(settings=dataclasses.replace(SMALL, lr=0.0)), r"settings.lr=0.0; expected a positive"),
    (dict(settings=dataclasses.replace(SMALL, lr=math.nan)), r"settings.lr=nan; expected a posi"),
    (dict(train=[([([5], [90]), ([5], [91])], 2)]), r"train\[0\]: label 2 for 2 choice\(s\)"),
    (dict(train=[([([5], [90]), ([5], [91])], True)]), r"train\[0\]: label True for 2"),
    (dict(test=[([([5], [90]), ([5], [96])], 0)]),
     r"test\[0\]: choices\[1\]: token id 96; expected an int in \[0, 96\)"),
]  # fmt: skip


@pytest.mark.parametrize("change, says", BAD_FINE_TUNING)
def test_a_fine_tuning_that_cannot_run_is_refused_at_entry(tiny, tmp_path, change, says):
    given = dict(train=marked_task(4, seed=1), select=marked_task(2, seed=5),
                 test=marked_task(2, seed=2), settings=SMALL)  # fmt: skip
    given.update(change)
    with pytest.raises(ValueError, match="fine_tune: " + says) as err:
        finetune.fine_tune(tiny, *(given[k] for k in ("train", "select", "test", "settings")),
                           tmp_path / "p", lambda _: None)  # fmt: skip
    assert err.traceback[-1].name == "fine_tune" and not list(tmp_path.iterdir())


@pytest.mark.parametrize("encoded, says", [
    ([], "encoded is empty"),
    ([([([5], [90]), ([5], [91])], 2)], r"encoded\[0\]: label 2 for 2 choice\(s\)"),
    ([([([5], [90])], 0), ([([5], [-1])], 0)], r"encoded\[1\]: choices\[0\]: token id -1"),
])  # fmt: skip
@pytest.mark.parametrize("function", ["accuracy", "correct"])
def test_examples_that_cannot_be_scored_are_refused_at_entry(tiny, encoded, says, function):
    with pytest.raises(ValueError, match=f"{function}: " + says) as err:
        getattr(finetune, function)(tiny, encoded)
    assert err.traceback[-1].name == function  # the frame of the function called


def test_fine_tuning_learns_a_marked_answer(tiny, tmp_path):
    train, select, test = (marked_task(32, seed=seed) for seed in (1, 5, 2))
    before = finetune.accuracy(tiny, test)
    settings = finetune.Settings(lr=3e-2, epochs=2, batch=4, part=4)
    found = finetune.fine_tune(tiny, train, select, test, settings, tmp_path / "p", print)
    assert before < 0.5 and found["acc"] >= 0.9, (before, found)
    assert len(found["correct"]) == 32 and found["acc"] == sum(found["correct"]) / 32
    assert found["examples"] == dict(train=32, select=32, test=32)
    assert finetune.accuracy(tiny, test) == before  # the model given is left as it was


def test_the_epoch_is_chosen_by_the_selection_split_alone(tiny, tmp_path):
    """The first epoch whose selection acc is the highest is chosen, whatever the evaluation
    examples: other evaluation examples change what is reported, never the epoch; another
    selection split may."""
    train, select = marked_task(24, seed=1), marked_task(8, seed=5)
    settings = finetune.Settings(lr=1e-2, epochs=3, batch=4, part=4)
    tune = lambda picked, test, name: finetune.fine_tune(  # noqa: E731
        tiny, train, picked, test, settings, tmp_path / name, lambda _: None
    )
    found = tune(select, marked_task(6, seed=2), "a")
    accs = found["select_acc"]
    assert len(accs) == 3 and found["epoch"] == accs.index(max(accs)) + 1
    assert found["select"] == max(accs)
    other = tune(select, marked_task(10, seed=7), "b")
    assert (other["select_acc"], other["epoch"]) == (accs, found["epoch"])
    assert len(other["correct"]) == 10 and len(found["correct"]) == 6
    reselected = tune(marked_task(8, seed=9), marked_task(6, seed=2), "c")
    chosen = reselected["select_acc"]
    assert reselected["epoch"] == chosen.index(max(chosen)) + 1


def test_a_killed_fine_tuning_resumes_to_the_same_result(tiny, tmp_path):
    """A PRF student (features and shared weights all training) stopped mid-epoch, after a save,
    then run again, ends where an uninterrupted run ends."""
    student = make_student(tiny, "prf", (8, 8), 0)
    train, select, test = marked_task(24, seed=3), marked_task(4, seed=6), marked_task(8, seed=4)
    settings = finetune.Settings(lr=1e-2, epochs=2, batch=4, part=2, save_every=2)
    run = lambda path, on_step=None: finetune.fine_tune(  # noqa: E731
        student, train, select, test, settings, path, lambda _: None, on_step
    )
    whole = run(tmp_path / "whole")

    def kill(step):
        if step == 3:  # mid-epoch (6 steps each), one step past the save at step 2
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "cut", kill)
    assert (tmp_path / "cut").exists()
    resumed = run(tmp_path / "cut")
    assert not (tmp_path / "cut").exists()
    drop = lambda r: {k: v for k, v in r.items() if k != "train_seconds"}  # noqa: E731
    assert drop(resumed) == drop(whole)


@pytest.mark.parametrize(
    "value, named",
    [("hellaswag=1e-4", "'hellaswag=1e-4'"), ("piqa=-1", "'piqa=-1'"), ("piqa=x", "'piqa=x'"),
     ("mmlu=1e-6,mmlu=1e-5", "given twice")],
)  # fmt: skip
def test_a_bad_finetune_lr_is_refused_before_work(tmp_path, value, named):
    with pytest.raises(SystemExit, match=f"--finetune-lr .*{named}"):
        reproduce.parse_args(["no-such-model", "--finetune-lr", value, "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def test_finetune_lr_values_and_the_paper_preset():
    assert finetune.parse_lr("wsc=1e-6,piqa=5e-5") == (("wsc", 1e-6), ("piqa", 5e-5))
    assert dict(finetune.parse_lr("paper")) == finetune.PAPER_LR
    assert set(finetune.PAPER_LR) == set(task_train.TASKS)


SPLIT_SIZES = {  # training and evaluation examples of each pinned split
    "logiqa": (651, 651), "arc_easy": (2251, 2376), "arc_challenge": (1119, 1172),
    "winogrande": (10234, 1267), "mmlu": (1531, 14042), "wsc": (554, 104),
}  # fmt: skip


@pytest.mark.parametrize("task", task_train.trainable_tasks())
def test_training_splits_load_with_valid_labels(task):
    store = data_path("superglue_wsc")  # the newest group: absent, the store predates them
    store = store.parent
    train, test = (task_train.load_split(task, split, store) for split in ("train", "eval"))
    assert (len(train), len(test)) == SPLIT_SIZES[task]
    for e in train:
        assert 0 <= e.label < len(e.contexts) == len(e.continuations)


# the fine-tuning splits made from the tiny task fixtures (each the task's evaluation examples
# written COPIES times, so that a selection split can be held out of them: these tests time and
# resume the stages, they measure no accuracy)
COPIES = 3
TRAINING_COPIES = {
    "logiqa_ft": {"logiqa/Eval.txt": "logiqa/Test.txt"},
    "arc_easy_train": {"arc/ARC-Easy-Train.jsonl": "arc/ARC-Easy-Test.jsonl"},
    "arc_challenge_train": {"arc/ARC-Challenge-Train.jsonl": "arc/ARC-Challenge-Test.jsonl"},
    "winogrande_train": {
        "winogrande/winogrande_1.1/train_l.jsonl": "winogrande/winogrande_1.1/dev.jsonl"
    },
    "mmlu_train": {
        f"mmlu/val/{s}_val.csv": f"mmlu/test/{s}_test.csv"
        for s in ("astronomy", "abstract_algebra")
    },
}
WSC = [  # SuperGLUE WSC's format: span2_index counts words
    {"text": "The cup fell off the table because it was round.", "label": True,
     "target": {"span1_text": "The cup", "span2_text": "it", "span2_index": 7}},
    {"text": "Ann thanked Mary because she had helped.", "label": False,
     "target": {"span1_text": "Ann", "span2_text": "she", "span2_index": 4}},
]  # fmt: skip


def tuning_store(root: Path) -> tuple:
    """tiny_store with every task (the tiny fixtures) and every fine-tuning split registered."""
    model, env = tiny_store(root)
    store, registry = root / "store", root / "registry.tsv"
    shutil.copytree(FIXTURES / "tasks", store, dirs_exist_ok=True)
    pins = {p: t for t, paths in TASK_FILES.items() for p in paths + PINNED_UNREAD.get(t, ())}
    found = [p for p in (FIXTURES / "tasks").rglob("*") if p.is_file()]
    tasks = [p.relative_to(FIXTURES / "tasks").as_posix() for p in found]
    files = {path: pins.get(path, "mmlu") for path in tasks}  # MMLU's are found, not named
    for group, copies in TRAINING_COPIES.items():
        for made, source in copies.items():
            (store / made).parent.mkdir(exist_ok=True)
            (store / made).write_bytes((store / source).read_bytes() * COPIES)
            files[made] = group
    (store / "superglue_wsc").mkdir()
    for name, copies in (("train.jsonl", COPIES), ("val.jsonl", 1)):
        lines = "".join(json.dumps(e) + "\n" for e in WSC) * copies
        (store / "superglue_wsc" / name).write_text(lines)
        files[f"superglue_wsc/{name}"] = "superglue_wsc"
    rows = [pin_row(group, path, (store / path).read_bytes()) for path, group in files.items()]
    registry.write_text(registry.read_text() + "\n".join(rows) + "\n")
    return model, env


# (the groups a registry leaves out, the rows the refusal names)
UNPINNED = [
    (set(TRAINING_COPIES) | {"superglue_wsc"},  # a registry of before the fine-tuning splits
     "for: logiqa/Eval.txt (logiqa_ft), arc/ARC-Easy-Train.jsonl (arc_easy_train), "),
    ({"mmlu_train"}, "for: mmlu/val/<subject>_val.csv (mmlu_train)\n"),
    ({"superglue_wsc"}, "superglue_wsc/train.jsonl (superglue_wsc), superglue_wsc/val.jsonl ("),
]  # fmt: skip


@pytest.mark.parametrize("left_out, named", UNPINNED)
def test_finetune_without_the_registry_rows_of_its_files_stops_before_any_work(
    tmp_path, left_out, named, reproduce_here
):
    """The files sit where the rows would pin them; unpinned, they are not read: one line names
    the rows and the flag, before any stage (the plan's included)."""
    model, env = tuning_store(tmp_path)
    registry = tmp_path / "registry.tsv"
    rows = registry.read_text().splitlines(keepends=True)
    registry.write_text("".join(row for row in rows if row.split("\t")[0] not in left_out))
    args = ["--profile", "quick", "--variants", "fix", "--finetune", "--plan-only"]
    result = reproduce_here(model, *args, "--out", tmp_path / "o", env=env)
    said = "reproduce.py: error: --finetune reads files the data registry has no row for: "
    assert result.stderr.startswith(said) and named in result.stderr, result.stderr[-2000:]
    assert len(result.stderr.splitlines()) == 1 and "plan (" not in result.stdout


def test_a_training_split_reads_only_registry_rows(tmp_path, monkeypatch):
    """load_split refuses a split whose file no row pins, however it sits in the store."""
    _, env = tuning_store(tmp_path)
    registry = tmp_path / "registry.tsv"
    rows = registry.read_text().splitlines(keepends=True)
    registry.write_text("".join(row for row in rows if not row.startswith("arc_easy_train\t")))
    monkeypatch.setenv("DOFMINI_DATA_REGISTRY", str(registry))
    data.registry.cache_clear()
    try:
        named = r"no row for arc/ARC-Easy-Train.jsonl \(arc_easy_train\), which fine-tuning"
        with pytest.raises(DataError, match=named):
            task_train.load_split("arc_easy", "train", tmp_path / "store")
    finally:
        data.registry.cache_clear()


ESTIMATE = r"~[\d.]+ (s|min|h) \(\d[\d.]*-\d[\d.]*\)"


def test_the_plan_lists_and_costs_each_fine_tuning_then_marks_it_done(tmp_path, reproduce_here):
    """A quick --finetune run (one Fix student, the grid on WSC only): its plan lists the grid,
    the teacher's and the student's fine-tuning, each with an estimate, in the total, and its
    progress lines count them; after it, the plan finds every stage done."""
    model, env = tuning_store(tmp_path)
    rates = ",".join(f"{task}=1e-4" for task in task_train.trainable_tasks() if task != "wsc")
    args = [model, "--profile", "quick", "--variants", "fix", "--finetune-lr", rates]
    args += ["--out", tmp_path / "o"]
    run = reproduce_here(*args, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    tuned = ["fine-tuning teacher: zero-shot", "fine-tuning teacher: grid"]
    tuned += ["fine-tuning teacher/s0", "fine-tuning fix/softmax/b8/s0"]
    for number, stage in enumerate(tuned, start=4):
        assert re.search(rf"\n  {re.escape(stage)}: {ESTIMATE}\n", run.stdout), stage
        assert re.search(rf"\n\[{number}/7\] {re.escape(stage)} \(run: ", run.stdout), stage
    assert re.search(rf"\n  0 of 7 stages done; the rest: {ESTIMATE} here\n", run.stdout)
    report = (tmp_path / "o" / "report.md").read_text()
    assert "## Fine-tuned tasks (Table 3's shape)" in report
    assert "| teacher, not fine-tuned |" in report
    assert "Examples trained on / selection / evaluation: logiqa 1/2/1, arc_easy 1/2/1," in report
    assert "drawn once by random.Random(55)" in report
    # WSC's rate: the grid's best by the selection acc each grid point's record holds
    results = json.loads((tmp_path / "o" / "results.json").read_text())
    chosen = results["finetune"]["lr"]["wsc"]
    best = max(chosen["grid"].values())
    assert chosen["lr"] == min(float(r) for r, acc in chosen["grid"].items() if acc == best)
    grid_seconds = 0.0
    for rate, acc in chosen["grid"].items():
        record = tmp_path / "o" / "finetune" / f"teacher-wsc-lr{rate}-s0.json"
        saved = json.loads(record.read_text())["result"]
        assert saved["select"] == acc
        grid_seconds += saved["train_seconds"]
    assert chosen["train_seconds"] == pytest.approx(grid_seconds, rel=1e-12) and grid_seconds > 0
    # the stages' time counts every fine-tuning's, the grid's too
    tuning_seconds = finetune_stages.train_seconds(results["finetune"])
    assert results["timings"]["stages_seconds"] > tuning_seconds > grid_seconds
    again = reproduce_here(*args, "--plan-only", env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "\n  7 of 7 stages done\n" in again.stdout
    # another selection size: every fine-tuning is made again, the zero-shot scoring is not
    other = reproduce_here(*args, "--plan-only", "--finetune-select", "1", env=env)
    assert other.returncode == 0, other.stderr[-3000:]
    assert "\n  fine-tuning teacher: zero-shot: done\n" in other.stdout
    assert "\n  4 of 7 stages done; the rest: " in other.stdout


def test_a_selection_split_that_leaves_nothing_to_train_is_refused_before_work(
    tmp_path, reproduce_here
):
    model, env = tuning_store(tmp_path)
    for size, says in (
        ("0", "expected 1 or more training examples"),
        (str(COPIES), f"logiqa has {COPIES} training examples; expected 1 to"),
    ):
        args = [model, "--profile", "quick", "--variants", "none", "--finetune"]
        found = reproduce_here(*args, "--finetune-select", size, "--out", tmp_path / "o", env=env)
        assert found.returncode != 0 and f"--finetune-select {size}: {says}" in found.stderr
        assert not (tmp_path / "o" / "finetune").exists()


def test_the_selection_split_is_apart_from_the_trained_and_the_reported_examples(
    tmp_path, monkeypatch, request
):
    """By example id, on every task: the selection split, the examples trained on and the
    evaluation examples are disjoint; the selection split is drawn the same for every seed."""
    model, env = tuning_store(tmp_path)
    monkeypatch.setenv("DOFMINI_DATA_REGISTRY", env["DOFMINI_DATA_REGISTRY"])
    data.registry.cache_clear()  # read once a process: the tiny store's here, then the next's
    request.addfinalizer(data.registry.cache_clear)
    cfg = reproduce.RunConfig(model=model, data=tmp_path / "store")
    run = types.SimpleNamespace(cfg=cfg)  # splits reads only the run's settings
    for task in task_train.trainable_tasks():
        pool = len(task_train.load_split(task, "train", cfg.data))
        s = finetune.Settings(1e-4, select_size=2, select_seed=55, eval_limit=1, seed=0)
        found = finetune_stages.splits(run, task, s)
        ids = {name: set(found[name][0]) for name in ("train", "select", "eval")}
        assert len(ids["select"]) == 2 and ids["train"] | ids["select"] == {
            f"train:{i}" for i in range(pool)
        }
        assert not ids["train"] & ids["select"] and not ids["eval"] & (ids["train"] | ids["select"])
        again = finetune_stages.splits(run, task, dataclasses.replace(s, seed=1, train_limit=1))
        assert again["select"][0] == found["select"][0] and len(again["train"][0]) == 1


def test_a_rate_for_a_task_without_a_training_split_is_said_before_any_work(
    tmp_path, reproduce_here
):
    model, env = tuning_store(tmp_path)
    args = ["--plan-only", "--finetune-lr", "piqa=1e-4,wsc=1e-5", "--out", tmp_path / "o"]
    result = reproduce_here(model, "--profile", "quick", "--variants", "none", *args, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    warning = "reproduce.py: warning: --finetune-lr piqa: no pinned training split, so not used"
    assert result.stdout.startswith(warning), result.stdout[:500]
