"""Progress and resume of the evaluation stages: plain progress lines for a slow loop, the stage
lines' elapsed time and time left, and an evaluation interrupted after some of its parts that a
rerun finishes, redoing only the parts that had not finished, with the uninterrupted result."""

import json
import re
import time
from types import SimpleNamespace

import pytest

from dofmini.students import make_student
from dofmini.study import compute, progress, store
from dofmini.study.evaluate import perplexity
from dofmini.study.progress import Progress, duration
from dofmini.study.run import Run
from dofmini.study.runner import Runner

LINE = re.compile(r"^slow: (\d)/4 windows, \d+ s elapsed, ~\d+ s left$")


def test_a_slow_loop_prints_a_line_each_interval(capsys):
    with Progress("slow", 4, "windows", every=0.005) as shown:
        for _ in range(4):
            time.sleep(0.01)  # longer than the interval: a line after each item
            shown.update(1)
    lines = capsys.readouterr().out.splitlines()
    assert [int(LINE.match(line)[1]) for line in lines] == [1, 2, 3, 4], lines


def test_a_fast_loop_prints_nothing_and_perplexity_names_its_text(tiny, tiny_ids, capsys):
    perplexity(tiny, tiny_ids[:160], 16, batch=2, what="perplexity wikitext2")
    assert capsys.readouterr().out == ""  # well under the 30 s interval
    progress_every = progress.EVERY
    try:
        progress.EVERY = 0.0  # every batch
        perplexity(tiny, tiny_ids[:160], 16, batch=2, what="perplexity wikitext2")
    finally:
        progress.EVERY = progress_every
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(",")[0] for line in lines] == [
        f"perplexity wikitext2: {n}/10 windows" for n in (2, 4, 6, 8, 10)
    ]


def test_durations_read_as_wall_times():
    want = ["0 s", "41 s", "3 min 05 s", "2 h 07 min"]
    assert [duration(s) for s in (0.4, 41, 185, 7620)] == want


def test_stage_lines_give_the_runs_elapsed_time_and_with_estimates_the_time_left(tmp_path, capsys):
    plan = ["teacher evaluation", "DoF estimate", "fix/softmax/b8/s0"]
    rows = [SimpleNamespace(name=name) for name in plan]
    seconds = {"teacher evaluation": 60, "DoF estimate": 120, "fix/softmax/b8/s0": 30}
    runner = Runner(rows, seconds)
    for i, name in enumerate((*plan[:2], plan[1], plan[2])):  # a stage's next file adds no line
        runner.stage(name, tmp_path / f"{i}.json", {}, dict)
    Runner(rows).stage(plan[0], tmp_path / "0.json", {}, dict)
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("[")] == [
        "[1/3] teacher evaluation (run: 0 s elapsed, ~3 min 30 s left)",
        "[2/3] DoF estimate (run: 0 s elapsed, ~2 min 30 s left)",
        "[3/3] fix/softmax/b8/s0 (run: 0 s elapsed, ~30 s left)",
        "[1/3] teacher evaluation (run: 0 s elapsed)",
    ]


class Stop:
    """A forward hook that raises KeyboardInterrupt (as Ctrl-C or guard._stop's SIGTERM does) at
    the model's `at`-th forward pass, and counts them."""

    def __init__(self, at=None):
        self.at, self.calls = at, 0

    def __call__(self, module, args, output):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt("SIGTERM")


def student_run(tiny, tiny_ids, out):
    """A Run on the tiny fixture, no tasks; its student's evaluation has three parts: the layer
    errors, then the perplexity of two texts (one batch each)."""
    cfg = SimpleNamespace(out=out, data=None, eval_windows=4, limit=0, error_windows=2)
    cfg.__dict__.update(curve_windows=0, e2e_windows=0, heldout_skip=0)
    texts = {"wikitext2": tiny_ids[:1024], "heldout": tiny_ids[1024:]}
    return Run(cfg, tiny, None, 32, 1.0, (8,), {}, texts)


def evaluation(run, path, key, student):
    """A student's evaluation stage, as the pipeline runs it: saved whole, then its parts
    removed."""
    measure = compute.evaluation(run, "prf", path, key, lambda: student, student=True)
    found = store.load_or_compute(path, key, measure, split=True)
    compute.remove_parts(run, path)
    return found


def evaluate_with(run, hook):
    student = make_student(run.teacher, "prf", (8, 8), 0)
    student.register_forward_hook(hook)
    return evaluation(run, run.cfg.out / "eval" / "prf.json", {"student": "prf"}, student)


def without_seconds(result: dict) -> dict:
    return {k: v for k, v in result.items() if not k.endswith("seconds")}


def test_an_interrupted_evaluation_redoes_only_its_unfinished_parts(
    tiny, tiny_ids, tmp_path, capsys
):
    whole = evaluate_with(student_run(tiny, tiny_ids, tmp_path / "whole"), Stop())
    run = student_run(tiny, tiny_ids, tmp_path / "cut")
    with pytest.raises(KeyboardInterrupt):  # in the second text, its first forward pass
        evaluate_with(run, Stop(at=2))
    parts = tmp_path / "cut" / "eval" / "parts" / "prf"
    assert sorted(p.name for p in parts.iterdir()) == ["layer_error.json", "wikitext2.json"]
    assert not (tmp_path / "cut" / "eval" / "prf.json").exists()
    capsys.readouterr()
    again = Stop()
    resumed = evaluate_with(run, again)
    assert "prf: layer_error, wikitext2 done; redoing heldout" in capsys.readouterr().out
    assert again.calls == 1  # the heldout text's one batch, nothing else
    assert without_seconds(resumed) == without_seconds(whole)
    stage_file = json.loads((tmp_path / "cut" / "eval" / "prf.json").read_text())
    assert without_seconds(stage_file["result"]) == without_seconds(whole)
    assert not (tmp_path / "cut" / "eval" / "parts").exists()  # removed once the stage is saved


def test_a_part_of_other_settings_is_not_reused(tiny, tiny_ids, tmp_path, capsys):
    run = student_run(tiny, tiny_ids, tmp_path)
    with pytest.raises(KeyboardInterrupt):
        evaluate_with(run, Stop(at=2))
    run.cfg.eval_windows = 2  # a rerun of other settings: its key changes (eval_key holds it)
    student = make_student(tiny, "prf", (8, 8), 0)
    again = Stop()
    student.register_forward_hook(again)
    path = tmp_path / "eval" / "prf.json"
    evaluation(run, path, {"student": "prf", "eval_windows": 2}, student)
    out = capsys.readouterr().out
    assert "done; redoing" not in out and again.calls == 2 and "wikitext2.json: eval_windows" in out
