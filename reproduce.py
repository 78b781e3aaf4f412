"""The paper's comparison for one teacher, in one command: estimate DoF, allocate feature dims,
train every variant at every budget and seed, evaluate everything, and write results.json and
report.md.

    python reproduce.py gpt2                        # a named model, downloaded once into weights/
    python reproduce.py path/to/checkpoint --profile quick

Every setting of a run is one field of RunConfig below. Each stage saves its result under --out with
the settings and inputs that made it; running again reuses a stage only when they match.
"""

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from dofmini import hub
from dofmini.distill import TrainSettings
from dofmini.files import sha256_file, write_text
from dofmini.study import compare, data, devices, endtoend, evaluate, report, runs, stages
from dofmini.study.finetune import data_groups, parse_lr, report_table, run_all
from dofmini.study.runs import log

VARIANTS = ("performer", "dijiang", "fix", *stages.ALLOCATIONS, *stages.ORACLES)
LOSSES = ("softmax", "l2", "direct")
SEED_LIMIT = 2**31 - 1  # seeds are offset by the layer index and must stay within torch's range
MAX_FEATURES = 4096  # per layer: far above any head size, below what memory can hold
# What each profile changes in RunConfig's defaults (which are the "default" profile).
PROFILES = {
    "quick": dict(ctx=64, J=128, calib_windows=8, steps=4, batch=2, eval_windows=4, limit=4,
                  error_windows=4, curve_windows=4, train_chars=200_000, e2e_windows=4),
    "default": {},
    "study": dict(eval_windows=64, limit=0, seeds=(0, 1, 2), budgets=(16, 32, 64),
                  variants=("fix", "dof", "dof_sqrt", "dof_sqrt_mean", "oracle", "oracle_e2e",
                            "dof_inv_sqrt", "dof_floor", "dof_inv")),
    "paper": dict(ctx=None, steps=None, eval_windows=None, limit=None),
}  # fmt: skip


@dataclass(frozen=True)
class RunConfig:
    """Every setting a run depends on. Profiles fill the sizes; flags override single fields."""

    model: str
    profile: str = "default"
    out: Path | None = None  # default runs/<model>-<profile>
    data: Path | None = None  # the data store; default DOFMINI_DATA or the user cache
    device: str = "cpu"
    precision: str = "fp32"  # the teacher's forward passes: fp32, or bf16 autocast (devices)
    per_device: int | None = None  # windows back-propagated at once; None: a quarter of the batch
    variants: tuple = ("performer", "dijiang", "fix", "dof", "dof_clip")
    losses: tuple = ("softmax",)  # the PRF students' losses, each at every budget
    seeds: tuple = (0,)  # each sets the feature draw and the data order; Fix and DoF share it
    budgets: tuple | None = None  # mean features per layer; None: the head size
    curve_dims: tuple = (8, 16, 32, 64, 128)  # per-layer error curves, for the oracle
    lam: float | None = None  # DoF λ; None: 2^-4 for GPT-2, 2^-8 for Pythia (the paper's)
    J: int = 1024  # queries and keys sampled per head for DoF
    raw_gram: bool = False  # DoF from the raw Gram G instead of G/J
    plan_only: bool = False  # print the plan and stop
    ctx: int | None = 256  # None: the model's own context, at most max_ctx
    calib_windows: int = 64  # windows of WikiText-2 valid for DoF
    steps: int | None = 400  # optimiser steps per student; None: one pass over the corpus
    batch: int = 8  # windows per step
    lr: float = TrainSettings.lr  # z
    lr_a: float = TrainSettings.lr_a  # a = log α
    train_chars: int | None = None  # read only this many characters of the corpus
    eval_windows: int | None = 128  # perplexity windows per text; None: all
    limit: int | None = 100  # examples per task; None: all; 0: no tasks
    error_windows: int = 32  # held-out windows for the per-layer errors
    curve_windows: int = 16  # the next held-out windows, for the error curves
    e2e_windows: int = 32  # the next ones, for end-to-end KL; the next ones, for the swap curves
    max_ctx: int = 2048
    finetune: bool = False  # fine-tune every model on the seven tasks (finetune.py)
    finetune_lr: tuple = ()  # ((task, rate), ...): these tasks skip the teacher's grid search


ENVIRONMENT = """environment:
  DOFMINI_DATA=DIR         the data store (else $XDG_CACHE_HOME/dofmini/data, ~/.cache/...)
  DOFMINI_DATA_MIRROR=URL  fetch every data file from URL/<path in the store> instead
  DOFMINI_WEIGHTS=DIR      where named models are downloaded (else weights/ in the checkout)"""


def parse_args(argv) -> RunConfig:
    """The flags over the profile's fields: each flag's dest is its RunConfig field, and a flag
    left out is absent (argparse.SUPPRESS), so it never undoes what the profile sets."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=ENVIRONMENT,
        formatter_class=argparse.RawTextHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("model", help=f"a known name ({', '.join(hub.HUB_REPOS)}) or a folder\n"
                   "holding config.json, model.safetensors, tokenizer.json")  # fmt: skip
    p.add_argument("--profile", choices=PROFILES, default="default",
                   help="quick: a smoke run; default: one seed, one budget;\n"
                   "study: seeds 0-2, budgets 16/32/64, Fix, 6 DoF rules, 2 oracles;\n"
                   "paper: the paper's sizes, meant for a GPU")  # fmt: skip
    p.add_argument("--out", type=partial(_arg, "--out", Path), help="default runs/MODEL-PROFILE")
    p.add_argument("--data", type=Path, help="data store (default $DOFMINI_DATA, else the cache)")
    p.add_argument("--device", help="cpu (the default), cuda or cuda:N (torchrun: each rank's)")
    p.add_argument("--precision", choices=("fp32", "bf16"), help="bf16: the teacher in autocast")
    p.add_argument("--batch-per-device", type=int, dest="per_device", help="windows a device takes")
    p.add_argument("--variants", type=partial(_arg, "--variants", _variants),
                   help=f"from {', '.join(VARIANTS)};\nnone: only the teacher and DoF")  # fmt: skip
    p.add_argument("--loss", dest="losses", type=partial(_arg, "--loss", _split),
                   help=f"from {', '.join(LOSSES)}, e.g. softmax,l2")  # fmt: skip
    p.add_argument("--seeds", type=partial(_arg, "--seeds", _ints), help="e.g. 0,1,2 (default 0)")
    p.add_argument("--budgets", type=partial(_arg, "--budgets", _ints), help="mean features/layer")
    p.add_argument("--limit", type=int, help="first N examples per task (0: no tasks)")
    p.add_argument("--lam", type=float, help="DoF λ (default 2^-4 for GPT-2, 2^-8 for Pythia)")
    p.add_argument("--J", type=int, help="queries and keys sampled per head for DoF")
    p.add_argument("--raw-gram", action="store_true", help="DoF from the raw Gram G, not G/J")
    p.add_argument("--plan-only", action="store_true", help="print the plan and stop")
    p.add_argument("--finetune", action="store_true", help="fine-tune every model on the tasks")
    p.add_argument("--finetune-lr", type=_finetune_lr, help="TASK=LR,... or paper (Table 8)")
    given = vars(p.parse_args(argv))
    return check(RunConfig(**PROFILES[given["profile"]] | given))


def _fail(message: str):
    rank = f"rank {devices.rank()} of {devices.world()}: " if devices.world() > 1 else ""
    raise SystemExit(f"reproduce.py: error: {rank}{message}")


def _arg(flag: str, convert, text: str):
    """`flag`'s argument `text` converted (argparse's type, partly applied); '' (no value) and
    integers that do not parse refused in one line."""
    if text == "":
        _fail(f"{flag} '': expected {'a folder' if flag == '--out' else 'a value'}, or no flag")
    try:
        return convert(text)
    except ValueError:
        _fail(f"{flag} {text!r}: expected comma-separated integers")


def _ints(text: str) -> tuple:
    return tuple(int(x) for x in text.split(","))


def _split(text: str) -> tuple:
    return tuple(text.split(","))


def _finetune_lr(text: str) -> tuple:
    try:
        return parse_lr(text)
    except ValueError as err:
        _fail(f"--finetune-lr {err}")


def _variants(text: str) -> tuple:
    return () if text == "none" else _split(text)


def check(cfg: RunConfig) -> RunConfig:
    """Every value checked before any model or data work; one line naming the flag and the value."""
    for kind, values, known in (("variant", cfg.variants, VARIANTS), ("loss", cfg.losses, LOSSES)):
        if unknown := [value for value in values if value not in known]:
            _fail(f"unknown {kind} {unknown[0]!r}; choose from {', '.join(known)}")
    if cfg.lam is not None and not (cfg.lam > 0 and math.isfinite(cfg.lam)):
        _fail(f"--lam {cfg.lam}: expected a positive finite number")
    if cfg.limit is not None and cfg.limit < 0:
        _fail(f"--limit {cfg.limit}: expected 0 (no tasks) or more")
    if (cfg.finetune or cfg.finetune_lr) and (cfg.limit == 0 or devices.world() > 1):
        _fail("--finetune scores tasks in one process: not with --limit 0 or under torchrun")
    if cfg.J < 2:
        _fail(f"--J {cfg.J}: expected 2 or more samples per head")
    if cfg.per_device is not None and cfg.per_device < 1:
        _fail(f"--batch-per-device {cfg.per_device}: expected 1 or more windows")
    part = cfg.per_device or max(1, cfg.batch // 4)  # 1, 2 or 4 devices share its parts evenly
    if -(-cfg.batch // part) < devices.world():
        why = f"the profile's {cfg.batch} windows a step, back-propagated {part} at a time"
        _fail(f"{devices.world()} ranks: expected at most one for each part ({why})")
    for seed in cfg.seeds:
        if not 0 <= seed <= SEED_LIMIT - 1000:
            _fail(f"--seeds {seed}: expected 0..{SEED_LIMIT - 1000}")
    listed = {"--variants": cfg.variants, "--loss": cfg.losses, "--seeds": cfg.seeds}
    for flag, values in listed.items():
        if len(set(values)) != len(values):
            _fail(f"{flag} {','.join(map(str, values))}: a value appears twice")
    for budget in cfg.budgets or ():
        if not 1 <= budget <= MAX_FEATURES:
            _fail(f"--budgets {budget}: expected 1..{MAX_FEATURES} features per layer")
    index = cfg.device.removeprefix("cuda:")
    available = cfg.device == "cpu" or (cfg.device == "cuda" and torch.cuda.is_available())
    if not available and not (index.isdigit() and int(index) < torch.cuda.device_count()):
        seen = f"torch sees {torch.cuda.device_count()} CUDA device(s)"
        _fail(f"--device {cfg.device} is not available here ({seen}); expected cpu, cuda, cuda:N")
    hub.locate(cfg.model)  # its CheckpointError (an unknown name, no config.json): main's one line
    out = cfg.out or Path("runs") / f"{Path(cfg.model).name}-{cfg.profile}"
    runs.check_writable(out, "--out", _fail)
    store = data.store_dir(cfg.data)
    if store.exists() and not store.is_dir():
        _fail(f"--data {store} is a file; expected the data store's folder")
    tuned = cfg.finetune or bool(cfg.finetune_lr)  # rates given ask for fine-tuning
    return dataclasses.replace(cfg, out=out, data=store, per_device=part, finetune=tuned)


def main(argv=None):
    devices.start()
    with runs.one_line_errors(_fail):  # also a path the system refuses (too long) in parse_args
        cfg = parse_args(argv)
        if cfg.plan_only or not devices.is_writer():  # they write nothing into --out
            return _main(cfg)
        with runs.locked(cfg.out, _fail):
            return _main(cfg)


def _main(cfg: RunConfig):
    devices.agree(cfg)  # under torchrun: every rank the same settings, inputs and --out, or stop
    tasks = [] if cfg.limit == 0 else list(evaluate.TASKS)
    groups = ["wikitext2", "corpus", "heldout", *tasks]
    if cfg.finetune:  # only then: the default run's downloads stay as they are
        groups = list(dict.fromkeys(groups + data_groups()))
    needed = {stages.CALIBRATION, *evaluate.PPL_TEXTS.values()}
    if unlisted := needed - {f.path for f in data.files(groups)}:
        _fail(f"the data registry has no row for {', '.join(sorted(unlisted))}; the run reads it")
    log(data.describe(groups, cfg.data))
    weights, absent = hub.missing_files(cfg.model), data.missing(groups, cfg.data)
    if cfg.plan_only and (weights or absent):
        header = "not here yet (the stages follow once these are in place):"
        return log(runs.missing_listing(weights, absent, cfg.data, header))
    run = devices.writer_first(lambda: load_teacher(cfg, data.ensure(groups, cfg.data, log=log)))
    devices.writer_first(lambda: encode_texts(run))  # the others read its token caches
    plan_run(run)
    if cfg.plan_only:
        return
    teacher = stages.evaluate_teacher(run)
    allocation = stages.estimate_allocation(run)
    report.write_allocation(cfg.out, allocation, log)
    curves = stages.error_curves(run) if set(stages.ORACLES) & set(cfg.variants) else None
    students, curves = endtoend.evaluate_students(run, allocation, curves)
    results = collect(run, teacher, allocation, curves, students)
    if cfg.finetune:
        results["finetune"] = run_all(run, stages.specs(run, allocation, curves))
        log(report_table(results["finetune"]))
    write_text(cfg.out / "results.json", json.dumps(results, indent=1, sort_keys=True))
    log("\n" + report.write(cfg.out, results))
    log("\n" + report.closing(cfg.out, results))


def load_teacher(cfg: RunConfig, hashes: dict) -> stages.Run:
    teacher = hub.load(cfg.model).to(cfg.device)
    tokenizer = hub.load_tokenizer(cfg.model)
    model_cfg = teacher.config
    ctx = min(cfg.ctx or model_cfg.n_ctx, model_cfg.n_ctx, cfg.max_ctx)
    lam = cfg.lam if cfg.lam is not None else (2.0**-4 if model_cfg.family == "gpt2" else 2.0**-8)
    budgets = cfg.budgets or (model_cfg.head_dim,)
    lo, hi = min(cfg.curve_dims), max(cfg.curve_dims)
    if "oracle" in cfg.variants and not all(lo <= b <= hi for b in budgets):
        _fail(f"budgets {list(budgets)}: the oracle allocates between its curves' dims; "
              f"expected budgets in {lo}..{hi}")  # fmt: skip
    pool = 2 * cfg.calib_windows * ctx  # queries and keys per head on the calibration text
    if cfg.J > pool:
        _fail(f"--J {cfg.J} is more than the {pool} queries and keys per head that "
              f"{cfg.calib_windows} calibration windows of {ctx} tokens give")  # fmt: skip
    tokenizer_hash = sha256_file(hub.locate(cfg.model) / "tokenizer.json")[:16]
    device = runs.device_name(teacher) + devices.teacher_precision(teacher, cfg.precision)
    inputs = dict(teacher=teacher.identity, tokenizer=tokenizer_hash, device=device, **hashes)
    log(f"dofmini: {model_cfg.name} ({model_cfg.family}, {model_cfg.n_layer} layers x "
        f"{model_cfg.n_head} heads of {model_cfg.head_dim}), profile {cfg.profile}, ctx {ctx}, "
        f"seeds {list(cfg.seeds)}, budgets {list(budgets)}, out {cfg.out}")  # fmt: skip
    return stages.Run(cfg, teacher, tokenizer, ctx, lam, tuple(budgets), inputs)


def encode_texts(run: stages.Run):
    """calib (WikiText-2 valid, for DoF), wikitext2 (test), heldout and train token ids."""
    cfg, keep = run.cfg, not run.cfg.plan_only  # a plan leaves no cache
    for name, relative in run.texts_read().items():
        max_chars = cfg.train_chars if name == "train" else None
        files = {r: run.inputs[r] for r in relative}
        key = dict(tokenizer=run.inputs["tokenizer"], max_chars=max_chars, files=files)
        path, paths = cfg.out / f"tokens-{name}.npy", [cfg.data / r for r in relative]
        run.texts[name] = runs.token_ids(path, key, paths, run.tokenizer, max_chars, keep)
    run.texts["calib"] = run.texts["calib"][: cfg.calib_windows * run.ctx]


def plan_run(run: stages.Run):
    """Print the run's stages in order, "done" for those saved with this run's keys (a rerun
    reloads them), and keep the order for the progress lines; first, a teacher whose forward pass
    overflows its dtype stops the run."""
    cfg, teacher = run.cfg, run.teacher
    weight = next(teacher.parameters())
    ids = torch.randint(0, teacher.config.vocab_size, (1, run.ctx), generator=torch.Generator())
    if not torch.isfinite(teacher(ids.to(weight.device))).all():  # logits [1, ctx, V]
        why = f"its weights overflow {weight.dtype} in the forward pass"
        _fail(f"the teacher's logits on random tokens are not finite: {why}")
    names = ["teacher evaluation", "DoF estimate"]
    if "oracle_e2e" in cfg.variants:
        names.append(endtoend.SWAP_STAGE)
    names += [stages.Student(*key, ()).name for key in stages.student_keys(run)]
    run.clock.plan, done = names, done_stages(run)
    steps, world = stages.settings(run, cfg.seeds[0]).steps, devices.world()
    parts = -(-cfg.batch // cfg.per_device)
    share = f"; {world} ranks, each at most {-(-parts // world)} of a step's {parts} parts"
    windows = f"{steps} steps of {cfg.batch} windows of {run.ctx} tokens, {cfg.per_device} at once"
    log(f"plan (each student: {windows}{share if world > 1 else ''}):")
    for name in names:
        log(f"  {name}: done" if name in done else f"  {name}")
    log(f"  {len(done)} of {len(names)} stages done")


def done_stages(run: stages.Run) -> set:
    """The plan names of the stages already saved with this run's keys, a student's with its
    end-to-end KL. A student's key needs its dims: DoF's come from a saved allocation, the
    oracle's from the saved curves."""
    cfg, files = run.cfg, stages.stage_files(run)
    saved = {name: runs.saved(*files[name]) for name in files}
    found = {name for name, result in saved.items() if result}
    errors, curves = {}, None
    for spec in stages.curve_specs(run) if set(stages.ORACLES) & set(cfg.variants) else ():
        found_m = runs.saved(*stages.student_file(run, spec, curve=True))
        errors.setdefault(str(spec.seed), []).append(found_m)
        if found_m and spec.budget not in run.budgets:  # a student of the curves only
            found.add(spec.name)
    if errors and all(None not in by_m for by_m in errors.values()):
        curves = stages.curves_record(errors, cfg.curve_dims, run.budgets, 0.0)
    swaps = "oracle_e2e" in cfg.variants and endtoend.swap_curves(run, saved_only=True)
    if swaps:
        found.add(endtoend.SWAP_STAGE)
        curves = curves and {**curves, "e2e": swaps}
    for spec in stages.specs(run, saved["DoF estimate"], curves):
        evaluated = spec.dims and runs.saved(*stages.student_file(run, spec))
        if evaluated and runs.saved(*endtoend.stage_file(run, spec)) is not None:
            found.add(spec.name)
    return found


def collect(run: stages.Run, teacher_result, allocation, curves, students) -> dict:
    """results.json: every number, the settings, the inputs' hashes and what made them."""
    config = {k: v for k, v in dataclasses.asdict(run.cfg).items() if k not in ("out", "data")}
    inputs = dict(run.inputs, read=run.files_read())  # the data files in the order read
    config.update(ctx=run.ctx, lam=run.lam, budgets=list(run.budgets))
    trainings = [s["train_seconds"] for s in students.values() if "same_training_as" not in s]
    seconds = teacher_result["eval_seconds"] + allocation["seconds"] + sum(trainings)
    seconds += sum(s["eval_seconds"] for s in students.values())
    seconds += curves["curve_only_train_seconds"] if curves else 0.0
    model_cfg = run.teacher.config
    teacher = dict(teacher_result, name=model_cfg.name, identity=run.teacher.identity)
    teacher.update(head_dim=model_cfg.head_dim, n_layer=model_cfg.n_layer, e2e_kl=0.0)
    found = dict(teacher=teacher, dof=allocation, curves=curves)
    found.update(students=students, config=config, inputs=inputs)
    found["e2e"] = compare.e2e_summary(compare.groups(students))  # the metric to choose by
    # a resumed run skips finished stages, so its own wall time says little
    timings = {"stages_seconds": seconds, "this_invocation_seconds": time.time() - run.clock.t0}
    return dict(found, provenance=runs.provenance(run.teacher), timings=timings)


if __name__ == "__main__":
    sys.exit(main())
