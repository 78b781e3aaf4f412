"""What a run will cost here, before it starts. The plan (runner.py) gives each pending stage its
work as counts of a few kinds (below); each kind a pending stage needs is timed twice at the
run's own shapes, and a stage's seconds are its counts times those times. The range runs from
the faster probe divided by SPREAD to the slower times SPREAD: a machine shared with other jobs,
warm-up, and examples longer than the first all move the real time.

The kinds of work, each timed as one:
- "teacher ppl window", "student ppl window": a window of perplexity (the student: the run's
  widest PRF student); "teacher tasks", "student tasks": every task of the run, once;
- "layer window", "e2e window": a held-out window of layer errors, of a student's end-to-end KL;
- "dof window", "dof head": DoF's capture of a calibration window, its algebra on one head;
- ("step", loss, kind): an optimiser step of a whole student (a PRF or DiJiang one, trained
  directly); ("teacher pass", loss) and ("unit step", loss): a layerwise step's teacher pass
  through every layer and what its losses add for every layer's unit;
- ("zero-shot", task), ("fine-tune", task, "teacher" or "student"): one evaluation of a task's
  split; one fine-tuning of a model on it, a student's on its own forward pass."""

import dataclasses
import functools
import math
import time
from pathlib import Path

import torch

from ..distill import distill, train_direct
from ..dof import degrees_of_freedom
from ..students import make_student
from . import data, devices, endtoend, evaluate, finetune, finetune_stages, task_train
from .tasks import load_task

SPREAD = 1.5
PROBE_SEED = 0  # the probes' feature draws and data order
TASK_PROBE = 8  # examples of each task timed together
# fine-tuning's optimiser step is timed on this task's examples only (all six tasks' steps took
# ~20 s on the stand-in): its training examples are near the tasks' mean length weighted by
# their epochs (~300 tokens with every choice; LogiQA's ~750 and Winogrande's ~45 either side)
PROBE_TASK = "mmlu"
HOUR = 3600.0
HOW = (
    "a step of each kind it trains, a batch of each evaluation, each task's first examples, "
    f"each timed twice; ~ the two probes' geometric mean, then the range: the faster / {SPREAD} "
    f"to the slower x {SPREAD}"
)


def timed(compute) -> tuple:
    """(faster, slower) seconds of two calls of compute()."""
    seconds = []
    for _ in range(2):
        t0 = time.perf_counter()
        compute()
        seconds.append(time.perf_counter() - t0)
    return min(seconds), max(seconds)


def scaled(times: tuple, by) -> tuple:
    return tuple(t * b for t, b in zip(times, by if isinstance(by, tuple) else (by, by)))


class Probes:
    """The seconds of each kind of work (the module's list), timed when first asked for."""

    def __init__(self, run):
        self.run = run
        n_layer = run.teacher.config.n_layer
        self.widest = (max(run.budgets),) * n_layer  # the probe student: the largest budget
        self.student = make_student(run.teacher, "prf", self.widest, PROBE_SEED)

    @functools.cache  # noqa: B019 (one Probes a plan)
    def __getitem__(self, kind) -> tuple:
        head, *args = (kind,) if isinstance(kind, str) else kind
        return getattr(self, head.replace(" ", "_").replace("-", "_"))(*args)

    def per_window(self, compute, text: str, windows: int) -> tuple:
        """(faster, slower) seconds a window of one batch of `windows` (the stage's own batch)."""
        run = self.run
        windows = min(windows, len(run.texts[text]) // run.ctx)
        return scaled(timed(lambda: compute(windows)), 1 / windows)

    def teacher_ppl_window(self, model=None) -> tuple:
        run = self.run
        ids = run.texts["wikitext2"][: 8 * run.ctx]
        perplexity = lambda w: evaluate.perplexity(
            model or run.teacher, ids[: w * run.ctx], run.ctx
        )  # noqa: E731
        return self.per_window(perplexity, "wikitext2", 8)

    def student_ppl_window(self) -> tuple:
        return self.teacher_ppl_window(self.student)

    def on_student(self, times: tuple) -> tuple:
        """`times` of the teacher's forward passes, on the probe student's instead."""
        ratio = [s / t for s, t in zip(self["student ppl window"], self["teacher ppl window"])]
        return scaled(times, tuple(ratio))

    def examples(self, task: str) -> tuple:
        """(How many examples of `task` the run scores, the seconds of one scored with a few
        others, as the evaluation batches them)."""
        run = self.run
        pinned = {Path(f.path).name for f in data.files(task)}
        examples = load_task(task, run.cfg.data, run.cfg.limit, pinned)
        first = examples[:TASK_PROBE]
        scored = functools.partial(evaluate.score_examples, run.teacher, run.tokenizer, first)
        return len(examples), scaled(timed(scored), 1 / len(first))

    def example(self, task: str) -> tuple:
        return self[("examples", task)][1]

    def teacher_tasks(self) -> tuple:
        total = (0.0, 0.0)
        for task in self.run.tasks():
            count, each = self[("examples", task)]
            total = tuple(a + b for a, b in zip(total, scaled(each, count)))
        return total

    def student_tasks(self) -> tuple:
        return self.on_student(self["teacher tasks"])

    def layer_window(self) -> tuple:
        run = self.run
        errors = functools.partial(evaluate.layer_errors, run.teacher, self.student,
                                   run.texts["heldout"], run.ctx)  # fmt: skip
        return self.per_window(errors, "heldout", min(4, run.cfg.error_windows))

    def e2e_window(self) -> tuple:
        run = self.run
        kl = functools.partial(endtoend.e2e_kl, run.teacher, [self.student], run.texts["heldout"],
                               run.ctx)  # fmt: skip
        return self.per_window(kl, "heldout", min(4, run.cfg.e2e_windows))

    def forward(self) -> tuple:
        """The teacher's pass through every layer on the batch a step takes."""
        run = self.run
        ids = run.texts["train"][: run.cfg.batch * run.ctx].view(run.cfg.batch, run.ctx)
        device = next(run.teacher.parameters()).device
        return timed(lambda: run.teacher.capture(ids.to(device)))

    def dof_window(self) -> tuple:
        return scaled(self["forward"], 1 / self.run.cfg.batch)

    def dof_head(self) -> tuple:
        run = self.run
        shape = (1, 1, run.cfg.J, run.teacher.config.head_dim)
        x = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator())
        return timed(lambda: degrees_of_freedom(x, run.lam, not run.cfg.raw_gram))

    def step(self, loss: str, kind: str) -> tuple:
        """Two optimiser steps (after one to warm up) of one round of parts (a part on each rank),
        times the rounds a step of the run's batch takes; a layerwise loss: a whole student's."""
        run, world = self.run, devices.world()
        cfg = run.cfg
        parts = -(-cfg.batch // cfg.per_device)
        rounds = -(-parts // world)  # of a part on each rank
        probe = dataclasses.replace(run.settings(PROBE_SEED), steps=3, batch=cfg.per_device * world)
        tokens, loop = run.texts["train"], dict(share=devices.shared)
        n_layer = run.teacher.config.n_layer
        if loss == "direct":
            dims = (run.teacher.config.head_dim,) * n_layer if kind == "dijiang" else self.widest
            start = make_student(run.teacher, kind, dims, PROBE_SEED)
            train = functools.partial(train_direct, start, tokens, probe, **loop)
        else:
            train = functools.partial(distill, run.teacher, self.widest, tokens, probe, loss=loss,
                                      **loop)  # fmt: skip
        seen = []
        train(log=lambda _: None, on_step=lambda state: seen.append(state.seconds))
        steps = [seen[1] - seen[0], seen[2] - seen[1]]
        return min(steps) * rounds, max(steps) * rounds

    def teacher_pass(self, loss: str) -> tuple:
        return tuple(map(min, self["forward"], self[("step", loss, "prf")]))

    def unit_step(self, loss: str) -> tuple:
        return tuple(
            s - f for s, f in zip(self[("step", loss, "prf")], self[("teacher pass", loss)])
        )

    def zero_shot(self, task: str) -> tuple:
        return scaled(self.scored(task), len(self.tuning_splits(task)["eval"][1]))

    def fine_tune(self, task: str, kind: str) -> tuple:
        """Its steps x one optimiser step (timed on PROBE_TASK's first examples), plus each epoch's
        scoring of the selection and evaluation splits x an example's scoring."""
        if kind == "student":
            return self.on_student(self[("fine-tune", task, "teacher")])
        s = finetune_stages.settings_for(self.run, task, 0.0, PROBE_SEED)
        found = self.tuning_splits(task)
        train, select, test = (found[split][1] for split in ("train", "select", "eval"))
        steps = -(-len(train) // s.batch) * s.epochs
        scored = s.epochs * (len(select) + len(test))
        work = zip(scaled(self["tuning step"], steps), scaled(self.scored(task), scored))
        return tuple(map(sum, work))

    @functools.cache  # noqa: B019 (one Probes a plan): each task's files read once, not per kind
    def tuning_splits(self, task: str) -> dict:
        s = finetune_stages.settings_for(self.run, task, 0.0, PROBE_SEED)
        return finetune_stages.splits(self.run, task, s)

    def scored(self, task: str) -> tuple:
        """An evaluation example's scoring: the zero-shot probe's where the run scores the task
        (the same scorer on the same split), else timed on the split's first TASK_PROBE (WSC's,
        SuperGLUE's, is not the zero-shot WSC273)."""
        if task in self.run.tasks():
            return self[("example", task)]
        examples = self.tuning_splits(task)["eval"][1][:TASK_PROBE]
        encoded = finetune.encode(self.run.tokenizer, examples)
        with torch.no_grad():
            times = timed(lambda: finetune.accuracy(self.run.teacher, encoded))
        return scaled(times, 1 / len(encoded))

    def tuning_step(self) -> tuple:
        run = self.run
        model, opt = finetune.trainable(run.teacher, 0.0)  # the rate does not change a step's time
        s = finetune_stages.settings_for(run, PROBE_TASK, 0.0, PROBE_SEED)
        batch = task_train.load_split(PROBE_TASK, "train", run.cfg.data, s.batch)
        encoded = finetune.encode(run.tokenizer, batch)
        step = functools.partial(finetune.train_step, model, opt, encoded, s.part)
        step()  # the warm-up
        return timed(step)


def estimate(run, rows: list) -> dict:
    """{stage name: (low, high) seconds} of the plan's stages not done (runner.Row), probed here."""
    todo = [row for row in rows if not row.done]
    if not todo:
        return {}
    probes = Probes(run)
    seconds = {}
    for row in todo:
        ends = [math.fsum(n * probes[kind][end] for kind, n in row.work.items()) for end in (0, 1)]
        seconds[row.name] = (ends[0] / SPREAD, ends[1] * SPREAD)
    return seconds


def middle(seconds: tuple) -> float:
    """The estimate a (low, high) range stands for: its geometric middle, which is the
    geometric mean of the two probes, the range being symmetric about it."""
    low, high = seconds
    return (low * high) ** 0.5


def span(seconds: tuple) -> str:
    """A (low, high) range of seconds as "~middle (low-high)", in the unit that reads best."""
    units = (("h", HOUR), ("min", 60.0), ("s", 1.0))
    unit, size = next((u, size) for u, size in units if seconds[1] >= 2 * size or u == "s")
    low, high = (x / size for x in seconds)
    centre = middle(seconds) / size
    if high < 10:
        return f"~{centre:.2g} {unit} ({low:.2g}-{high:.2g})"
    return f"~{centre:.0f} {unit} ({low:.0f}-{high:.0f})"


def total(seconds: dict, device: str) -> str:
    """The plan's last words: the range of the stages left, and past an hour on a CPU, what
    costs less."""
    if not seconds:
        return ""
    low, high = (sum(ends) for ends in zip(*seconds.values()))
    said = f"; the rest: {span((low, high))} here"
    if device == "cpu" and low * high > HOUR**2:
        said += "\n  cheaper: --device cuda (a GPU), --profile quick, or --variants fix,dof"
    return said
