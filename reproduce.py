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
import difflib
import errno
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from dofmini.study.oracle import oracle_allocate

import dofmini
from dofmini import dof, hub
from dofmini.checkpoint import CheckpointError
from dofmini.distill import TrainSettings, distill, train_direct
from dofmini.files import sha256_file, unreachable, write_text
from dofmini.students import load_student, make_student, read_tensors, save_student, save_tensors
from dofmini.study import data, evaluate, report, runs
from dofmini.study.runs import log

VARIANTS = ("performer", "dijiang", "fix", "dof", "dof_clip", "oracle")
LOSSES = ("softmax", "l2", "direct")
TRAINED_PRF = ("fix", "dof", "dof_clip", "oracle")  # variants whose draw is trained
CALIBRATION = "wikitext-2-raw/wiki.valid.raw"  # DoF calibration text, in the data store
PROMPT = "The history of the city begins in the"
SEED_LIMIT = 2**31 - 1  # seeds are offset by the layer index and must stay within torch's range
MAX_FEATURES = 4096  # per layer: far above any head size, below what memory can hold
# steps None: one pass over the training corpus (the paper's one pass over its Wikipedia slice);
# eval_windows None: all of each perplexity text; limit 0: no tasks.
SIZES = ("ctx", "J", "calib_windows", "steps", "batch", "eval_windows", "limit", "error_windows",
         "curve_windows", "train_chars")  # fmt: skip
PROFILES = {
    "quick": dict(zip(SIZES, (64, 128, 8, 4, 2, 4, 4, 4, 4, 200_000))),
    "default": dict(zip(SIZES, (256, 1024, 64, 400, 8, 128, 100, 32, 16, None))),
    "study": dict(zip(SIZES, (256, 1024, 64, 200, 8, 64, 0, 32, 16, None)), seeds=(0, 1, 2),
                  budgets=(16, 32, 64), variants=("fix", "dof", "oracle"),
                  losses=(("softmax", None), ("l2", (64,)))),
    "paper": dict(zip(SIZES, (None, 1024, 64, None, 8, None, None, 32, 16, None))),
}  # fmt: skip


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
    ctx: int | None = 256  # None: the model's own context, at most max_ctx
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


ENVIRONMENT = """environment:
  DOFMINI_DATA=DIR         the data store (else $XDG_CACHE_HOME/dofmini/data, ~/.cache/...)
  DOFMINI_DATA_MIRROR=URL  fetch every data file from URL/<path in the store> instead
  DOFMINI_WEIGHTS=DIR      where named models are downloaded (else weights/ in the checkout)"""


def parse_args(argv) -> RunConfig:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=ENVIRONMENT,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("model", help=f"a known name ({', '.join(hub.HUB_REPOS)}) or a folder\n"
                   "holding config.json, model.safetensors, tokenizer.json")  # fmt: skip
    p.add_argument("--profile", choices=PROFILES, default="default",
                   help="quick: a smoke run; default (the default): one seed, one budget;\n"
                   "study: seeds 0-2, budgets 16/32/64, Fix/DoF/oracle, softmax and l2@64;\n"
                   "paper: the paper's sizes, meant for a GPU")  # fmt: skip
    p.add_argument("--out", type=Path, help="output folder (default runs/<model>-<profile>)")
    p.add_argument("--data", type=Path, help="data store (default $DOFMINI_DATA, else the cache)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--variants", help=f"comma-separated, from {', '.join(VARIANTS)}; none: only\n"
                   "the teacher's evaluation and DoF")  # fmt: skip
    p.add_argument("--loss", help=f"comma-separated losses for the PRF variants, from "
                   f"{', '.join(LOSSES)};\nLOSS:B1/B2 runs LOSS at those budgets only")  # fmt: skip
    p.add_argument("--seeds", help="comma-separated seeds (default 0)")
    p.add_argument("--seed", type=int, help="one seed (same as --seeds N)")
    p.add_argument("--budgets", help="comma-separated mean features per layer (default: head size)")
    p.add_argument("--limit", type=int, help="first N examples per task (0: no tasks)")
    p.add_argument("--lam", type=float, help="DoF λ (default 2^-4 for GPT-2, 2^-8 for Pythia)")
    p.add_argument("--J", type=int, help="queries and keys sampled per head for DoF")
    p.add_argument("--raw-gram", action="store_true", help="DoF from the raw Gram G, not G/J")
    p.add_argument("--sweep", action="store_true", help="also sweep λ and J (sweep.md)")
    p.add_argument("--plan-only", action="store_true",
                   help="print the plan (downloads, stages, estimated times) and stop")  # fmt: skip
    args = p.parse_args(argv)
    fields = dict(PROFILES[args.profile], model=args.model, profile=args.profile, out=args.out)
    fields.update(data=args.data, device=args.device, raw_gram=args.raw_gram, sweep=args.sweep)
    fields.update(plan_only=args.plan_only)
    if args.variants:
        fields["variants"] = () if args.variants == "none" else tuple(args.variants.split(","))
    if args.loss:
        fields["losses"] = tuple(_loss_spec(part) for part in args.loss.split(","))
    if args.seeds and args.seed is not None:
        _fail(f"--seed {args.seed} and --seeds {args.seeds}: give one of them")
    if args.seeds or args.seed is not None:
        fields["seeds"] = _ints("--seeds", args.seeds) if args.seeds else (args.seed,)
    if args.budgets:
        fields["budgets"] = _ints("--budgets", args.budgets)
    fields.update({k: getattr(args, k) for k in ("limit", "lam", "J") if getattr(args, k)})
    fields.update({k: getattr(args, k) for k in ("limit",) if getattr(args, k) == 0})
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
            _fail(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)} (or none)")
    for loss, budgets in cfg.losses:
        if loss not in LOSSES:
            _fail(f"unknown loss {loss!r}; choose from {', '.join(LOSSES)}")
        if budgets and not cfg.budgets:
            _fail(f"--loss {loss}:{budgets} names budgets, but --budgets does not: pass them too")
        if budgets and not set(budgets) <= set(cfg.budgets):
            _fail(f"--loss {loss}:{budgets} names budgets outside --budgets {cfg.budgets}")
    if cfg.lam is not None and not (cfg.lam > 0 and math.isfinite(cfg.lam)):
        _fail(f"--lam {cfg.lam}: expected a positive finite number")
    if cfg.limit is not None and cfg.limit < 0:
        _fail(f"--limit {cfg.limit}: expected 0 (no tasks) or more")
    if cfg.J < 2:
        _fail(f"--J {cfg.J}: expected 2 or more samples per head")
    for seed in cfg.seeds:
        if not 0 <= seed <= SEED_LIMIT - 1000:
            _fail(f"--seeds {seed}: expected 0..{SEED_LIMIT - 1000}")
    if len(set(cfg.seeds)) != len(cfg.seeds):
        _fail(f"--seeds {cfg.seeds}: a seed appears twice")
    for budget in cfg.budgets or ():
        if not 1 <= budget <= MAX_FEATURES:
            _fail(f"--budgets {budget}: expected 1..{MAX_FEATURES} features per layer")
    index = cfg.device[5:] if cfg.device.startswith("cuda:") else "0" * (cfg.device == "cuda")
    if cfg.device != "cpu" and not (index.isdigit() and int(index) < torch.cuda.device_count()):
        seen = f"torch sees {torch.cuda.device_count()} CUDA device(s)"
        _fail(f"--device {cfg.device} is not available here ({seen}); expected cpu, cuda, cuda:N")
    try:
        hub.locate(cfg.model)
    except CheckpointError as err:
        close = difflib.get_close_matches(cfg.model, hub.HUB_REPOS, n=1)
        _fail(f"{err}" + (f"; did you mean {close[0]!r}?" if close else ""))
    out = cfg.out or Path("runs") / f"{Path(cfg.model).name}-{cfg.profile}"
    if not str(out).strip():
        _fail("--out '': expected a folder")
    runs.check_writable(out, "--out", _fail)
    return dataclasses.replace(cfg, out=out, data=data.store_dir(cfg.data))


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

    def path(self, out: Path) -> Path:
        return out / "students" / f"{self.stem}.safetensors"


@dataclass
class Run:
    """What the stages share: the settings, the teacher, the texts and the progress clock."""

    cfg: RunConfig
    teacher: object
    tokenizer: object
    ctx: int
    lam: float
    budgets: tuple
    inputs: dict  # what made the texts: {"teacher", "tokenizer", "device", data file hashes}
    texts: dict = field(default_factory=dict)  # name -> token ids
    clock: runs.Clock = field(default_factory=lambda: runs.Clock([]))

    def stage(self, name: str, path: Path, key: dict, compute):
        """runs.stage, counted toward the progress clock's pace."""
        self.clock.begin(name)
        return runs.stage(path, key, self.clock.timed(compute))


def main(argv=None):
    cfg = parse_args(argv)
    try:
        with runs.locked(cfg.out, _fail):
            return _main(cfg)
    except KeyboardInterrupt:
        raise SystemExit(
            "reproduce.py: interrupted; run the same command again to resume"
        ) from None
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
        raise SystemExit(f"reproduce.py: error: no space left writing {err.filename}") from None


def _main(cfg: RunConfig):
    groups = data_groups(cfg)
    log(data.describe(groups, cfg.data))
    try:
        weights, absent = hub.missing_files(cfg.model), data.missing(groups, cfg.data)
        if cfg.plan_only and (weights or absent):
            return log(runs.missing_listing(weights, absent, cfg.data, "not here yet:"))
        hosts = unreachable([url for url, _ in weights] + [data.source(f) for f in absent])
        if hosts:
            _fail(runs.missing_listing(weights, absent, cfg.data, f"{', '.join(hosts)} took no "
                  "connection; put each missing file at its path (a Wikipedia file as served), "
                  "or point --data or DOFMINI_DATA_MIRROR at a copy of the store:"))  # fmt: skip
        run = load_teacher(cfg, data.ensure(groups, cfg.data, log=log))
    except (CheckpointError, data.DataError) as err:
        _fail(str(err))
    encode_texts(run)
    plan_run(run)
    if cfg.plan_only:
        return
    teacher_result = evaluate_teacher(run)
    allocation = estimate_allocation(run)
    sweep_rows = sweep(run) if cfg.sweep else None
    curves = error_curves(run) if "oracle" in cfg.variants else None
    students = {spec.name: train_and_evaluate(run, spec) for spec in specs(run, allocation, curves)}
    results = collect(run, teacher_result, allocation, sweep_rows, curves, students)
    write_text(cfg.out / "results.json", json.dumps(results, indent=1, sort_keys=True))
    log("\n" + report.write(cfg.out, results))
    show_generation(run, students)


def data_groups(cfg: RunConfig) -> list:
    tasks = [] if cfg.limit == 0 else list(evaluate.TASKS)
    return ["wikitext2", "corpus", "heldout", *tasks]


def load_teacher(cfg: RunConfig, hashes: dict) -> Run:
    teacher = hub.load(cfg.model).to(cfg.device)
    tokenizer = hub.load_tokenizer(cfg.model)
    model_cfg = teacher.config
    ctx = min(cfg.ctx or model_cfg.n_ctx, model_cfg.n_ctx, cfg.max_ctx)
    lam = cfg.lam if cfg.lam is not None else (2.0**-4 if model_cfg.family == "gpt2" else 2.0**-8)
    budgets = cfg.budgets or (model_cfg.head_dim,)
    pool = 2 * cfg.calib_windows * ctx  # queries and keys per head on the calibration text
    for flag, J in [("--J", cfg.J)] + [("the sweep's J", J) for J in cfg.sweep_Js if cfg.sweep]:
        if J > pool:
            _fail(f"{flag} {J} is more than the {pool} queries and keys per head that "
                  f"{cfg.calib_windows} calibration windows of {ctx} tokens give")  # fmt: skip
    inputs = {
        "teacher": teacher.identity,
        "tokenizer": sha256_file(hub.locate(cfg.model) / "tokenizer.json")[:16],
        "device": runs.device_name(teacher),
        **hashes,
    }
    log(
        f"dofmini: {model_cfg.name} ({model_cfg.family}, {model_cfg.n_layer} layers x "
        f"{model_cfg.n_head} heads of {model_cfg.head_dim}), profile {cfg.profile}, ctx {ctx}, "
        f"seeds {list(cfg.seeds)}, budgets {list(budgets)}, out {cfg.out}"
    )
    return Run(cfg, teacher, tokenizer, ctx, lam, tuple(budgets), inputs)


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
        path = cfg.out / f"tokens-{name}.npy"
        run.texts[name] = runs.token_ids(path, key, files, run.tokenizer, max_chars)
    run.texts["calib"] = run.texts["calib"][: cfg.calib_windows * run.ctx]


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


def plan_run(run: Run):
    """Print the run's stages with their estimated times, finished ones at 0; keep them for the
    progress lines."""
    cfg, ctx = run.cfg, run.ctx
    costs = runs.probe(run.teacher, ctx, cfg.J)
    sizes = runs.stage_sizes(cfg, ctx, data.files("corpus"))
    done = {name for name, path, key in stage_keys(run) if runs.saved(path, key)}
    plan = [("teacher evaluation", sizes["evaluation"] * costs["forward"])]
    plan.append(("DoF estimate", cfg.calib_windows * costs["forward"] + costs["dof"]))
    if cfg.sweep:
        plan.append(("DoF sweep", plan[-1][1] * 2 * len(cfg.sweep_lams) * len(cfg.sweep_Js)))
    for variant, loss, budget, seed in student_keys(run):
        step = 0 if variant == "performer" else costs["direct" if loss == "direct" else loss]
        seconds = sizes["train_windows"] * step + sizes["error_windows"] * costs["softmax"]
        plan.append((Student(variant, loss, budget, seed, ()).name, seconds + plan[0][1]))
    run.clock.plan = [(name, 0.0 if name in done else seconds) for name, seconds in plan]
    runs.print_plan(run.clock.plan, costs, sizes, cfg, ctx, done)


def teacher_key(run: Run) -> dict:
    return {"teacher": run.inputs["teacher"], **eval_key(run)}


def eval_key(run: Run) -> dict:
    """What an evaluation's numbers depend on besides the model."""
    cfg = run.cfg
    return {
        "ctx": run.ctx,
        "eval_windows": cfg.eval_windows,
        "limit": cfg.limit,
        "error_windows": cfg.error_windows,
        "tokenizer": run.inputs["tokenizer"],
        "device": run.inputs["device"],
        "data": {k: v for k, v in run.inputs.items() if "/" in k},
    }


def allocation_key(run: Run) -> dict:
    cfg = run.cfg
    return {
        "teacher": run.inputs["teacher"],
        "lam": run.lam,
        "J": cfg.J,
        "seed": cfg.seeds[0],
        "normalize": not cfg.raw_gram,
        "ctx": run.ctx,
        "calib_windows": cfg.calib_windows,
        "budgets": list(run.budgets),
        "calib": run.inputs[CALIBRATION],
        "device": run.inputs["device"],
    }


def stage_keys(run: Run) -> list:
    """(plan name, path, key) of the stages whose key is known before any of them runs: the
    teacher's evaluation, DoF, and each student whose dims do not wait for DoF or the curves."""
    out = run.cfg.out
    found = [("teacher evaluation", out / "teacher.json", teacher_key(run))]
    found.append(("DoF estimate", out / "allocation.json", allocation_key(run)))
    allocation = runs.saved(out / "allocation.json", allocation_key(run))
    for variant, loss, budget, seed in student_keys(run):
        dims = fixed_dims(run, variant, budget, allocation)
        if dims is not None:
            spec = Student(variant, loss, budget, seed, dims)
            found.append(
                (spec.name, out / "eval" / f"{spec.stem}.json", student_eval_key(run, spec))
            )
    return found


def fixed_dims(run: Run, variant: str, budget: int, allocation):
    """A student's dims when known without training anything: uniform, or DoF's once estimated."""
    if variant in ("dof", "dof_clip"):
        return None if allocation is None else tuple(allocation["dims"][str(budget)][variant])
    n_layer = run.teacher.config.n_layer
    return None if variant == "oracle" else (budget,) * n_layer


def evaluate_model(run: Run, model) -> dict:
    cfg = run.cfg
    texts = {"wikitext2": run.texts["wikitext2"], "heldout": run.texts["heldout"]}
    tasks = () if cfg.limit == 0 else tuple(evaluate.TASKS)
    return evaluate.evaluate_model(
        model, run.tokenizer, texts, run.ctx, cfg.data, cfg.eval_windows, cfg.limit, tasks
    )


def evaluate_teacher(run: Run) -> dict:
    path = run.cfg.out / "teacher.json"
    compute = lambda: evaluate_model(run, run.teacher)
    result = run.stage("teacher evaluation", path, teacher_key(run), compute)
    log(f"teacher: WikiText-2 perplexity {result['wikitext2_ppl']:.2f} (ctx {run.ctx})")
    return result


def estimate_allocation(run: Run) -> dict:
    """Per-head DoF on calibration text, and each variant's dims at each budget (Algorithm 1)."""
    cfg, model_cfg = run.cfg, run.teacher.config

    def compute():
        t0 = time.time()
        calib = run.texts["calib"]
        per_head = dof.estimate_dof(
            run.teacher, calib, run.lam, cfg.J, cfg.seeds[0], not cfg.raw_gram, run.ctx
        )
        if not (per_head > 0).all():
            _fail(f"--lam {run.lam}: every DoF is 0 at this λ (λ far above the kernel's scale); "
                  "expected a smaller --lam")  # fmt: skip
        dims = {
            str(b): {
                "fix": [b] * model_cfg.n_layer,
                "dof": dof.allocate(per_head, b),
                "dof_clip": dof.allocate(per_head, b, cap=model_cfg.head_dim),
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

    path = cfg.out / "allocation.json"
    result = run.stage("DoF estimate", path, allocation_key(run), compute)
    report.write_allocation(cfg.out, result, log)
    return result


def sweep(run: Run) -> list:
    """How the DoF allocation moves with λ and J, and with the raw Gram instead of G/J."""
    cfg, budget = run.cfg, run.teacher.config.head_dim
    key = {**allocation_key(run), "lams": list(cfg.sweep_lams), "Js": list(cfg.sweep_Js)}

    def compute():
        # rows come in draw order, so x[..., :J, :] is the size-J draw: one pass serves every J
        x = dof.sample_queries_keys(
            run.teacher, run.texts["calib"], max(cfg.sweep_Js), cfg.seeds[0], run.ctx
        )  # [L, H, J, d]
        rows = []
        for normalize in (True, False):
            for lam in cfg.sweep_lams:
                for J in cfg.sweep_Js:
                    layer = dof.degrees_of_freedom(x[:, :, :J], lam, normalize).amax(-1)  # [L]
                    row = {"normalize": normalize, "lam": lam, "J": J, "layer_dof": layer.tolist()}
                    rows.append({**row, "dims": dof.allocate(layer, budget)})
        return rows

    rows = run.stage("DoF sweep", cfg.out / "sweep.json", key, compute)
    report.write_sweep(cfg.out, rows, log)
    return rows


def train_key(run: Run, spec: Student) -> dict:
    """What a student's tensors depend on."""
    train = {k: v for k, v in run.inputs.items() if k.startswith("corpus/")}
    return {
        "teacher": run.inputs["teacher"],
        "variant": spec.variant,
        "loss": spec.loss,
        "dims": list(spec.dims),
        "seed": spec.seed,
        **settings(run, spec.seed).record(),
        "train_chars": run.cfg.train_chars,
        "tokenizer": run.inputs["tokenizer"],
        "device": run.inputs["device"],
        "train": train,
    }


def student_eval_key(run: Run, spec: Student) -> dict:
    return {"student": train_key(run, spec), **eval_key(run)}


def settings(run: Run, seed: int) -> TrainSettings:
    cfg = run.cfg
    steps = cfg.steps or max(1, len(run.texts["train"]) // (cfg.batch * run.ctx))
    return TrainSettings(steps, cfg.batch, run.ctx, cfg.lr, cfg.lr_a, data_seed=seed)


def train_student(run: Run, spec: Student):
    """Train one student (or draw it, for the untrained Performer) into one file holding its tensors
    and record; a finished one with the same settings is loaded instead, and an interrupted one
    resumes from distill's progress file."""
    key, path = train_key(run, spec), spec.path(run.cfg.out)
    if trained(path, key):
        log(f"skip: {path} done")
        return load_student(run.teacher, path, {"key": key}), read_tensors(path)[1]["info"]
    log(f"{spec.name}: dims {list(spec.dims)}")
    twin = trained_twin(run, spec, key)
    if twin is not None:  # the same training under another name: its tensors are ours
        tensors, meta = read_tensors(twin.path(run.cfg.out))
        info = {**meta["info"], "same_training_as": twin.name}
        save_tensors(tensors, path, {**meta, "variant": spec.variant, "key": key, "info": info})
        log(f"{spec.name}: the same training as {twin.name} (same dims, loss and seed): copied")
        return load_student(run.teacher, path, {"key": key}), info
    common = dict(out_path=path, log=log, meta={"variant": spec.variant, "key": key})
    train = settings(run, spec.seed)
    if spec.variant == "performer":
        student = performer(run, spec)
        student.train_seconds, student.loss_curve = 0.0, []
    elif spec.variant == "dijiang":
        student = make_student(run.teacher, "dijiang", spec.dims, spec.seed)
        student = train_direct(student, run.texts["train"], train, **common)
    elif spec.loss == "direct":
        student = train_direct(performer(run, spec), run.texts["train"], train, **common)
    else:
        tokens = run.texts["train"]
        student = distill(run.teacher, spec.dims, tokens, train, loss=spec.loss,
                          feature_seed=spec.seed, **common)  # fmt: skip
    info = {"train_seconds": student.train_seconds, "loss_curve": student.loss_curve}
    save_student(student, path, {**common["meta"], "info": info})
    return load_student(run.teacher, path, {"key": key}), info


def trained(path: Path, key: dict) -> bool:
    """Whether `path` holds a finished student (its record has "info") trained with `key`."""
    meta = read_tensors(path)[1] if path.is_file() else {}
    return meta.get("key") == runs.as_json(key) and "info" in meta


def trained_twin(run: Run, spec: Student, key: dict):
    """A finished student of another PRF variant trained with exactly this one's settings (`key`
    but for the variant's name), else None. The oracle often allocates Fix's uniform dims, and
    training depends on the dims, loss, seed and data only, not on which variant chose them."""
    if spec.variant not in TRAINED_PRF:
        return None
    for variant in TRAINED_PRF:
        twin = dataclasses.replace(spec, variant=variant)
        if variant != spec.variant and trained(twin.path(run.cfg.out), {**key, "variant": variant}):
            return twin
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
            errors, info = curve_errors(run, spec)
            kl.setdefault(str(seed), []).append(errors["kl"])  # [M][layer]
            if m not in run.budgets:  # the others are Fix students, timed with the students
                curve_only_seconds += info["train_seconds"]
    mean = np.mean([kl[str(s)] for s in cfg.seeds], axis=0).T.tolist()  # [layer][M]
    oracle = {str(b): oracle_allocate(mean, b, ms=list(cfg.curve_dims)) for b in run.budgets}
    return {
        "dims": list(cfg.curve_dims),
        "kl": kl,
        "mean_kl": mean,
        "oracle": oracle,
        "curve_only_train_seconds": curve_only_seconds,
    }


def curve_errors(run: Run, spec: Student) -> tuple:
    """A curve student's layer errors on the curve windows, and its training record."""
    cfg = run.cfg
    student, info = train_student_in_stage(run, spec)
    key = {**student_eval_key(run, spec), "windows": cfg.curve_windows}
    path = cfg.out / "eval" / f"{spec.stem}-curve.json"
    compute = lambda: layer_errors(run, student, cfg.curve_windows, cfg.error_windows)
    return run.stage(spec.name, path, key, compute), info


def train_student_in_stage(run: Run, spec: Student):
    run.clock.begin(spec.name)
    return train_student(run, spec)


def specs(run: Run, allocation: dict, curves) -> list:
    """Every student with its dims, in run order (the curve-only Fix students are done already)."""
    found = []
    for variant, loss, budget, seed in student_keys(run):
        if variant == "fix" and budget not in run.budgets:
            continue
        dims = fixed_dims(run, variant, budget, allocation) or curves["oracle"][str(budget)]
        found.append(Student(variant, loss, budget, seed, tuple(dims)))
    return found


def train_and_evaluate(run: Run, spec: Student) -> dict:
    """One student's training record, layer errors before and after training, perplexity, tasks."""
    cfg = run.cfg
    student, info = train_student_in_stage(run, spec)
    path = cfg.out / "eval" / f"{spec.stem}.json"
    compute = lambda: {"layer_error": layer_errors(run, student), **evaluate_model(run, student)}
    result = run.stage(spec.name, path, student_eval_key(run, spec), compute)
    result = {**result, **info, **{k: getattr(spec, k) for k in ("variant", "loss", "budget")}}
    result.update(seed=spec.seed, dims=list(spec.dims))
    if spec.variant in TRAINED_PRF:  # the draw training started from (a Performer of these dims)
        untrained = {"teacher": run.inputs["teacher"], "dims": list(spec.dims), "seed": spec.seed}
        dims_tag = "-".join(map(str, spec.dims))
        path = cfg.out / "eval" / f"untrained-{dims_tag}-s{spec.seed}.json"
        compute = lambda: layer_errors(run, performer(run, spec))
        result["layer_error_before"] = runs.stage(path, {**untrained, **eval_key(run)}, compute)
    kl = result["layer_error"]["kl"]
    kl_text = "—" if None in kl else f"{np.mean(kl):.4g}"
    log(f"{spec.name}: WikiText-2 perplexity {result['wikitext2_ppl']:.2f}, mean KL {kl_text}")
    return result


def performer(run: Run, spec: Student):
    """The untrained draw of a student's dims and seed: where its training started."""
    return make_student(run.teacher, "prf", spec.dims, spec.seed)


def layer_errors(run: Run, student, windows=None, offset=0) -> dict:
    windows = windows or run.cfg.error_windows
    heldout = run.texts["heldout"]
    return evaluate.layer_errors(run.teacher, student, heldout, run.ctx, windows, offset)


def collect(run: Run, teacher_result, allocation, sweep_rows, curves, students) -> dict:
    cfg = run.cfg
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("out", "data")}
    config.update(ctx=run.ctx, lam=run.lam, budgets=list(run.budgets))
    stages = teacher_result["eval_seconds"] + allocation["seconds"]
    stages += sum(s["eval_seconds"] for s in students.values())
    stages += sum(s["train_seconds"] for s in students.values() if "same_training_as" not in s)
    stages += curves["curve_only_train_seconds"] if curves else 0.0
    model_cfg = run.teacher.config
    teacher = {"name": model_cfg.name, "identity": run.teacher.identity, **teacher_result}
    teacher.update(head_dim=model_cfg.head_dim, n_layer=model_cfg.n_layer)
    return {
        "teacher": teacher,
        "dof": allocation,
        "sweep": sweep_rows,
        "curves": curves,
        "students": students,
        "config": config,
        "inputs": run.inputs,
        "provenance": runs.provenance(run.teacher),
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
    spec = Student(*best.split("/")[:2], 0, 0, ())
    path = run.cfg.out / "students" / f"{best.replace('/', '-')}.safetensors"
    student = load_student(run.teacher, path)
    prompt = run.tokenizer.encode(PROMPT).ids
    log(f"\ngreedy continuations of {PROMPT!r}:")
    for name, model in (("teacher", run.teacher), (best, student)):
        text = run.tokenizer.decode(dofmini.generate(model, prompt, 24)[len(prompt) :])
        log(f"  {name}: {text!r}")
    del spec


if __name__ == "__main__":
    sys.exit(main())
