"""reproduce.py's command line, made from RunConfig's fields: each field declared with `option`
is a flag, its help and default written once beside the field (--help adds each profile's own),
and every value is checked before any model or data work, a bad one refused in one line (fail)
that names the flag and the value."""

import argparse
import dataclasses
import math
import os
from dataclasses import field
from functools import partial
from pathlib import Path

import torch

from .. import hub
from . import data, devices, guard, task_train
from .compute import ORACLES
from .finetune import parse_lr
from .run import ALLOCATIONS

VARIANTS = ("performer", "dijiang", "fix", *ALLOCATIONS, *ORACLES)
LOSSES = ("softmax", "l2", "direct")
SEED_LIMIT = 2**31 - 1  # seeds are offset by the layer index and must stay within torch's range
MAX_FEATURES = 4096  # per layer: far above any head size, below what memory can hold
ENVIRONMENT = """environment:
  DOFMINI_DATA=DIR         the data store (else $XDG_CACHE_HOME/dofmini/data, ~/.cache/...)
  DOFMINI_DATA_MIRROR=URL  fetch every data file from URL/<path in the store> instead
  DOFMINI_WEIGHTS=DIR      where named models are downloaded (else weights/ in the checkout)"""


def option(default, help: str, **how):
    """A RunConfig field that is a flag: its default, its help (the defaults are added: "default
    X; quick Y"), and how: `flag` (default --field-name), `type` (a converter; list converters
    refuse '' in one line), `none` (what a None default means), `choices`."""
    return field(default=default, metadata=dict(how, help=help))


def parse(argv, config, profiles: dict, description: str) -> dict:
    """{RunConfig field: value} of the flags given, one flag a field with `option` metadata: a
    flag left out is absent (argparse.SUPPRESS), so it never undoes what the profile sets. No
    flag may be abbreviated (--s is not --seeds)."""
    fields = [f for f in dataclasses.fields(config) if "help" in f.metadata]
    defaults = {f.name: f.default for f in fields}
    p = argparse.ArgumentParser(
        description=description,
        epilog=ENVIRONMENT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
    )
    for f in fields:
        how = dict(f.metadata)
        said = default(defaults, profiles, f.name, how.pop("none", ""))
        help_text = how.pop("help")
        if f.name == "model":
            p.add_argument("model", help=help_text)
            continue
        how.pop("flag", None)
        flag = flag_name(f)
        if f.default is False:
            p.add_argument(flag, dest=f.name, action="store_true", help=f"{help_text}; default off")
            continue
        convert = how.pop("type", str)
        if convert not in (int, float, str):
            convert = partial(_arg, flag, convert)
        if f.name == "profile":  # every other flag's default comes from it
            p.add_argument(flag, choices=profiles, default=f.default, help=help_text)
            continue
        p.add_argument(flag, dest=f.name, type=convert, help=f"{help_text}; {said}", **how)
    return vars(p.parse_args(argv))


def default(fields: dict, profiles: dict, name: str, none: str = "") -> str:
    """ "default X" of RunConfig's field `name`, then each profile's own: "quick Y"."""
    own = [f"{p} {shown(v[name], none)}" for p, v in profiles.items() if name in v]
    return "; ".join([f"default {shown(fields[name], none)}", *own])


def shown(value, none: str = "") -> str:
    """A field's value as its flag takes it: a tuple comma-separated; None or () as `none`."""
    if value is None or value == ():
        return none
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def fail(message: str):
    """Stop with reproduce.py's one-line error (naming the rank under torchrun)."""
    rank = f"rank {devices.rank()} of {devices.world()}: " if devices.world() > 1 else ""
    raise SystemExit(f"reproduce.py: error: {rank}{message}")


def _arg(flag: str, convert, text: str):
    """`flag`'s argument `text` converted (argparse's type, partly applied); '' (no value) and
    integers that do not parse refused in one line."""
    if text == "":
        fail(f"{flag} '': expected {'a folder' if flag == '--out' else 'a value'}, or no flag")
    try:
        return convert(text)
    except ValueError:
        fail(f"{flag} {text!r}: expected comma-separated integers")


def ints(text: str) -> tuple:
    return tuple(int(x) for x in text.split(","))


def names(text: str) -> tuple:
    return tuple(text.split(","))


def rates(text: str) -> tuple:
    try:
        return parse_lr(text)
    except ValueError as err:
        fail(f"--finetune-lr {err}")


def variants(text: str) -> tuple:
    return () if text == "none" else names(text)


def check(cfg, given=()):
    """Every value checked before any model or data work; one line naming the flag and the value.
    A flag `given` whose value the run will not use is a warning line (unused)."""
    for kind, values, known in (("variant", cfg.variants, VARIANTS), ("loss", cfg.losses, LOSSES)):
        if unknown := [value for value in values if value not in known]:
            fail(f"unknown {kind} {unknown[0]!r}; choose from {', '.join(known)}")
    if cfg.lam is not None and not (cfg.lam > 0 and math.isfinite(cfg.lam)):
        fail(f"--lam {cfg.lam}: expected a positive finite number")
    if cfg.limit is not None and cfg.limit < 0:
        fail(f"--limit {cfg.limit}: expected 0 (no tasks) or more")
    for flag, why in unused(cfg, given):  # warnings: `paper` gives Table 8's PIQA rate
        print(f"reproduce.py: warning: {flag}: {why}, so not used", flush=True)
    if (cfg.finetune or cfg.finetune_lr) and (cfg.limit == 0 or devices.world() > 1):
        fail("--finetune scores tasks in one process: not with --limit 0 or under torchrun")
    if cfg.finetune_select < 1:  # the rate and the epoch are never chosen on what is reported
        fail(f"--finetune-select {cfg.finetune_select}: expected 1 or more training examples")
    if cfg.heldout_skip < 0:
        fail(f"--heldout-skip {cfg.heldout_skip}: expected 0 or more windows")
    if cfg.J < 2:
        fail(f"--J {cfg.J}: expected 2 or more samples per head")
    if cfg.per_device is not None and cfg.per_device < 1:
        fail(f"--batch-per-device {cfg.per_device}: expected 1 or more windows")
    part = cfg.per_device or max(1, cfg.batch // 4)  # 1, 2 or 4 devices share its parts evenly
    if -(-cfg.batch // part) < devices.world():
        why = f"the profile's {cfg.batch} windows a step, back-propagated {part} at a time"
        fail(f"{devices.world()} ranks: expected at most one for each part ({why})")
    for seed in cfg.seeds:
        if not 0 <= seed <= SEED_LIMIT - 1000:
            fail(f"--seeds {seed}: expected 0..{SEED_LIMIT - 1000}")
    listed = {"--variants": cfg.variants, "--loss": cfg.losses, "--seeds": cfg.seeds}
    listed["--curve-dims"] = cfg.curve_dims
    for flag, values in listed.items():
        if len(set(values)) != len(values):
            fail(f"{flag} {','.join(map(str, values))}: a value appears twice")
    counted = {"--budgets": cfg.budgets or (), "--curve-dims": cfg.curve_dims}
    for flag, counts in counted.items():
        for count in counts:
            if not 1 <= count <= MAX_FEATURES:
                fail(f"{flag} {count}: expected 1..{MAX_FEATURES} features per layer")
    curve_dims = shown(cfg.curve_dims)
    if list(cfg.curve_dims) != sorted(cfg.curve_dims):
        fail(f"--curve-dims {curve_dims}: expected increasing counts")
    if (oracle := oracle_of(cfg)) and len(cfg.curve_dims) < 2:  # its curves are read between two
        fail(f"--curve-dims {curve_dims}: {oracle} interpolates its curves; expected 2 or more")
    device = pick_device(cfg.device)
    hub.locate(cfg.model)  # its CheckpointError (an unknown name, no config.json): main's one line
    out = cfg.out or Path("runs") / f"{Path(cfg.model).name}-{cfg.profile}"
    guard.check_writable(out, "--out", fail)
    store = data.store_dir(cfg.data)
    if store.exists() and not store.is_dir():
        fail(f"--data {store} is a file; expected the data store's folder")
    tuned = cfg.finetune or bool(cfg.finetune_lr)  # rates given ask for fine-tuning
    replaced = dict(out=out, data=store, per_device=part, device=device, finetune=tuned)
    return dataclasses.replace(cfg, **replaced)


def unused(cfg, given) -> list:
    """(flag and value, why) of each flag value the run will not use: a rate for a task without
    a training split; of the flags `given`, one whose part of the run does not run."""
    rates = [task for task, _ in cfg.finetune_lr if task not in task_train.trainable_tasks()]
    found = [(f"--finetune-lr {', '.join(rates)}", "no pinned training split")] if rates else []
    trained = [v for v in cfg.variants if v not in ("performer", "dijiang")]
    fine_tuned = cfg.finetune or bool(cfg.finetune_lr)
    idle = {  # field: (its part of the run does not run, why)
        "per_device": (not trained and "dijiang" not in cfg.variants, "nothing trains"),
        "losses": (not trained, "no variant here trains with it (DiJiang trains direct)"),
        "curve_dims": (not oracle_of(cfg), "no oracle among the variants"),
        "heldout_skip": (not cfg.variants, "no student reads held-out windows"),
        "finetune_select": (not fine_tuned, "no --finetune"),
    }
    for f in dataclasses.fields(cfg):  # in the fields' order
        is_idle, why = idle.get(f.name, (False, None))
        if f.name in given and is_idle:
            found.append((f"{flag_name(f)} {shown(getattr(cfg, f.name))}", why))
    return found


def flag_name(f) -> str:
    """The flag of RunConfig's field `f`: its `flag`, else --field-name."""
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def oracle_of(cfg) -> str | None:
    """The first oracle among the variants (its dims come from the error curves), or None."""
    return next((variant for variant in cfg.variants if variant in ORACLES), None)


def pick_device(asked: str) -> str:
    """`asked` if torch sees it; auto: cuda where torch sees a CUDA device (under torchrun,
    devices.start made it the rank's own, cuda:LOCAL_RANK), else cpu."""
    cuda = torch.cuda.is_available()
    if asked == "auto":
        return "cuda" if cuda else "cpu"
    index = asked.removeprefix("cuda:")
    available = asked == "cpu" or (asked == "cuda" and cuda)
    if not available and not (index.isdigit() and int(index) < torch.cuda.device_count()):
        seen = f"torch sees {torch.cuda.device_count()} CUDA device(s)"
        expected = "expected auto, cpu, cuda, cuda:N"
        fail(f"--device {asked} is not available here ({seen}); {expected}")
    return asked


def device_line(device: str) -> str:
    """The plan's line on the device: which, and what torch sees."""
    if not torch.cuda.is_available():
        return f"device: {device} (no CUDA device seen)"
    count = torch.cuda.device_count()
    seen = f"{count} CUDA device(s)" if count else "a CUDA device"
    rank = f"; under torchrun each rank's own, here cuda:{os.environ.get('LOCAL_RANK')}"
    torchrun = rank if device == "cuda" and devices.world() > 1 else ""
    return f"device: {device} (torch sees {seen}{torchrun})"
