"""The paper's comparison for one teacher, in one command: estimate DoF, allocate feature dims,
train every variant at every budget and seed, evaluate everything, and write results.json,
report.md and SVG charts.

    python reproduce.py gpt2                        # a named model, downloaded once into weights/
    python reproduce.py path/to/checkpoint --profile quick

Every setting of a run is one field of RunConfig below. Each stage saves its result under --out with
the settings and inputs that made it; running again reuses a stage only when they match.
"""

import argparse
import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import dofmini
from dofmini import dof
from dofmini.checkpoint import CheckpointError, load_tokenizer, locate, resolve
from dofmini.distill import distill, train_direct
from dofmini.files import sha256_file, write_text
from dofmini.students import load_student, make_student, read_tensors, save_student, save_tensors
from dofmini.study import data, evaluate, report
from dofmini.study.runs import (
    Clock,
    duration,
    log,
    probe,
    provenance,
    saved_result,
    stage,
    token_ids,
)

VARIANTS = ("performer", "dijiang", "fix", "dof", "dof_clip", "oracle")
LOSSES = ("softmax", "l2", "direct")
TRAINED_PRF = ("fix", "dof", "dof_clip", "oracle")  # variants whose draw is trained
CALIBRATION = "wikitext-2-raw/wiki.valid.raw"  # DoF calibration text, in the data store
PROMPT = "The history of the city begins in the"
SEED_LIMIT = 2**31 - 1  # seeds are offset by the layer index and must stay within torch's range
# steps None: one pass over the training corpus (the paper's one pass over its Wikipedia slice);
# eval_windows None: all of each perplexity text; limit 0: no tasks.
PROFILES = {
    "quick": dict(
        ctx=64,
        J=128,
        calib_windows=8,
        steps=4,
        batch=2,
        eval_windows=4,
        limit=4,
        error_windows=4,
        curve_windows=4,
        train_chars=200_000,
    ),
    "default": dict(
        ctx=256,
        J=1024,
        calib_windows=64,
        steps=400,
        batch=8,
        eval_windows=128,
        limit=100,
        error_windows=32,
        curve_windows=16,
        train_chars=None,
    ),
    "study": dict(
        ctx=256,
        J=1024,
        calib_windows=64,
        steps=200,
        batch=8,
        eval_windows=64,
        limit=0,
        error_windows=32,
        curve_windows=16,
        train_chars=None,
        seeds=(0, 1, 2),
        budgets=(16, 32, 64),
        variants=("fix", "dof", "oracle"),
        losses=(("softmax", None), ("l2", (64,))),
    ),
    "paper": dict(
        ctx=None,
        J=1024,
        calib_windows=64,
        steps=None,
        batch=8,
        eval_windows=None,
        limit=None,
        error_windows=32,
        curve_windows=16,
        train_chars=None,
    ),
}


@dataclass(frozen=True)
class RunConfig:
    """Every setting a run depends on. Profiles fill the sizes; flags override single fields."""

    model: str
    profile: str = "default"
    out: Path | None = None  # default runs/<model>-<profile>
    data: Path | None = None  # the data store; default DOFMINI_DATA or the user cache
    device: str = "cpu"
    variants: tuple = ("performer", "dijiang", "fix", "dof", "dof_clip")
    losses: tuple = (("softmax", None),)  # (loss, budgets it runs at; None: every budget)
    seeds: tuple = (0,)  # each sets the feature draw and the data order; Fix and DoF share it
    budgets: tuple | None = None  # mean features per layer; None: the head size
    curve_dims: tuple = (8, 16, 32, 64, 128)  # per-layer error curves, for the oracle
    lam: float | None = None  # DoF λ; None: 2^-4 for GPT-2, 2^-8 for Pythia (the paper's)
    J: int = 1024  # queries and keys sampled per head for DoF
    raw_gram: bool = False  # DoF from the raw Gram G instead of G/J
    sweep: bool = False  # also sweep λ and J (sweep.md)
    plan_only: bool = False  # print the plan and stop
    ctx: int | None = 256  # None: the model's own context, at most MAX_CTX
    calib_windows: int = 64  # windows of WikiText-2 valid for DoF
    steps: int | None = 400  # optimiser steps per student; None: one pass over the corpus
    batch: int = 8  # windows per step
    lr: float = 0.02  # z (the paper's)
    lr_a: float = 0.2  # a = log α (the paper's)
    train_chars: int | None = None  # read only this many characters of the corpus
    eval_windows: int | None = 128  # perplexity windows per text; None: all
    limit: int | None = 100  # examples per task; None: all; 0: no tasks
    error_windows: int = 32  # held-out windows for the per-layer errors
    curve_windows: int = 16  # the next held-out windows, for the error curves
    max_ctx: int = 2048
    sweep_lams: tuple = (2.0**-12, 2.0**-8, 2.0**-4, 1.0)
    sweep_Js: tuple = (256, 512, 1024, 2048)

    def loss_budgets(self, budgets):
        """[(loss, budget)] this run trains the PRF variants at."""
        return [
            (loss, b) for loss, only in self.losses for b in budgets if only is None or b in only
        ]


def parse_args(argv) -> RunConfig:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument(
        "model",
        help="a known name (gpt2, pythia-70m, -160m, -410m, -1b) or a folder\n"
        "holding config.json, model.safetensors, tokenizer.json",
    )
    p.add_argument(
        "--profile",
        choices=PROFILES,
        default="default",
        help="quick: a smoke run; default: one seed, one budget; study: seeds 0-2,\n"
        "budgets 16/32/64, Fix/DoF/oracle, softmax and l2@64; paper: the paper's\n"
        "sizes, meant for a GPU",
    )
    p.add_argument("--out", type=Path, help="output folder (default runs/<model>-<profile>)")
    p.add_argument("--data", type=Path, help="data store (default $DOFMINI_DATA, else the cache)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--variants", help=f"comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument(
        "--loss",
        help="comma-separated losses for the PRF variants, from "
        f"{', '.join(LOSSES)};\nLOSS:B1/B2 runs LOSS at those budgets only",
    )
    p.add_argument("--seeds", help="comma-separated seeds (default 0)")
    p.add_argument("--seed", type=int, help="one seed (same as --seeds N)")
    p.add_argument("--budgets", help="comma-separated mean features per layer (default: head size)")
    p.add_argument("--limit", type=int, help="first N examples per task (0: no tasks)")
    p.add_argument("--lam", type=float, help="DoF λ (default 2^-4 for GPT-2, 2^-8 for Pythia)")
    p.add_argument("--raw-gram", action="store_true", help="DoF from the raw Gram G, not G/J")
    p.add_argument("--sweep", action="store_true", help="also sweep λ and J (sweep.md)")
    p.add_argument(
        "--plan-only",
        action="store_true",
        help="print the plan (downloads, stages, estimated times) and stop",
    )
    args = p.parse_args(argv)
    fields = dict(PROFILES[args.profile])
    fields.update(
        model=args.model,
        profile=args.profile,
        out=args.out,
        data=args.data,
        device=args.device,
        raw_gram=args.raw_gram,
        sweep=args.sweep,
        plan_only=args.plan_only,
    )
    if args.variants:
        fields["variants"] = tuple(args.variants.split(","))
    if args.loss:
        fields["losses"] = tuple(_loss_spec(part) for part in args.loss.split(","))
    if args.seeds or args.seed is not None:
        fields["seeds"] = _ints("--seeds", args.seeds) if args.seeds else (args.seed,)
    if args.budgets:
        fields["budgets"] = _ints("--budgets", args.budgets)
    for name in ("limit", "lam"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    return check(RunConfig(**fields))


def _fail(message: str):
    raise SystemExit(f"reproduce.py: error: {message}")


def _ints(flag: str, text: str) -> tuple:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        _fail(f"{flag} {text!r}: expected comma-separated integers")


def _loss_spec(text: str):
    loss, _, budgets = text.partition(":")
    return loss, (_ints("--loss", budgets.replace("/", ",")) if budgets else None)


def check(cfg: RunConfig) -> RunConfig:
    """Every value checked before any model or data work; one line naming the flag and the value."""
    for variant in cfg.variants:
        if variant not in VARIANTS:
            _fail(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    for loss, budgets in cfg.losses:
        if loss not in LOSSES:
            _fail(f"unknown loss {loss!r}; choose from {', '.join(LOSSES)}")
        if budgets and cfg.budgets and not set(budgets) <= set(cfg.budgets):
            _fail(f"--loss {loss}:{budgets} names budgets outside --budgets {cfg.budgets}")
    if cfg.lam is not None and not (cfg.lam > 0 and math.isfinite(cfg.lam)):
        _fail(f"--lam {cfg.lam}: expected a positive finite number")
    if cfg.limit is not None and cfg.limit < 0:
        _fail(f"--limit {cfg.limit}: expected 0 (no tasks) or more")
    for seed in cfg.seeds:
        if not 0 <= seed <= SEED_LIMIT - 1000:
            _fail(f"--seeds {seed}: expected 0..{SEED_LIMIT - 1000}")
    if len(set(cfg.seeds)) != len(cfg.seeds):
        _fail(f"--seeds {cfg.seeds}: a seed appears twice")
    for budget in cfg.budgets or ():
        if budget < 1:
            _fail(f"--budgets {budget}: expected a positive number of features per layer")
    if cfg.device not in ("cpu", "cuda") or (
        cfg.device == "cuda" and not torch.cuda.is_available()
    ):
        extra = " (torch sees no CUDA device)" if cfg.device == "cuda" else ""
        _fail(f"--device {cfg.device} is not available here; use cpu{extra}")
    try:
        locate(cfg.model)
    except CheckpointError as err:
        _fail(str(err))
    out = cfg.out or Path("runs") / f"{Path(cfg.model).name}-{cfg.profile}"
    if out.exists() and not out.is_dir():
        _fail(f"--out {out} exists and is not a directory")
    try:
        (out / "students").mkdir(parents=True, exist_ok=True)
        (out / "eval").mkdir(exist_ok=True)
    except OSError as err:
        _fail(f"--out {out} cannot be created: {err.strerror}")
    return dataclasses.replace(cfg, out=out, data=data.store_dir(cfg.data))


# Examples per task and tokens one example puts through the model (its choices summed; MMLU's four
# letters share one input), with the GPT-2 tokenizer: the run plan's time estimate uses them.
TASK_SIZES = {
    "piqa": (1838, 74),
    "arc_easy": (2376, 131),
    "arc_challenge": (1172, 145),
    "winogrande": (1267, 44),
    "wsc273": (273, 43),
    "mmlu": (14042, 112),
    "logiqa": (651, 814),
    "lambada": (5153, 85),
}


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


@dataclass
class Run:
    """What the stages share: the settings, the teacher, the texts and the progress clock."""

    cfg: RunConfig
    teacher: object
    tokenizer: object
    ctx: int
    lam: float
    budgets: tuple
    inputs: dict  # what made the texts: {"teacher", "tokenizer", data file hashes}
    texts: dict = field(default_factory=dict)  # name -> token ids
    clock: Clock = field(default_factory=lambda: Clock([]))

    def begin(self, name: str):
        self.clock.begin(name)

    def stage(self, path: Path, key: dict, compute):
        """runs.stage, with the time spent computing counted toward the progress clock's pace."""
        return stage(path, key, self.clock.timed(compute))


def main(argv=None):
    cfg = parse_args(argv)
    log(data.describe(data_groups(cfg), cfg.data))
    try:
        hashes = {} if cfg.plan_only else fetch_data(cfg)
        run = load_teacher(cfg, hashes)
    except (CheckpointError, data.DataError) as err:
        _fail(str(err))
    plan_run(run)
    if cfg.plan_only:
        return
    encode_texts(run)
    teacher_result = evaluate_teacher(run)
    allocation = estimate_allocation(run)
    sweep_rows = sweep(run) if cfg.sweep else None
    curves = error_curves(run) if "oracle" in cfg.variants else None
    students = {}
    for spec in student_specs(run, allocation, curves):
        students[spec.name] = train_and_evaluate(run, spec)
    results = collect(run, teacher_result, allocation, sweep_rows, curves, students)
    write_text(cfg.out / "results.json", json.dumps(results, indent=1, sort_keys=True))
    summary = report.write(cfg.out, results)
    log("\n" + summary)
    show_generation(run, students)


def fetch_data(cfg: RunConfig) -> dict:
    """Every data file the run reads, present and verified (downloaded if missing):
    {path: sha256}."""
    return data.ensure(data_groups(cfg), cfg.data, log=log)


def data_groups(cfg: RunConfig) -> list:
    tasks = [] if cfg.limit == 0 else list(evaluate.TASKS)
    return ["wikitext2", "corpus", "heldout", *tasks]


def load_teacher(cfg: RunConfig, hashes: dict) -> Run:
    teacher = dofmini.load(cfg.model).to(cfg.device)
    tokenizer = load_tokenizer(cfg.model)
    model_cfg = teacher.config
    ctx = min(cfg.ctx or model_cfg.n_ctx, model_cfg.n_ctx, cfg.max_ctx)
    lam = cfg.lam if cfg.lam is not None else (2.0**-4 if model_cfg.family == "gpt2" else 2.0**-8)
    budgets = cfg.budgets or (model_cfg.head_dim,)
    inputs = {
        "teacher": teacher.identity,
        "tokenizer": sha256_file(resolve(cfg.model) / "tokenizer.json")[:16],
        **hashes,
    }
    log(
        f"dofmini: {model_cfg.name} ({model_cfg.family}, {model_cfg.n_layer} layers x "
        f"{model_cfg.n_head} heads of {model_cfg.head_dim}), profile {cfg.profile}, ctx {ctx}, "
        f"seeds {list(cfg.seeds)}, budgets {list(budgets)}, out {cfg.out}"
    )
    return Run(cfg, teacher, tokenizer, ctx, lam, tuple(budgets), inputs)


def student_keys(run: Run) -> list:
    """(variant, loss, budget, seed) of every student, in run order, known before DoF is estimated.
    The oracle needs every layer's error curve first: Fix students at each of curve_dims."""
    cfg, keys = run.cfg, []
    if "oracle" in cfg.variants:
        keys += [("fix", "softmax", m, seed) for seed in cfg.seeds for m in cfg.curve_dims]
    for seed in cfg.seeds:
        if "dijiang" in cfg.variants:
            keys.append(("dijiang", "direct", run.teacher.config.head_dim, seed))
        if "performer" in cfg.variants:
            keys += [("performer", "none", b, seed) for b in run.budgets]
        for loss, b in cfg.loss_budgets(run.budgets):
            keys += [(v, loss, b, seed) for v in cfg.variants if v in TRAINED_PRF]
    return list(dict.fromkeys(keys))


def _tokens_in(paths) -> int:
    """About how many tokens data files hold (GPT-2's BPE: 4.5 bytes of English a token)."""
    return int(sum(f.size for f in data.FILES if f.path in paths) / 4.5)


def plan_run(run: Run):
    """Print the run's stages with their sizes and estimated times; keep them for the progress
    lines."""
    cfg, model_cfg, ctx = run.cfg, run.teacher.config, run.ctx
    costs = probe(run.teacher, ctx, cfg.J)
    text_windows = [_tokens_in([path]) // ctx for path in evaluate.PPL_TEXTS.values()]
    if cfg.eval_windows:
        text_windows = [min(w, cfg.eval_windows) for w in text_windows]
    tasks = [] if cfg.limit == 0 else list(TASK_SIZES)
    task_tokens = sum(
        min(cfg.limit or n, n) * tokens for n, tokens in (TASK_SIZES[t] for t in tasks)
    )
    evaluation = (sum(text_windows) + task_tokens / ctx) * costs["forward"]
    errors = cfg.error_windows * costs["softmax"] / 2
    train_windows = (
        cfg.steps or _tokens_in([f.path for f in data.files("corpus")]) // ctx // cfg.batch
    ) * cfg.batch
    heads = model_cfg.n_layer * model_cfg.n_head
    dof_seconds = cfg.calib_windows * costs["forward"] + heads * costs["cholesky"] * 3
    plan = [("teacher evaluation", evaluation), ("DoF estimate", dof_seconds)]
    if cfg.sweep:
        plan.append(("DoF sweep", dof_seconds * 2 * len(cfg.sweep_lams) * len(cfg.sweep_Js)))
    for variant, loss, budget, seed in student_keys(run):
        step = 0 if variant == "performer" else costs["direct" if loss == "direct" else loss]
        name = Student(variant, loss, budget, seed, ()).name
        plan.append((name, train_windows * step + 2 * errors + evaluation))
    run.clock.plan = plan
    total = sum(s for _, s in plan)
    log(
        f"plan ({'probe on ' + cfg.device}: forward {costs['forward']:.3f} s, softmax step "
        f"{costs['softmax']:.3f} s, direct step {costs['direct']:.3f} s per window of {ctx}):"
    )
    log(
        f"  each student: {train_windows // cfg.batch} steps of {cfg.batch} windows = "
        f"{train_windows * ctx:,} tokens; evaluation on "
        f"{' and '.join(map(str, text_windows))} windows, "
        f"{'no tasks' if not tasks else f'{len(tasks)} tasks'}"
    )
    for name, seconds in plan:
        log(f"  {name}: ~{duration(seconds)}")
    log(f"  total: ~{duration(total)} (estimated from the probe; finished stages are skipped)")


def encode_texts(run: Run):
    """calib (WikiText-2 valid, for DoF), wikitext2 (test), heldout and train token ids."""
    cfg = run.cfg
    sources = {
        "calib": [CALIBRATION],
        "wikitext2": [evaluate.PPL_TEXTS["wikitext2"]],
        "heldout": [evaluate.PPL_TEXTS["heldout"]],
        "train": [f.path for f in data.files("corpus")],
    }
    for name, relative in sources.items():
        max_chars = cfg.train_chars if name == "train" else None
        key = {
            "tokenizer": run.inputs["tokenizer"],
            "max_chars": max_chars,
            "files": {r: run.inputs[r] for r in relative},
        }
        files = [cfg.data / r for r in relative]
        run.texts[name] = token_ids(
            cfg.out / f"tokens-{name}.npy", key, files, run.tokenizer, max_chars
        )
    run.texts["calib"] = run.texts["calib"][: cfg.calib_windows * run.ctx]


def eval_key(run: Run) -> dict:
    """What an evaluation's numbers depend on besides the model."""
    cfg = run.cfg
    return {
        "ctx": run.ctx,
        "eval_windows": cfg.eval_windows,
        "limit": cfg.limit,
        "error_windows": cfg.error_windows,
        "tokenizer": run.inputs["tokenizer"],
        "data": {k: v for k, v in run.inputs.items() if "/" in k},
    }


def evaluate_model(run: Run, model) -> dict:
    cfg = run.cfg
    texts = {"wikitext2": run.texts["wikitext2"], "heldout": run.texts["heldout"]}
    tasks = () if cfg.limit == 0 else tuple(evaluate.TASKS)
    return evaluate.evaluate_model(
        model, run.tokenizer, texts, run.ctx, cfg.data, cfg.eval_windows, cfg.limit, tasks
    )


def evaluate_teacher(run: Run) -> dict:
    run.begin("teacher evaluation")
    key = {"teacher": run.inputs["teacher"], **eval_key(run)}
    result = run.stage(run.cfg.out / "teacher.json", key, lambda: evaluate_model(run, run.teacher))
    log(f"teacher: WikiText-2 perplexity {result['wikitext2_ppl']:.2f} (ctx {run.ctx})")
    return result


def estimate_allocation(run: Run) -> dict:
    """Per-head DoF on calibration text, and each variant's dims at each budget (Algorithm 1)."""
    run.begin("DoF estimate")
    cfg, model_cfg = run.cfg, run.teacher.config
    key = {
        "teacher": run.inputs["teacher"],
        "lam": run.lam,
        "J": cfg.J,
        "seed": cfg.seeds[0],
        "normalize": not cfg.raw_gram,
        "ctx": run.ctx,
        "calib_windows": cfg.calib_windows,
        "budgets": list(run.budgets),
        "calib": run.inputs[CALIBRATION],
    }

    def compute():
        t0 = time.time()
        calib = run.texts["calib"]
        per_head = dof.estimate_dof(
            run.teacher, calib, run.lam, cfg.J, cfg.seeds[0], not cfg.raw_gram, run.ctx
        )
        layer = per_head.amax(-1)
        cap = model_cfg.head_dim
        dims = {
            str(b): {
                "fix": [b] * model_cfg.n_layer,
                "dof": dof.allocate(layer, b),
                "dof_clip": dof.allocate(layer, b, cap=cap),
            }
            for b in run.budgets
        }
        return {
            "lam": run.lam,
            "J": cfg.J,
            "seed": cfg.seeds[0],
            "normalize": not cfg.raw_gram,
            "calibration": f"{CALIBRATION}: first {len(calib)} tokens, ctx {run.ctx}",
            "per_head": per_head.tolist(),
            "warning": dof.saturation_warning(per_head, cfg.J),
            "dims": dims,
            "seconds": time.time() - t0,
        }

    result = run.stage(cfg.out / "allocation.json", key, compute)
    report.write_allocation(cfg.out, result, log)
    return result


def sweep(run: Run) -> list:
    """How the DoF allocation moves with λ and J, and with the raw Gram instead of G/J."""
    run.begin("DoF sweep")
    cfg, budget = run.cfg, run.teacher.config.head_dim
    key = {
        "teacher": run.inputs["teacher"],
        "seed": cfg.seeds[0],
        "ctx": run.ctx,
        "calib_windows": cfg.calib_windows,
        "lams": list(cfg.sweep_lams),
        "Js": list(cfg.sweep_Js),
    }

    def compute():
        # rows come in draw order, so x[..., :J, :] is the size-J draw: one teacher pass serves
        # every J
        x = dof.sample_queries_keys(
            run.teacher, run.texts["calib"], max(cfg.sweep_Js), cfg.seeds[0], run.ctx
        )  # [L, H, J, d]
        rows = []
        for normalize in (True, False):
            for lam in cfg.sweep_lams:
                for J in cfg.sweep_Js:
                    layer = dof.degrees_of_freedom(x[:, :, :J], lam, normalize).amax(-1)  # [L]
                    rows.append(
                        {
                            "normalize": normalize,
                            "lam": lam,
                            "J": J,
                            "layer_dof": layer.tolist(),
                            "dims": dof.allocate(layer, budget),
                        }
                    )
        return rows

    rows = run.stage(cfg.out / "sweep.json", key, compute)
    report.write_sweep(cfg.out, rows, log)
    return rows


def train_key(run: Run, spec: Student) -> dict:
    """What a student's tensors depend on."""
    cfg = run.cfg
    steps = cfg.steps or max(1, len(run.texts["train"]) // (cfg.batch * run.ctx))
    train = {k: v for k, v in run.inputs.items() if k.startswith("corpus/")}
    return {
        "teacher": run.inputs["teacher"],
        "variant": spec.variant,
        "loss": spec.loss,
        "dims": list(spec.dims),
        "seed": spec.seed,
        "steps": steps,
        "batch": cfg.batch,
        "ctx": run.ctx,
        "lr": cfg.lr,
        "lr_a": cfg.lr_a,
        "train_chars": cfg.train_chars,
        "tokenizer": run.inputs["tokenizer"],
        "train": train,
    }


def train_student(run: Run, spec: Student):
    """Train one student (or draw it, for the untrained Performer) and save it; a saved one with the
    same settings is loaded instead. An interrupted run resumes from distill's progress file."""
    cfg, key = run.cfg, train_key(run, spec)
    path = cfg.out / "students" / f"{spec.stem}.safetensors"
    record = path.with_suffix(".json")
    if record.is_file() and not path.is_file():
        record.unlink()  # the tensors are gone: train again
    common = dict(
        data_seed=spec.seed,
        steps=key["steps"],
        batch=cfg.batch,
        ctx=run.ctx,
        lr=cfg.lr,
        lr_a=cfg.lr_a,
        out_path=path,
        log=log,
        meta={"variant": spec.variant},
    )

    def compute():
        twin = trained_twin(run, spec, key)
        if twin is not None:  # the same training under another name: its tensors are ours
            name, twin_path, twin_info = twin
            tensors, meta = read_tensors(twin_path)
            save_tensors(tensors, path, {**meta, "variant": spec.variant})
            log(f"{spec.name}: the same training as {name} (same dims, loss and seed): copied")
            return {**twin_info, "same_training_as": name}
        if spec.variant == "performer":
            student = performer(run, spec)
            student.train_seconds, student.loss_curve = 0.0, []
            save_student(student, path, {"variant": "performer"})
        elif spec.variant == "dijiang":
            student = make_student(run.teacher, "dijiang", spec.dims, spec.seed)
            student = train_direct(student, run.texts["train"], **common)
        elif spec.loss == "direct":
            student = performer(run, spec)
            student = train_direct(student, run.texts["train"], **common)
        else:
            student = distill(
                run.teacher,
                spec.dims,
                run.texts["train"],
                loss=spec.loss,
                feature_seed=spec.seed,
                **common,
            )
        return {"train_seconds": student.train_seconds, "loss_curve": student.loss_curve}

    log(f"{spec.name}: dims {list(spec.dims)}")
    info = run.stage(record, key, compute)
    return load_student(run.teacher, path), info


def trained_twin(run: Run, spec: Student, key: dict):
    """(name, tensors, training record) of a finished student of another PRF variant trained with
    exactly this one's settings (`key` but for the variant's name), else None. The oracle often
    allocates Fix's uniform dims, and training depends on the dims, loss, seed and data only, not
    on which variant chose the dims: it would make the same tensors again."""
    if spec.variant not in TRAINED_PRF:
        return None
    for variant in TRAINED_PRF:
        twin = dataclasses.replace(spec, variant=variant)
        record = run.cfg.out / "students" / f"{twin.stem}.json"
        tensors = record.with_suffix(".safetensors")
        if variant == spec.variant or not tensors.is_file():
            continue
        result = saved_result(record, {**key, "variant": variant})
        if result is not None:
            return twin.name, tensors, result
    return None


def error_curves(run: Run) -> dict:
    """Every layer's held-out KL at each of curve_dims features (Fix students: one distillation
    per M trains all layers at once), on the held-out windows after those the reported errors use;
    and the oracle allocation they imply at each budget."""
    cfg, n_layer = run.cfg, run.teacher.config.n_layer
    kl, curve_only_seconds = {}, 0.0
    for seed in cfg.seeds:
        for m in cfg.curve_dims:
            spec = Student("fix", "softmax", m, seed, (m,) * n_layer)
            run.begin(spec.name)
            errors, train_seconds = curve_errors(run, spec)
            kl.setdefault(str(seed), []).append(errors["kl"])  # [M][layer]
            if m not in run.budgets:  # the others are Fix students, timed with the students
                curve_only_seconds += train_seconds
    mean = np.mean([kl[str(s)] for s in cfg.seeds], axis=0).T.tolist()  # [layer][M]
    oracle = {str(b): dof.oracle_allocate(mean, b, ms=list(cfg.curve_dims)) for b in run.budgets}
    return {
        "dims": list(cfg.curve_dims),
        "kl": kl,
        "mean_kl": mean,
        "oracle": oracle,
        "curve_only_train_seconds": curve_only_seconds,
    }


def curve_errors(run: Run, spec: Student) -> tuple:
    """A curve student's layer errors on the curve windows, and its training seconds."""
    cfg = run.cfg
    student, info = train_student(run, spec)
    key = {
        "student": train_key(run, spec),
        "windows": cfg.curve_windows,
        "offset": cfg.error_windows,
        **eval_key(run),
    }
    path = cfg.out / "eval" / f"{spec.stem}-curve.json"
    heldout = run.texts["heldout"]
    errors = run.stage(
        path,
        key,
        lambda: evaluate.layer_errors(
            run.teacher, student, heldout, run.ctx, cfg.curve_windows, offset=cfg.error_windows
        ),
    )
    return errors, info["train_seconds"]


def student_specs(run: Run, allocation: dict, curves) -> list:
    """Every student with its dims, in run order (the curve-only Fix students are done already)."""
    n_layer, specs = run.teacher.config.n_layer, []
    for variant, loss, budget, seed in student_keys(run):
        if variant == "fix" and budget not in run.budgets:
            continue
        if variant in ("dof", "dof_clip"):
            dims = allocation["dims"][str(budget)][variant]
        elif variant == "oracle":
            dims = curves["oracle"][str(budget)]
        else:
            dims = [budget] * n_layer
        specs.append(Student(variant, loss, budget, seed, tuple(dims)))
    return specs


def train_and_evaluate(run: Run, spec: Student) -> dict:
    """One student's training record, layer errors before and after training, perplexity, tasks."""
    cfg = run.cfg
    run.begin(spec.name)
    student, info = train_student(run, spec)
    key = {"student": train_key(run, spec), **eval_key(run)}
    result = run.stage(
        cfg.out / "eval" / f"{spec.stem}.json",
        key,
        lambda: {"layer_error": layer_errors(run, student), **evaluate_model(run, student)},
    )
    result = {
        **result,
        **info,
        "variant": spec.variant,
        "loss": spec.loss,
        "budget": spec.budget,
        "seed": spec.seed,
        "dims": list(spec.dims),
    }
    if spec.variant in TRAINED_PRF:  # the draw training started from (a Performer of these dims)
        untrained = {k: v for k, v in key["student"].items() if k in ("teacher", "dims", "seed")}
        dims_tag = "-".join(map(str, spec.dims))
        path = cfg.out / "eval" / f"untrained-{dims_tag}-s{spec.seed}.json"
        result["layer_error_before"] = run.stage(
            path, {**untrained, **eval_key(run)}, lambda: layer_errors(run, performer(run, spec))
        )
    log(
        f"{spec.name}: WikiText-2 perplexity {result['wikitext2_ppl']:.2f}, mean KL "
        f"{_mean(result['layer_error']['kl'])}"
    )
    return result


def _mean(values) -> str:
    return "—" if None in values else f"{np.mean(values):.4g}"


def performer(run: Run, spec: Student):
    """The untrained draw of a student's dims and seed: where its training started."""
    return make_student(run.teacher, "prf", spec.dims, spec.seed)


def layer_errors(run: Run, student) -> dict:
    return evaluate.layer_errors(
        run.teacher, student, run.texts["heldout"], run.ctx, run.cfg.error_windows
    )


def collect(run: Run, teacher_result, allocation, sweep_rows, curves, students) -> dict:
    cfg = run.cfg
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("out", "data")}
    settings.update(ctx=run.ctx, lam=run.lam, budgets=list(run.budgets))
    stages = teacher_result["eval_seconds"] + allocation["seconds"]
    stages += sum(s["eval_seconds"] for s in students.values())
    stages += sum(s["train_seconds"] for s in students.values() if "same_training_as" not in s)
    stages += curves["curve_only_train_seconds"] if curves else 0.0
    model_cfg = run.teacher.config
    return {
        "teacher": {
            "name": model_cfg.name,
            "identity": run.teacher.identity,
            "head_dim": model_cfg.head_dim,
            "n_layer": model_cfg.n_layer,
            **teacher_result,
        },
        "dof": allocation,
        "sweep": sweep_rows,
        "curves": curves,
        "students": students,
        "config": settings,
        "inputs": run.inputs,
        "provenance": provenance(),
        # a resumed run skips finished stages, so its own wall time says little
        "timings": {
            "stages_seconds": stages,
            "this_invocation_seconds": time.time() - run.clock.t0,
        },
    }


def show_generation(run: Run, students: dict):
    """A greedy continuation of PROMPT from the teacher (KV cache) and from the best trained student
    (recurrent O(1)-state decoding)."""
    trained = {k: v for k, v in students.items() if v["variant"] != "performer"}
    if not trained:
        return
    best = min(trained, key=lambda k: trained[k]["wikitext2_ppl"])
    path = run.cfg.out / "students" / f"{best.replace('/', '-')}.safetensors"
    student = load_student(run.teacher, path)
    prompt = run.tokenizer.encode(PROMPT).ids
    log(f"\ngreedy continuations of {PROMPT!r}:")
    for name, model in (("teacher", run.teacher), (best, student)):
        text = run.tokenizer.decode(dofmini.generate(model, prompt, 24)[len(prompt) :])
        log(f"  {name}: {text!r}")


if __name__ == "__main__":
    main()
