"""The paper's comparison for one teacher, in one command: estimate DoF, allocate feature dims,
train every variant at every budget and seed, evaluate everything, and write results.json and
report.md.

    python reproduce.py gpt2                        # a named model, downloaded once into weights/
    python reproduce.py path/to/checkpoint --profile quick

Every setting of a run is one field of RunConfig below. Each stage saves its result under --out with
the settings and inputs that made it; running again reuses a stage only when they match.
"""

import hashlib
import json
import sys
import tempfile
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from dofmini import hub
from dofmini.distill import TrainSettings
from dofmini.files import by_hand, sha256_file, write_text
from dofmini.study import data, devices, estimate, evaluate, flags, guard, pipeline, report, store
from dofmini.study.finetune_stages import data_groups, unpinned
from dofmini.study.flags import ints, names, option, rates, variants
from dofmini.study.run import CALIBRATION, Run
from dofmini.study.runner import Runner
from dofmini.study.store import log

# What each profile changes in RunConfig's defaults (which are the "default" profile); the
# fine-tuning sizes (finetune_*) the default's take the GPT-2 stand-in about an hour on 2 cores.
PROFILES = {
    "quick": dict(ctx=64, J=128, calib_windows=8, steps=4, batch=2, eval_windows=4, limit=4,
                  error_windows=4, curve_windows=4, train_chars=200_000, e2e_windows=4,
                  finetune_train_limit=8, finetune_select=2, finetune_epochs=1, finetune_batch=4),
    "default": {},
    "study": dict(eval_windows=64, limit=0, seeds=(0, 1, 2), budgets=(16, 32, 64),
                  variants=("fix", "dof", "dof_sqrt", "dof_sqrt_mean", "oracle", "oracle_e2e",
                            "dof_inv_sqrt", "dof_floor", "dof_inv"),
                  finetune_train_limit=256),
    "paper": dict(ctx=None, steps=None, eval_windows=None, limit=None,
                  finetune_train_limit=None, finetune_batch=None),
}  # fmt: skip
KNOWN = ", ".join(hub.HUB_REPOS)
VARIANTS = ", ".join(flags.VARIANTS)


@dataclass(frozen=True)
class RunConfig:
    """Every setting a run depends on. Profiles fill the sizes; flags (`option`) override single
    fields, each flag's help beside its field."""

    model: str = option(
        None,
        f"a known name ({KNOWN}) or a folder holding config.json, "
        "model.safetensors, tokenizer.json",
    )
    profile: str = option(
        "default",
        "quick: a smoke run; default: one seed, one budget; study: "
        "seeds 0-2, budgets 16/32/64, Fix, 6 DoF rules, 2 oracles; paper: the "
        "paper's sizes, meant for a GPU",
    )
    out: Path | None = option(None, "the run's folder", type=Path, none="runs/MODEL-PROFILE")
    data: Path | None = option(
        None, "the data store", type=Path, none="$DOFMINI_DATA, else the user cache"
    )
    device: str = option(
        "auto",
        "auto (a GPU where torch sees one), cpu, cuda, cuda:N; under "
        "torchrun cuda is each rank's own",
    )
    precision: str = option(
        "fp32", "the teacher's forward passes; bf16: in autocast", choices=("fp32", "bf16")
    )
    per_device: int | None = option(
        None,
        "windows back-propagated at once",
        type=int,
        flag="--batch-per-device",
        none="a quarter of the batch",
    )
    variants: tuple = option(
        ("performer", "dijiang", "fix", "dof", "dof_clip"),
        f"from {VARIANTS}; none: only the teacher and DoF",
        type=variants,
    )
    losses: tuple = option(
        ("softmax",),
        "the PRF students' losses, each at every budget: from softmax, l2, direct, e.g. softmax,l2",
        type=names,
        flag="--loss",
    )
    seeds: tuple = option(
        (0,), "e.g. 0,1,2; each sets a student's feature draw and data order", type=ints
    )
    budgets: tuple | None = option(None, "mean features a layer", type=ints, none="the head size")
    curve_dims: tuple = option(
        (8, 16, 32, 64, 128), "the oracles' error curves' feature counts, two or more", type=ints
    )
    lam: float | None = option(None, "DoF λ", type=float, none="2^-4 for GPT-2, 2^-8 for Pythia")
    J: int = option(1024, "queries and keys sampled a head for DoF", type=int)
    raw_gram: bool = option(False, "DoF from the raw Gram G, not G/J")
    plan_only: bool = option(False, "print the plan, with its estimate, and stop")
    ctx: int | None = 256  # None: the model's own context, at most max_ctx
    calib_windows: int = 64  # windows of WikiText-2 valid for DoF
    steps: int | None = 400  # optimiser steps per student; None: one pass over the corpus
    batch: int = 8  # windows per step
    lr: float = TrainSettings.lr  # z
    lr_a: float = TrainSettings.lr_a  # a = log α
    train_chars: int | None = None  # read only this many characters of the corpus
    eval_windows: int | None = 128  # perplexity windows per text; None: all
    limit: int | None = option(100, "first N examples a task (0: none)", type=int, none="all")
    error_windows: int = 32  # held-out windows for the per-layer errors
    curve_windows: int = 16  # held-out windows for the error curves
    e2e_windows: int = 32  # for end-to-end KL; as many again for the swap curves (Run.windows)
    heldout_skip: int = option(
        0, "held-out windows before this one are never drawn (windows earlier runs used)", type=int
    )
    max_ctx: int = 2048
    finetune: bool = option(False, "fine-tune every model on the tasks (finetune.py)")
    finetune_lr: tuple = option(
        (), "TASK=LR,... or paper (Table 8)", type=rates, none="none: the teacher's grid search"
    )
    finetune_train_limit: int | None = 64  # training examples a task; None: all
    finetune_select: int = option(
        100, "training examples a task held out to choose the rate and the epoch", type=int
    )
    finetune_epochs: int = 3  # MMLU's is always 1, its accuracy the last epoch's
    finetune_batch: int | None = 16  # examples a step; None: the paper's (finetune_stages)


def parse_args(argv) -> RunConfig:
    """The flags over the profile's fields (flags.parse), checked (flags.check)."""
    given = flags.parse(argv, RunConfig, PROFILES, __doc__.split("\n\n")[0])
    return flags.check(RunConfig(**PROFILES[given["profile"]] | given), given)


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
    needed = {CALIBRATION, *evaluate.PPL_TEXTS.values()}
    if unlisted := needed - {f.path for f in data.files(groups)}:
        rows = ", ".join(sorted(unlisted))
        flags.fail(f"the data registry has no row for {rows}; the run reads it")
    if cfg.finetune and (rows := unpinned()):  # a registry made before the fine-tuning rows
        flags.fail(f"--finetune reads files the data registry has no row for: {', '.join(rows)}")
    log(data.describe(groups, cfg.data))
    log(flags.device_line(cfg.device))
    weights = hub.missing_files(cfg.model)
    absent = data.missing(groups, cfg.data)
    if cfg.plan_only and (weights or absent):
        header = "not here yet (the stages follow once these are in place):"
        log(missing_listing(weights, absent, cfg.data, header))
        return log("estimate: it times the run's work on the weights and data, once in place")

    def fetch_and_load():
        stop_if_unreachable(cfg, weights, absent)
        return load_teacher(cfg, data.ensure(groups, cfg.data, log=log))

    run = devices.writer_first(fetch_and_load)
    devices.writer_first(lambda: encode_texts(run))  # the others read its token caches
    check_teacher(run)
    plan, seconds = plan_run(run)
    if cfg.plan_only:
        return
    middles = {name: estimate.middle(ends) for name, ends in seconds.items()}
    results = pipeline.run_all(run, Runner(plan, middles))
    if cfg.finetune:
        log(report.finetune_table(results["finetune"]))
    write_text(cfg.out / "results.json", json.dumps(results, indent=1, sort_keys=True))
    log("\n" + report.write(cfg.out, results))
    log("\n" + report.closing(cfg.out, results))


def load_teacher(cfg: RunConfig, hashes: dict) -> Run:
    teacher = hub.load(cfg.model).to(cfg.device)
    tokenizer = hub.load_tokenizer(cfg.model)
    model_cfg = teacher.config
    ctx = min(cfg.ctx or model_cfg.n_ctx, model_cfg.n_ctx, cfg.max_ctx)
    paper_lam = 2.0**-4 if model_cfg.family == "gpt2" else 2.0**-8
    lam = cfg.lam if cfg.lam is not None else paper_lam
    budgets = cfg.budgets or (model_cfg.head_dim,)
    lo, hi = min(cfg.curve_dims), max(cfg.curve_dims)
    oracle = flags.oracle_of(cfg)
    if oracle and not all(lo <= b <= hi for b in budgets):
        flags.fail(f"budgets {list(budgets)}: {oracle} allocates between its curves' dims; "
              f"expected budgets in {lo}..{hi}")  # fmt: skip
    pool = 2 * cfg.calib_windows * ctx  # queries and keys per head on the calibration text
    if cfg.J > pool:
        flags.fail(f"--J {cfg.J} is more than the {pool} queries and keys per head that "
              f"{cfg.calib_windows} calibration windows of {ctx} tokens give")  # fmt: skip
    tokenizer_hash = sha256_file(hub.locate(cfg.model) / "tokenizer.json")[:16]
    device = devices.device_name(teacher) + devices.teacher_precision(teacher, cfg.precision)
    inputs = dict(teacher=teacher.identity, tokenizer=tokenizer_hash, device=device, **hashes)
    log(f"dofmini: {model_cfg.name} ({model_cfg.family}, {model_cfg.n_layer} layers x "
        f"{model_cfg.n_head} heads of {model_cfg.head_dim}), profile {cfg.profile}, ctx {ctx}, "
        f"seeds {list(cfg.seeds)}, budgets {list(budgets)}, out {cfg.out}")  # fmt: skip
    return Run(cfg, teacher, tokenizer, ctx, lam, tuple(budgets), inputs)


def encode_texts(run: Run):
    """calib (WikiText-2 valid, for DoF), wikitext2 (test), heldout and train token ids."""
    cfg, keep = run.cfg, not run.cfg.plan_only  # a plan leaves no cache
    for name, relative in run.texts_read().items():
        max_chars = cfg.train_chars if name == "train" else None
        files = {r: run.inputs[r] for r in relative}
        key = dict(tokenizer=run.inputs["tokenizer"], max_chars=max_chars, files=files)
        path = cfg.out / f"tokens-{name}.npy"
        paths = [cfg.data / r for r in relative]
        run.texts[name] = store.token_ids(path, key, paths, run.tokenizer, max_chars, keep)
    run.texts["calib"] = run.texts["calib"][: cfg.calib_windows * run.ctx]


def check_teacher(run: Run):
    """A teacher whose forward pass overflows its dtype stops the run before any stage."""
    weight = next(run.teacher.parameters())
    vocab = run.teacher.config.vocab_size
    ids = torch.randint(0, vocab, (1, run.ctx), generator=torch.Generator())
    if not torch.isfinite(run.teacher(ids.to(weight.device))).all():  # logits [1, ctx, V]
        why = f"its weights overflow {weight.dtype} in the forward pass"
        flags.fail(f"the teacher's logits on random tokens are not finite: {why}")


def plan_run(run: Run) -> tuple:
    """The pipeline in plan mode: print its stages in order, "done" for those saved with this
        run's keys (a rerun reloads them), the time each other one should take here and, where one
    of its files is saved under other settings, why it is made again. (The rows,
    {stage: (low, high) seconds}) for the progress lines."""
    cfg = run.cfg
    planner = Runner()
    pipeline.run_all(run, planner)
    rows = list(planner.rows.values())
    if not all(row.done for row in rows):
        log(f"timing the run's work here ({estimate.HOW})")
    seconds = estimate.estimate(run, rows)
    steps, world = run.settings(run.dof_seed).steps, devices.world()
    parts = -(-cfg.batch // cfg.per_device)
    share = f"; {world} ranks, each at most {-(-parts // world)} of a step's {parts} parts"
    windows = f"{steps} steps of {cfg.batch} windows of {run.ctx} tokens, {cfg.per_device} at once"
    log(f"plan (each student: {windows}{share if world > 1 else ''}):")
    for row in rows:
        why = f"; {row.why}" if row.why else ""
        log(f"  {row.name}: {estimate.span(seconds[row.name]) + why if not row.done else 'done'}")
    done = sum(row.done for row in rows)
    log(f"  {done} of {len(rows)} stages done{estimate.total(seconds, cfg.device)}")
    log(f"  {units_line(rows, run.teacher.config.n_layer)}")
    return rows, seconds


def units_line(rows: list, n_layer: int) -> str:
    """How many layer units (bank.py) the layerwise students still train: each (loss, layer,
    M, seed) once, whichever students share it."""
    known = sum(row.units for row in rows if row.units is not None)
    unknown = sum(row.units is None for row in rows)
    said = f"layer units to train: {known}"
    if unknown:
        said += f"; up to {n_layer} more for each of {unknown} whose dims DoF or the curves give"
    return said


def missing_listing(weights: list, absent: list, root, header: str) -> str:
    """One message for everything a run still lacks: each missing file's URL and destination,
    the weights [(url, path)] and the data store's rows `absent`."""
    lines = [header]
    if weights:
        lines.append(f"  weights, {len(weights)} file(s):")
        lines.append(by_hand(((url, path.resolve()) for url, path in weights), 4).lstrip("\n"))
    if absent:
        lines.append(f"  data, {len(absent)} file(s), {data.size_mb(absent)}:")
        lines.append(data.offline_listing(absent, root, 4).lstrip("\n"))
    return "\n".join(lines)


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
    # one listing a data store, replaced on each attempt: attempts leave no trail of them
    store = hashlib.sha256(str(cfg.data.resolve()).encode()).hexdigest()[:12]
    listing = Path(tempfile.gettempdir()) / f"dofmini-missing-{store}.txt"
    write_text(listing, missing_listing(weights, absent, cfg.data, header) + "\n")
    lines.append(f"Each file's URL and destination are in {listing}.")
    lines.append(
        "Fix: download each file to its destination (a Wikipedia file as served: it is converted "
        "on the next run), or point DOFMINI_WEIGHTS, --data or DOFMINI_DATA_MIRROR at copies "
        "that hold them; or run again once those hosts answer."
    )
    flags.fail("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
