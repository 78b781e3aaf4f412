"""What a run is made of: its shared state (Run), a student (Student), the data files it reads,
and each stage's file and key: the settings and inputs its result depends on (runs.stage reuses a
result only for the same key). stages.py computes the stages."""

import itertools
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from ..distill import TrainSettings
from . import data, evaluate, runs
from .progress import duration

# DoF's allocations (dof.allocate): (rule, how a layer's heads combine, capped at the head size,
# each layer's floor as a share of the budget; None: 1 feature).
ALLOCATIONS = {
    "dof": ("proportional", "max", False, None),
    "dof_clip": ("proportional", "max", True, None),
    "dof_mean": ("proportional", "mean", False, None),
    "dof_sqrt": ("power:0.5", "max", False, None),
    "dof_sqrt_mean": ("power:0.5", "mean", False, None),
    "dof_floor": ("proportional", "max", False, 0.5),
    "dof_inv_sqrt": ("power:-0.5", "max", False, None),
    "dof_inv": ("power:-1", "max", False, None),
}
CALIBRATION = "wikitext-2-raw/wiki.valid.raw"  # DoF calibration text, in the data store


@dataclass(frozen=True)
class Student:
    variant: str
    loss: str
    budget: int
    seed: int
    dims: tuple

    @property
    def name(self) -> str:
        return f"{self.variant}/{self.loss}/b{self.budget}/s{self.seed}"

    @property
    def stem(self) -> str:
        return self.name.replace("/", "-")

    def path(self, out: Path) -> Path:  # its tensors, with its key and record as metadata
        return out / "students" / f"{self.stem}.safetensors"


class Clock:
    """The run's start time, its stages in order, [name], and `estimates`, {stage name: estimated
    seconds} (empty unless the plan fills them). The first time a stage begins, a progress line
    says which of how many it is and the wall time since the run started ("run: 3 min 05 s
    elapsed"); with estimates, also the wall time estimated from now to the end of the run ("~25
    min left"): the estimates of this stage and of every stage not yet begun, summed unscaled (a
    resumed run skips its saved stages in no time, so their times say nothing of the estimates'
    scale); a stage without an estimate counts 0. A curve student evaluated again later is part
    of its stage."""

    def __init__(self, plan: list, estimates: dict | None = None):
        self.plan = plan
        self.t0 = time.time()
        self.begun = set()
        self.estimates = dict(estimates or {})

    def begin(self, name: str):
        if name in self.begun:
            return
        self.begun.add(name)
        times = f"run: {duration(time.time() - self.t0)} elapsed"
        if self.estimates:
            ahead = [n for n in self.plan if n == name or n not in self.begun]
            times += f", ~{duration(sum(self.estimates.get(n, 0.0) for n in ahead))} left"
        runs.log(f"[{self.plan.index(name) + 1}/{len(self.plan)}] {name} ({times})")


@dataclass
class Run:
    """What the stages share: the settings (reproduce.RunConfig), the teacher, the texts, the
    inputs every key holds (teacher, tokenizer, device, data file hashes) and the clock."""

    cfg: object
    teacher: object
    tokenizer: object
    ctx: int
    lam: float
    budgets: tuple
    inputs: dict
    texts: dict = field(default_factory=dict)  # name -> token ids
    clock: Clock = field(default_factory=lambda: Clock([]))

    def stage(self, name: str, path: Path, key: dict, valid, compute, split=False):
        """runs.stage of the stage `name` (a file, key and validator of stage_files or
        student_file), begun on the clock."""
        self.clock.begin(name)
        return runs.stage(path, key, compute, split, valid)

    def texts_read(self) -> dict:
        """{text: its data files, in the order read}: DoF's calibration text, the perplexity
        texts and the training corpus, joined in path order, not the registry's row order."""
        corpus = sorted(f.path for f in data.files("corpus"))
        texts = {name: [path] for name, path in evaluate.PPL_TEXTS.items()}
        return dict(calib=[CALIBRATION], **texts, train=corpus)

    def tasks(self) -> tuple:
        return () if self.cfg.limit == 0 else tuple(evaluate.TASKS)

    def files_read(self) -> list:
        """The data files the run reads, in the order read: the texts, then each task's files."""
        texts = itertools.chain(*self.texts_read().values())
        return [*texts, *(f.path for task in self.tasks() for f in data.files(task))]


def eval_key(run: Run) -> dict:
    """What an evaluation's numbers depend on besides the model. `data` pins every data file the
    run verified (a superset of what an evaluation reads: a change to any of them redoes it);
    results.json's inputs["read"] gives the order they are read in."""
    cfg, inputs = run.cfg, run.inputs
    key = dict(ctx=run.ctx, eval_windows=cfg.eval_windows, error_windows=cfg.error_windows)
    key.update(limit=cfg.limit, data={k: v for k, v in inputs.items() if "/" in k})
    return dict(key, tokenizer=inputs["tokenizer"], device=inputs["device"])


def stage_files(run: Run) -> dict:
    """{stage name: (its file, its key, its validator)} of the teacher's evaluation and DoF."""
    cfg, inputs, out = run.cfg, run.inputs, run.cfg.out
    dof = dict(teacher=inputs["teacher"], calib=inputs[CALIBRATION], device=inputs["device"])
    dof.update(seed=cfg.seeds[0], budgets=run.budgets, rules=ALLOCATIONS, lam=run.lam, J=cfg.J)
    dof.update(ctx=run.ctx, calib_windows=cfg.calib_windows, normalize=not cfg.raw_gram)
    teacher = {"teacher": inputs["teacher"], **eval_key(run)}
    return {
        "teacher evaluation": (
            out / "teacher.json",
            teacher,
            partial(valid_evaluation, run, False),
        ),
        "DoF estimate": (out / "allocation.json", dof, partial(valid_allocation, run)),
    }


def settings(run: Run, seed: int) -> TrainSettings:
    """A student's training settings; a RunError for a context TrainSettings refuses."""
    if run.ctx < 2:  # a model of 1 position
        n_pos = run.teacher.config.n_ctx
        raise runs.RunError(f"ctx {run.ctx} ({n_pos} positions in the model): expected 2 or more")
    cfg = run.cfg
    steps = cfg.steps or max(1, len(run.texts["train"]) // (cfg.batch * run.ctx))
    return TrainSettings(
        steps, cfg.batch, run.ctx, cfg.lr, cfg.lr_a, data_seed=seed, part=cfg.per_device
    )


def check_texts(run: Run) -> None:
    """A RunError naming the text, its files and tokens and what needs more, unless each text holds
    enough tokens: DoF's J queries and keys, a window of ctx for each perplexity and training, and
    the held-out windows of the students' errors, curves and end-to-end KL."""
    cfg, ctx = run.cfg, run.ctx
    held_out = cfg.error_windows + cfg.curve_windows + cfg.e2e_windows
    held_out += cfg.e2e_windows if "oracle_e2e" in cfg.variants else 0
    window = (ctx, f"a window of ctx {ctx}")
    calib = -(-cfg.J // (2 * ctx)) * ctx
    students = (held_out * ctx, f"the students' {held_out} held-out windows of ctx {ctx}")
    needs = dict(calib=(calib, f"DoF's {cfg.J} queries and keys"), wikitext2=window)
    needs.update(
        heldout=students if cfg.variants else window, train=window if cfg.variants else (0, "")
    )
    for name, files in run.texts_read().items():
        tokens = len(run.texts[name])
        need, why = needs[name]
        if tokens < need:
            named = ", ".join(str(cfg.data / f) for f in files)
            raise runs.RunError(f"{named}: {tokens} tokens; {need} needed ({why})")


def training_inputs(run: Run, seed: int) -> dict:
    """What every training's tensors depend on besides what it trains: the teacher, tokenizer,
    device, corpus and the settings of `seed`."""
    inputs, corpus = run.inputs, {k: v for k, v in run.inputs.items() if k.startswith("corpus/")}
    key = dict(teacher=inputs["teacher"], tokenizer=inputs["tokenizer"], device=inputs["device"])
    key.update(runs.training_record(settings(run, seed)))
    return dict(key, train=corpus, train_chars=run.cfg.train_chars)


def train_key(run: Run, spec: Student) -> dict:
    """What a student's tensors depend on."""
    key = dict(variant=spec.variant, loss=spec.loss, dims=spec.dims, seed=spec.seed)
    return {**training_inputs(run, spec.seed), **key}


def student_file(run: Run, spec: Student, curve: bool = False) -> tuple:
    """(file, key, validator) of a student's evaluation, or with `curve` of its errors for the
    error curves, on the windows after the reported ones."""
    key = {"student": train_key(run, spec), **eval_key(run)}
    if curve:
        key["windows"] = run.cfg.curve_windows
    valid = partial(valid_errors, run) if curve else partial(valid_evaluation, run, True)
    return run.cfg.out / "eval" / f"{spec.stem}{'-curve' * curve}.json", key, valid


# The shape of each stage's result, checked before a saved one is reused (runs.saved): one of the
# same key cut to {}, a string, a short list or a 0 dim would fail the run instead of redoing it.
def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_list_of(value, count: int, valid) -> bool:
    return isinstance(value, list) and len(value) == count and all(map(valid, value))


def _fields(result, names, valid) -> bool:
    return isinstance(result, dict) and all(valid(result.get(name)) for name in names)


def valid_errors(run: Run, result) -> bool:
    """evaluate.layer_errors': per layer, numbers (None for a layer without PRF features)."""
    n_layer, n_head = run.teacher.config.n_layer, run.teacher.config.n_head
    layers = lambda v: is_list_of(v, n_layer, lambda x: x is None or is_number(x))  # noqa: E731
    heads = lambda v: v is None or is_list_of(v, n_head, is_number)  # noqa: E731
    lists = _fields(result, ("kernel_l2", "kl", "output_rel"), layers)
    return lists and is_list_of(result.get("kl_heads"), n_layer, heads)


def valid_evaluation(run: Run, student: bool, result) -> bool:
    """evaluate.evaluate_model's: each perplexity and task; a student's layer errors too."""
    texts = [f"{name}_{what}" for name in evaluate.PPL_TEXTS for what in ("ppl", "tokens")]
    scores = lambda v: _fields(v, run.tasks(), lambda task: isinstance(task, dict))  # noqa: E731
    found = _fields(result, texts, is_number) and scores(result.get("tasks"))
    return found and (not student or valid_errors(run, result.get("layer_error")))


def valid_allocation(run: Run, result) -> bool:
    """The DoF stage's: per head DoF, and each variant's dims (each >= 1) at each budget."""
    n_layer, variants = run.teacher.config.n_layer, ("fix", *ALLOCATIONS)
    dims = lambda v: is_list_of(v, n_layer, lambda m: type(m) is int and m >= 1)  # noqa: E731
    budget = lambda v: _fields(v, variants, dims)  # noqa: E731
    per_head = is_list_of(isinstance(result, dict) and result.get("per_head"), n_layer, bool)
    return per_head and _fields(result.get("dims"), map(str, run.budgets), budget)
