"""What a run will cost here, before it starts: each kind of work timed twice at the run's own
shapes (an optimiser step of each kind the run trains, one batch of each evaluation, the first
few examples of each task together, DoF's algebra on one head, a fine-tuning step), then
multiplied by the counts each stage needs. The range runs from the faster probe divided by
SPREAD to the slower times SPREAD: a machine shared with other jobs, warm-up, and examples longer
than the first all move the real time."""

import dataclasses
import functools
import time
from pathlib import Path

import torch

from ..distill import distill, train_direct
from ..dof import degrees_of_freedom
from ..students import make_student
from . import data, devices, endtoend, evaluate, finetune, finetune_stages, plan, stages, task_train
from .keys import settings
from .tasks import load_task

SPREAD = 1.5
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


def per_window(compute, model, run, text: str, windows: int) -> tuple:
    """(faster, slower) seconds a window of one batch of `windows` (the stage's own batch):
    compute(model, the text's first windows, ctx) for perplexity, else compute(windows)."""
    windows = min(windows, len(run.texts[text]) // run.ctx)
    ids = run.texts[text][: windows * run.ctx]
    call = (lambda: compute(model, ids, run.ctx)) if model else (lambda: compute(windows))
    return tuple(seconds / windows for seconds in timed(call))


def step_kind(spec) -> tuple | None:
    """(loss, student kind) of a student's training steps; None for the untrained Performer."""
    if spec.variant == "performer":
        return None
    return spec.loss, "dijiang" if spec.variant == "dijiang" else "prf"


def step_seconds(run, loss: str, kind: str, dims: tuple) -> tuple:
    """(faster, slower) seconds of one optimiser step: two steps (after one to warm up) of one
    round of parts (a part on each rank), times the rounds a step of the run's batch takes. A
    layerwise loss: the step of a whole student, every layer's unit from one teacher pass
    (bank.train_units)."""
    cfg, world = run.cfg, devices.world()
    parts = -(-cfg.batch // cfg.per_device)
    rounds = -(-parts // world)
    probe = dataclasses.replace(settings(run, 0), steps=3, batch=cfg.per_device * world)
    tokens = run.texts["train"]
    loop = dict(share=devices.shared)
    if loss == "direct":
        student = make_student(run.teacher, kind, dims, 0)
        steps = two_steps(functools.partial(train_direct, student, tokens, probe, **loop))
    else:
        student = functools.partial(distill, run.teacher, dims, tokens, probe, loss=loss, **loop)
        steps = two_steps(student)
    return min(steps) * rounds, max(steps) * rounds


def forward_seconds(run) -> tuple:
    """(faster, slower) seconds of the teacher's pass through every layer on the batch a step
    takes: the share of a layerwise step that does not shrink with fewer units."""
    cfg = run.cfg
    ids = run.texts["train"][: cfg.batch * run.ctx].view(cfg.batch, run.ctx)
    device = next(run.teacher.parameters()).device
    return timed(lambda: run.teacher.capture(ids.to(device)))


def two_steps(train) -> list:
    """The seconds of each of two optimiser steps of train(log=, on_step=), after a first one
    that warms up (allocations, caches) and is not counted."""
    seen = []
    train(log=lambda _: None, on_step=lambda state: seen.append(state.seconds))
    return [seen[1] - seen[0], seen[2] - seen[1]]


def probe(run, students: list) -> dict:
    """{what: (faster, slower) seconds} of each unit of work the students and stages need."""
    cfg = run.cfg
    teacher = run.teacher
    ctx = run.ctx
    n_layer, head_dim = teacher.config.n_layer, teacher.config.head_dim
    widest = (max(run.budgets),) * n_layer  # the probe student: the largest budget
    found = {}
    for kind in dict.fromkeys(filter(None, map(step_kind, students))):
        dims = (head_dim,) * n_layer if kind[1] == "dijiang" else widest
        found[kind] = step_seconds(run, *kind, dims)
    found["forward"] = forward_seconds(run)
    student = make_student(teacher, "prf", widest, 0)
    heldout = run.texts["heldout"]
    found["ppl"] = per_window(evaluate.perplexity, teacher, run, "wikitext2", 8)
    found["student ppl"] = per_window(evaluate.perplexity, student, run, "wikitext2", 8)
    errors = functools.partial(evaluate.layer_errors, teacher, student, heldout, ctx)
    found["layer"] = per_window(errors, None, run, "heldout", min(4, cfg.error_windows))
    kl = functools.partial(endtoend.e2e_kl, teacher, [student], heldout, ctx)
    found["e2e"] = per_window(kl, None, run, "heldout", min(4, cfg.e2e_windows))
    x = torch.randn(1, 1, cfg.J, head_dim, dtype=torch.float64, generator=torch.Generator())
    found["dof head"] = timed(lambda: degrees_of_freedom(x, run.lam, not cfg.raw_gram))
    tasks = [0.0, 0.0]
    for name in run.tasks():
        pinned = {Path(f.path).name for f in data.files(name)}
        examples = load_task(name, cfg.data, cfg.limit, pinned)
        # a few examples at once, as the evaluation batches them: one alone costs more
        first = examples[:TASK_PROBE]
        scored = functools.partial(evaluate.score_examples, teacher, run.tokenizer, first)
        each = [seconds / len(first) for seconds in timed(scored)]
        found[("example", name)] = tuple(each)
        tasks = [total + len(examples) * t for total, t in zip(tasks, each)]
    found["tasks"] = tuple(tasks)
    return found


def tuning_probe(run, found: dict) -> dict:
    """{("fine-tune", task): (faster, slower) seconds of the teacher's fine-tuning on `task` at
    the run's sizes (finetune_stages.settings_for)}: its steps x one optimiser step (two timed
    after one to warm up) on PROBE_TASK's first training examples, plus each epoch's evaluation
    x an example's scoring: the task probe's per example in `found` (the same scorer,
    evaluate.score_requests, on the same split), else timed on the split's first TASK_PROBE
    (WSC's, SuperGLUE's, is not the zero-shot WSC273); ("zero-shot", task): one evaluation."""
    cfg = run.cfg
    model, opt = finetune.trainable(run.teacher, 0.0)  # the rate does not change a step's time
    s = finetune_stages.settings_for(run, PROBE_TASK, 0.0, cfg.seeds[0])
    batch = task_train.load_split(PROBE_TASK, "train", cfg.data, s.batch)
    encoded = finetune.encode(run.tokenizer, batch)
    step = functools.partial(finetune.train_step, model, opt, encoded, s.part)
    step()  # the warm-up
    steps, tuning = timed(step), {}
    for task in task_train.trainable_tasks():
        s = finetune_stages.settings_for(run, task, 0.0, cfg.seeds[0])
        train = task_train.load_split(task, "train", cfg.data, s.train_limit)
        test = task_train.load_split(task, "eval", cfg.data, s.eval_limit)
        each = found.get(("example", task)) or scoring(run, model, test[:TASK_PROBE])
        count = -(-len(train) // s.batch) * s.epochs
        scored = s.epochs * len(test)
        tuning[("fine-tune", task)] = tuple(count * t + scored * e for t, e in zip(steps, each))
        tuning[("zero-shot", task)] = tuple(len(test) * e for e in each)
    return tuning


def scoring(run, model, examples: list) -> list:
    """[faster, slower] seconds an example of `examples` takes to score together (the
    fine-tuning's accuracy after an epoch)."""
    encoded = finetune.encode(run.tokenizer, examples)
    with torch.no_grad():
        return [t / len(examples) for t in timed(lambda: finetune.accuracy(model, encoded))]


def tuning_seconds(run, name: str, unit: dict) -> float:
    """A fine-tuning stage's seconds (finetune_stages.models_of's names, the grid's, or the
    zero-shot scoring's): each task's fine-tuning once a model, or once a grid point; a
    student's on its own forward pass."""
    tasks = task_train.trainable_tasks()
    if name == finetune_stages.ZERO_STAGE:
        return sum(unit[("zero-shot", t)] for t in tasks)
    grid = name == finetune_stages.GRID_STAGE
    counts = {t: len(finetune_stages.grid(run, t)) if grid else 1 for t in tasks}
    seconds = sum(n * unit[("fine-tune", t)] for t, n in counts.items())
    teacher = name.startswith(f"{finetune_stages.PREFIX}teacher")
    return seconds if teacher else seconds * unit["student ppl"] / unit["ppl"]


def stage_seconds(run, name: str, spec, unit: dict, fresh: dict) -> float:
    """One stage's seconds with `unit` the seconds of each unit of work (perplexity and tasks:
    under torchrun the ranks share them, and so did the probe's); a layerwise student trains
    only the layer units `fresh` gives it (plan.new_units: their count and the layers the
    teacher runs for them; all of them where it has None): the teacher's pass scales with the
    deepest, the losses with the count."""
    cfg, n_layer = run.cfg, run.teacher.config.n_layer
    texts = [len(run.texts[text]) // run.ctx for text in evaluate.PPL_TEXTS]
    ppl_windows = sum(min(n, cfg.eval_windows or n) for n in texts)
    if name.startswith(finetune_stages.PREFIX):
        return tuning_seconds(run, name, unit)
    if name == "teacher evaluation":
        return ppl_windows * unit["ppl"] + unit["tasks"]
    if name == "DoF estimate":  # the teacher's layers without its head, then each head's algebra
        heads = n_layer * run.teacher.config.n_head
        capture = cfg.calib_windows * unit["forward"] / cfg.batch
        return capture + heads * unit["dof head"]
    if name == endtoend.SWAP_STAGE:  # the teacher and each layer's swap, per curve student
        return len(stages.curve_specs(run)) * cfg.e2e_windows * (n_layer + 1) * unit["ppl"]
    kind = step_kind(spec)
    step = unit[kind] if kind else 0.0
    if spec.loss in stages.LAYERWISE:  # the units it trains first; None: all, unknown yet
        count, deepest = fresh.get(spec.name) or (n_layer, n_layer)
        forward = min(unit["forward"], step)
        step = forward * deepest / n_layer + (step - forward) * count / n_layer
    seconds = settings(run, spec.seed).steps * step
    oracles = set(stages.ORACLES) & set(cfg.variants)
    if (
        oracles
        and (spec.variant, spec.loss) == ("fix", "softmax")
        and spec.budget in cfg.curve_dims
    ):
        seconds += cfg.curve_windows * unit["layer"]  # its error curves
    if spec.variant == "fix" and spec.budget not in run.budgets:  # a curve student only
        return seconds
    before = 2 if spec.variant in stages.TRAINED_PRF else 1  # and the untrained draw's errors
    seconds += before * cfg.error_windows * unit["layer"] + cfg.e2e_windows * unit["e2e"]
    scale = unit["student ppl"] / unit["ppl"]  # the tasks on the student's forward pass
    return seconds + ppl_windows * unit["student ppl"] + scale * unit["tasks"]


def estimate(run, todo: list) -> dict:
    """{stage name: (low, high) seconds} of the stages in `todo` (plan names), probed here."""
    if not todo:
        return {}
    specs = plan.students(run)
    found = probe(run, [specs[name] for name in todo if name in specs])
    if any(name.startswith(finetune_stages.PREFIX) for name in todo):
        found |= tuning_probe(run, found)
    ends = [{what: times[end] for what, times in found.items()} for end in (0, 1)]
    fresh = plan.new_units(run)
    seconds = {n: [stage_seconds(run, n, specs.get(n), unit, fresh) for unit in ends] for n in todo}
    return {name: (low / SPREAD, high * SPREAD) for name, (low, high) in seconds.items()}


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
