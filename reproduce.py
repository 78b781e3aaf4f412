"""The paper's comparison for one teacher, in one command: estimate DoF, allocate feature dims,
train every variant at every budget and seed, evaluate everything, and write results.json and
report.md.

    python reproduce.py gpt2                        # a named model, downloaded once into weights/
    python reproduce.py path/to/checkpoint --profile quick

Every setting of a run is one field of RunConfig below. Each stage saves its result under --out with
the settings and inputs that made it; running again reuses a stage only when they match.
"""

import dataclasses
import json
import os
import sys
import tempfile
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from dofmini import hub
from dofmini.distill import TrainSettings
from dofmini.files import sha256_file, write_text
from dofmini.study import (
    bank,
    compare,
    data,
    devices,
    endtoend,
    estimate,
    evaluate,
    flags,
    guard,
    keys,
    plan,
    report,
    runs,
    stages,
)
from dofmini.study.finetune_stages import data_groups, run_all
from dofmini.study.runs import log

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
    device: str = "auto"  # the GPU where torch sees one (each rank's under torchrun), else cpu
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


def parse_args(argv) -> RunConfig:
    """The flags over the profile's fields (flags.parse), checked (flags.check)."""
    given = flags.parse(argv, RunConfig, PROFILES, __doc__.split("\n\n")[0])
    return flags.check(RunConfig(**PROFILES[given["profile"]] | given))


def main(argv=None):
    devices.start()
    # also a path the system refuses (too long) in parse_args
    with guard.one_line_errors(flags.fail):
        cfg = parse_args(argv)
        if cfg.plan_only or not devices.is_writer():  # they write nothing into --out
            return _main(cfg)
        with guard.locked(cfg.out, flags.fail):
            return _main(cfg)


def _main(cfg: RunConfig):
    devices.agree(cfg)  # under torchrun: every rank the same settings, inputs and --out, or stop
    tasks = [] if cfg.limit == 0 else list(evaluate.TASKS)
    groups = ["wikitext2", "corpus", "heldout", *tasks]
    if cfg.finetune:  # only then: the default run's downloads stay as they are
        groups = list(dict.fromkeys(groups + data_groups()))
    needed = {keys.CALIBRATION, *evaluate.PPL_TEXTS.values()}
    if unlisted := needed - {f.path for f in data.files(groups)}:
        rows = ", ".join(sorted(unlisted))
        flags.fail(f"the data registry has no row for {rows}; the run reads it")
    log(data.describe(groups, cfg.data))
    log(flags.device_line(cfg.device))
    weights = hub.missing_files(cfg.model)
    absent = data.missing(groups, cfg.data)
    if cfg.plan_only and (weights or absent):
        header = "not here yet (the stages follow once these are in place):"
        log(runs.missing_listing(weights, absent, cfg.data, header))
        return log("estimate: it times the run's work on the weights and data, once in place")

    def fetch_and_load():
        stop_if_unreachable(cfg, weights, absent)
        return load_teacher(cfg, data.ensure(groups, cfg.data, log=log))

    run = devices.writer_first(fetch_and_load)
    devices.writer_first(lambda: encode_texts(run))  # the others read its token caches
    plan_run(run)
    if cfg.plan_only:
        return
    teacher = stages.evaluate_teacher(run)
    allocation = stages.estimate_allocation(run)
    report.write_allocation(cfg.out, allocation, log)
    oracles = set(stages.ORACLES) & set(cfg.variants)
    curves = stages.error_curves(run, allocation) if oracles else None
    students, curves = endtoend.evaluate_students(run, allocation, curves)
    results = collect(run, teacher, allocation, curves, students)
    if cfg.finetune:
        results["finetune"] = run_all(run, stages.specs(run, allocation, curves))
        log(report.finetune_table(results["finetune"]))
    write_text(cfg.out / "results.json", json.dumps(results, indent=1, sort_keys=True))
    log("\n" + report.write(cfg.out, results))
    log("\n" + report.closing(cfg.out, results))


def load_teacher(cfg: RunConfig, hashes: dict) -> keys.Run:
    teacher = hub.load(cfg.model).to(cfg.device)
    tokenizer = hub.load_tokenizer(cfg.model)
    model_cfg = teacher.config
    ctx = min(cfg.ctx or model_cfg.n_ctx, model_cfg.n_ctx, cfg.max_ctx)
    paper_lam = 2.0**-4 if model_cfg.family == "gpt2" else 2.0**-8
    lam = cfg.lam if cfg.lam is not None else paper_lam
    budgets = cfg.budgets or (model_cfg.head_dim,)
    lo, hi = min(cfg.curve_dims), max(cfg.curve_dims)
    if "oracle" in cfg.variants and not all(lo <= b <= hi for b in budgets):
        flags.fail(f"budgets {list(budgets)}: the oracle allocates between its curves' dims; "
              f"expected budgets in {lo}..{hi}")  # fmt: skip
    pool = 2 * cfg.calib_windows * ctx  # queries and keys per head on the calibration text
    if cfg.J > pool:
        flags.fail(f"--J {cfg.J} is more than the {pool} queries and keys per head that "
              f"{cfg.calib_windows} calibration windows of {ctx} tokens give")  # fmt: skip
    tokenizer_hash = sha256_file(hub.locate(cfg.model) / "tokenizer.json")[:16]
    device = runs.device_name(teacher) + devices.teacher_precision(teacher, cfg.precision)
    inputs = dict(teacher=teacher.identity, tokenizer=tokenizer_hash, device=device, **hashes)
    log(f"dofmini: {model_cfg.name} ({model_cfg.family}, {model_cfg.n_layer} layers x "
        f"{model_cfg.n_head} heads of {model_cfg.head_dim}), profile {cfg.profile}, ctx {ctx}, "
        f"seeds {list(cfg.seeds)}, budgets {list(budgets)}, out {cfg.out}")  # fmt: skip
    return keys.Run(cfg, teacher, tokenizer, ctx, lam, tuple(budgets), inputs)


def encode_texts(run: keys.Run):
    """calib (WikiText-2 valid, for DoF), wikitext2 (test), heldout and train token ids."""
    cfg, keep = run.cfg, not run.cfg.plan_only  # a plan leaves no cache
    for name, relative in run.texts_read().items():
        max_chars = cfg.train_chars if name == "train" else None
        files = {r: run.inputs[r] for r in relative}
        key = dict(tokenizer=run.inputs["tokenizer"], max_chars=max_chars, files=files)
        path = cfg.out / f"tokens-{name}.npy"
        paths = [cfg.data / r for r in relative]
        run.texts[name] = runs.token_ids(path, key, paths, run.tokenizer, max_chars, keep)
    run.texts["calib"] = run.texts["calib"][: cfg.calib_windows * run.ctx]


def plan_run(run: keys.Run):
    """Print the run's stages in order, "done" for those saved with this run's keys (a rerun
    reloads them), and the time each other one should take here; keep the order and those times
    for the progress lines. First, a teacher whose forward pass overflows its dtype stops the
    run."""
    cfg, teacher = run.cfg, run.teacher
    weight = next(teacher.parameters())
    vocab = teacher.config.vocab_size
    ids = torch.randint(0, vocab, (1, run.ctx), generator=torch.Generator())
    if not torch.isfinite(teacher(ids.to(weight.device))).all():  # logits [1, ctx, V]
        why = f"its weights overflow {weight.dtype} in the forward pass"
        flags.fail(f"the teacher's logits on random tokens are not finite: {why}")
    rows = plan.stages_of(run)
    names, done = plan.names(rows), plan.done(rows)
    todo = [name for name in names if name not in done]
    if todo:
        log(f"timing the run's work here ({estimate.HOW})")
    seconds = estimate.estimate(run, todo)
    run.clock.plan = names
    run.clock.estimates = {name: estimate.middle(ends) for name, ends in seconds.items()}
    steps, world = keys.settings(run, cfg.seeds[0]).steps, devices.world()
    parts = -(-cfg.batch // cfg.per_device)
    share = f"; {world} ranks, each at most {-(-parts // world)} of a step's {parts} parts"
    windows = f"{steps} steps of {cfg.batch} windows of {run.ctx} tokens, {cfg.per_device} at once"
    log(f"plan (each student: {windows}{share if world > 1 else ''}):")
    for name in names:
        log(f"  {name}: {estimate.span(seconds[name]) if name in seconds else 'done'}")
    rest = estimate.total(seconds, cfg.device)
    log(f"  {len(done)} of {len(names)} stages done{rest}")
    log(f"  {units_line(plan.new_units(run), teacher.config.n_layer)}")


def units_line(fresh: dict, n_layer: int) -> str:
    """How many layer units (bank.py) the layerwise students still train: each (loss, layer,
    M, seed) once, whichever students share it."""
    known = sum(units[0] for units in fresh.values() if units is not None)
    unknown = [name for name, units in fresh.items() if units is None]
    sized = len(fresh) - len(unknown)
    said = f"layer units to train: {known} (layerwise students of known dims: {sized})"
    if unknown:
        later = f"{len(unknown)} whose dims DoF or the curves give"
        said += f"; up to {n_layer} more for each of {later}"
    return said


def stop_if_unreachable(cfg: RunConfig, weights: list, absent: list):
    """Before any download, one message when a source of a missing file cannot be reached: what
    is missing and from where, the file that lists each URL and destination, then the fix."""
    hosts = {}  # host: one URL on it
    for url in [url for url, _ in weights] + [data.source(f) for f in absent]:
        hosts.setdefault(urllib.parse.urlsplit(url).netloc, url)
    with ThreadPoolExecutor() as pool:  # at once: each silent host costs its timeout once
        why = dict(zip(hosts, pool.map(hub.unreachable, hosts.values())))
    if not any(why.values()):
        return

    def where(urls) -> str:
        found = dict.fromkeys(urllib.parse.urlsplit(url).netloc for url in urls)
        return ", ".join(f"{host} ({why[host]})" if why[host] else host for host in found)

    lines = ["files this run needs are missing, and where they come from cannot be reached:"]
    if weights:
        sources = where(url for url, _ in weights)
        lines.append(f"  weights of {cfg.model}: {len(weights)} file(s) from {sources}")
    if absent:
        sources = where(map(data.source, absent))
        lines.append(f"  data: {len(absent)} file(s), {data.size_mb(absent)}, from {sources}")
    header = "Each file this run lacks: its URL, then where it goes."
    handle, listing = tempfile.mkstemp(prefix="dofmini-missing-", suffix=".txt", text=True)
    with os.fdopen(handle, "w") as file:
        file.write(runs.missing_listing(weights, absent, cfg.data, header) + "\n")
    lines.append(f"Each file's URL and destination are in {listing}.")
    lines.append(
        "Fix: download each file to its destination (a Wikipedia file as served: it is converted "
        "on the next run), or point DOFMINI_WEIGHTS, --data or DOFMINI_DATA_MIRROR at copies "
        "that hold them; or run again once those hosts answer."
    )
    flags.fail("\n".join(lines))


def collect(run: keys.Run, teacher_result, allocation, curves, students) -> dict:
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
    curve_students = stages.curve_specs(run) if curves else []
    found["bank"] = bank.cost(run, curve_students + stages.specs(run, allocation, curves))
    # a resumed run skips finished stages, so its own wall time says little
    timings = {"stages_seconds": seconds, "this_invocation_seconds": time.time() - run.clock.t0}
    return dict(found, provenance=runs.provenance(run.teacher), timings=timings)


if __name__ == "__main__":
    sys.exit(main())
