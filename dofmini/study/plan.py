"""A run's plan before it starts: every stage with an estimated time, from a timing probe of a few
seconds on this machine scaled by each stage's size; and the progress clock, which rescales the
estimates by the pace so far while the run goes on."""

import time

import torch

from ..distill import TrainSettings, distill, train_direct
from ..students import make_student
from . import data, devices
from .evaluate import PPL_TEXTS
from .runs import RunError, log
from .tasks import TASK_SIZES


def probe(teacher, ctx: int, J: int) -> dict:
    """Seconds per window of ctx tokens, on random tokens after a warm-up: "forward" (with logits);
    a step of each loss and of direct training, each the difference of 3 steps and 1 (building the
    student is not counted); and "dof", three J×J Cholesky factorisations per head. On a GPU each
    timing waits for the device."""
    device = next(teacher.parameters()).device
    shape = (max(2, devices.world()), ctx)  # a window for each rank
    ids = torch.randint(0, teacher.config.vocab_size, shape, generator=torch.Generator())
    ids = ids.to(device)
    if not torch.isfinite(teacher(ids)).all():
        dtype = next(teacher.parameters()).dtype
        why = f"its weights overflow {dtype} in the forward pass"
        raise RunError(f"the teacher's logits on random tokens are not finite: {why}")
    dims, flat = [teacher.config.head_dim] * teacher.config.n_layer, ids.flatten().cpu()
    student = make_student(teacher, "prf", dims, 0)

    def seconds(work) -> float:
        _synchronize(device)
        t0 = time.perf_counter()
        work()
        _synchronize(device)
        return time.perf_counter() - t0

    def train(kind: str, steps: int):
        settings, quiet = TrainSettings(steps=steps, batch=len(ids), ctx=ctx), lambda _: None
        if kind == "direct":
            return lambda: train_direct(student, flat, settings, log=quiet)
        return lambda: distill(teacher, dims, flat, settings, loss=kind, log=quiet)

    seconds(lambda: teacher(ids))  # warm-up
    costs = {"forward": seconds(lambda: teacher(ids)) / len(ids)}
    for kind in ("softmax", "l2", "direct"):
        seconds(train(kind, 1))  # warm-up
        one, three = seconds(train(kind, 1)), seconds(train(kind, 3))
        costs[kind] = ((three - one) / 2 if three > one else three / 3) / len(ids)
    cholesky = lambda: torch.linalg.cholesky(torch.eye(J, dtype=torch.float64))
    costs["dof"] = seconds(cholesky) * teacher.config.n_layer * teacher.config.n_head * 3
    return costs


def _synchronize(device):
    if device.type == "cuda" and torch.cuda.is_initialized():  # else no kernel has been launched
        torch.cuda.synchronize(device)


def _tokens_in(rows) -> int:
    """About how many tokens data files hold (GPT-2's BPE: 4.5 bytes of English a token)."""
    return int(sum(f.size for f in rows) / 4.5)


def stage_sizes(cfg, ctx: int, corpus: list) -> dict:
    """The windows a stage puts through the model, from the data files' sizes: "evaluation" (both
    perplexity texts and the tasks), "train_windows" per student and "error_windows"."""
    texts = [
        _tokens_in(f for f in data.registry() if f.path == p) // ctx for p in PPL_TEXTS.values()
    ]
    texts = [min(w, cfg.eval_windows or w) for w in texts]
    tasks = [] if cfg.limit == 0 else list(TASK_SIZES)
    task_tokens = sum(min(cfg.limit or n, n) * size for n, size in map(TASK_SIZES.get, tasks))
    steps = cfg.steps or _tokens_in(corpus) // ctx // cfg.batch
    found = dict(texts=texts, tasks=len(tasks), evaluation=sum(texts) + task_tokens / ctx)
    return dict(found, train_windows=steps * cfg.batch, error_windows=cfg.error_windows)


def duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.0f} min"


def print_plan(plan: list, costs: dict, sizes: dict, cfg, ctx: int, done: set):
    """What the probe measured, the sizes, each stage's estimate (or "done") and the total."""
    log(
        f"plan (probe on {cfg.device}: forward {costs['forward']:.3f} s, softmax step "
        f"{costs['softmax']:.3f} s, direct step {costs['direct']:.3f} s per window of {ctx}):"
    )
    log(
        f"  each student: {sizes['train_windows'] // cfg.batch} steps of {cfg.batch} windows = "
        f"{sizes['train_windows'] * ctx:,} tokens over {devices.world()} rank(s); evaluation on "
        f"{' and '.join(map(str, sizes['texts']))} windows, {sizes['tasks'] or 'no'} tasks"
    )
    for name, seconds in plan:
        log(f"  {name}: " + ("done" if name in done else f"~{duration(seconds)}"))
    total = sum(seconds for _, seconds in plan)
    log(f"  total: ~{duration(total)} ({len(done)} of {len(plan)} stages done)")


class Clock:
    """The run's plan, [(stage name, estimated seconds)], and a progress line per stage: which stage
    of how many, and the run's estimated time left. The estimates are rescaled by the pace so far,
    measured only on stages that computed something: a stage reloaded as done takes no time, and
    counting it would make a resumed run's pace look many times faster than it is."""

    def __init__(self, plan: list):
        self.plan, self.t0, self.current = plan, time.time(), None
        self.begun, self.worked = set(), {}  # worked: stage name -> seconds spent computing

    def count(self, seconds: float):
        """Count `seconds` of work toward the current stage's pace."""
        self.worked[self.current] = self.worked.get(self.current, 0.0) + seconds

    def timed(self, compute):
        """`compute`, with its seconds counted toward the current stage's pace."""

        def run():
            t0 = time.time()
            result = compute()
            self.count(time.time() - t0)
            return result

        return run

    def begin(self, name: str):
        if name in self.begun:  # a curve student evaluated again later is part of its stage
            return
        self.begun.add(name)
        self.current, estimates = name, dict(self.plan)
        index = list(estimates).index(name)
        measured = sum(estimates[n] for n in self.worked if n != name)
        spent = sum(s for n, s in self.worked.items() if n != name)
        pace = spent / measured if measured > 30 else 1.0
        left = pace * sum(s for _, s in self.plan[index:])
        this = duration(estimates[name] * pace)
        log(f"[{index + 1}/{len(estimates)}] {name} (~{this}; run ~{duration(left)} left)")
