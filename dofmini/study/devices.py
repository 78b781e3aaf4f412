"""How a run uses its devices: data-parallel ranks under `torchrun` (without it, no-ops), and the
teacher's precision. Rank 0 alone writes (files.WRITES is off on the rest), logs (their stdout is
discarded) and holds the --out lock. Training shares each step's parts (shared: the same
student for any N), evaluation each batch's windows, summed; any other stage the writer
computes while the rest wait, then read its file (runs.stage): it must not outlast TIMEOUT."""

import dataclasses
import datetime
import hashlib
import json
import os
import platform
import secrets
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .. import __version__, files, hub
from . import data

TIMEOUT = datetime.timedelta(hours=1)
RENDEZVOUS = datetime.timedelta(minutes=5)  # the wait for every rank to join the group
TORCHRUN_SETTINGS = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # beside WORLD_SIZE


class RankError(RuntimeError):
    """Ranks that would not run the same computation: they would mix data or wait forever."""


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_writer() -> bool:
    return rank() == 0


def start():
    """Join torchrun's group: gloo for CPU tensors, NCCL for CUDA ("cuda" is cuda:LOCAL_RANK). The
    wait for the other ranks is said and bounded (RENDEZVOUS); a failure, or a WORLD_SIZE without
    torchrun's other settings, is one line."""
    size = os.environ.get("WORLD_SIZE", "1")
    if size == "1" or dist.is_initialized():
        return
    absent = [name for name in TORCHRUN_SETTINGS if name not in os.environ]
    if absent or not size.isdigit():
        _exit(f"WORLD_SIZE={size} without {', '.join(absent) or 'a number'}: run under torchrun, "
              "which sets them, or unset WORLD_SIZE")  # fmt: skip
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    rank = f"rank {os.environ['RANK']} of {size}"
    print(f"{rank}: waiting for {size} ranks at {where} (at most {RENDEZVOUS})", flush=True)
    cuda = torch.cuda.is_available()
    try:
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", timeout=RENDEZVOUS)
    except (RuntimeError, ValueError, KeyboardInterrupt) as err:  # DistError is a RuntimeError
        _exit(f"{rank}: no group of {size} ranks at {where} ({str(err).splitlines()[0]})")
    dist.distributed_c10d._set_pg_timeout(TIMEOUT)  # joined: the stages' own bound from here on
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not is_writer():
        files.WRITES = False
        sys.stdout = open(os.devnull, "w")  # for the life of the process


def _exit(message: str):
    """Stop with one line, as the command's other errors (no handler is set up this early)."""
    raise SystemExit(f"{Path(sys.argv[0]).name}: error: {message}")


def agree(cfg) -> None:
    """Under torchrun, stop every rank with one line naming what differs unless all run the same
    settings (cfg, a RunConfig, but for the paths --out and --data), data registry rows and
    weights, into the same --out: one all-gather of their digests. --out's identity is a nonce the
    writer puts there (a plan, which writes nothing, has none)."""
    if world() == 1:
        return
    nonce, folder = cfg.out / ".ranks", hub.locate(cfg.model)
    if is_writer() and not cfg.plan_only:
        files.write_text(nonce, secrets.token_hex(16))
    barrier()
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("out", "data")}
    weights = (folder / "model.safetensors").is_file() and hub.fingerprint(folder)
    parts = {
        "settings": json.dumps(settings, sort_keys=True, default=str),
        "data registry": repr(sorted(data.registry())),  # in any order, as the run reads it
        "weights": weights or "not downloaded yet",
        "--out": "a plan" if cfg.plan_only else nonce.is_file() and nonce.read_text(),
    }
    digests = [hashlib.sha256(str(v).encode()).digest() for v in parts.values()]
    mine = torch.tensor([list(d) for d in digests], dtype=torch.int64)  # [parts, 32]
    every = [torch.empty_like(mine) for _ in range(world())]
    dist.all_gather(every, mine)
    if is_writer():
        nonce.unlink(missing_ok=True)
    differ = [(r, name) for r, t in enumerate(every) for name, row in zip(parts, t != every[0])
              if row.any()]  # fmt: skip
    if differ:
        named = ", ".join(f"rank {r}'s {name}" for r, name in differ)
        raise RankError(
            f"the ranks disagree: {named} not rank 0's; every rank must run the same command on "
            "the same weights and data registry, into the same (shared) --out"
        )


def share(items):
    """This rank's share of a list or of a tensor's rows: every world()-th, from rank()."""
    return items[rank() :: world()]


def all_sum(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` summed over the ranks, in place."""
    if world() > 1:
        dist.all_reduce(tensor)
    return tensor


def barrier():  # a CPU all-reduce: gloo's timeout holds in an NCCL run too
    all_sum(torch.zeros(1))


def writer_first(compute):
    """compute() on the writer, then on the others (who find what it downloaded or saved)."""
    result = compute() if is_writer() else None
    barrier()
    return result if is_writer() else compute()


def teacher_precision(teacher, precision: str) -> str:
    """The teacher's own forward passes (not its students', which copy its hooks) in bfloat16
    autocast for "bf16" (not TF32: it would reach the students' float32); the key's suffix."""
    if precision == "fp32":
        return ""
    kind = next(teacher.parameters()).device.type

    def switch(module, *args):  # on before a forward (module, input), off after (…, output)
        if module is teacher:
            torch.set_autocast_enabled(kind, len(args) == 1)

    torch.set_autocast_dtype(kind, torch.bfloat16)
    teacher.register_forward_pre_hook(switch)
    teacher.register_forward_hook(switch, always_call=True)
    return f"+{precision}"


def flat_grad_part(backward, ids, part_ids, params: list) -> tuple:
    """(per-layer losses [L] float64, all params' gradients [n]) of the part `part_ids` of the
    batch `ids`, each weighted by its share of the batch; the params' grads cleared."""
    weight = len(part_ids) / len(ids)
    losses = torch.tensor(backward(part_ids), dtype=torch.float64)  # [L]
    row = torch.cat([p.grad.flatten() for p in params]) * weight  # [n]
    for p in params:
        p.grad = None
    return weight * losses, row


def set_grads(params: list, total: torch.Tensor):
    """Each param's .grad from its slice of the flat gradient `total` [n]."""
    for p, grad in zip(params, total.split([p.numel() for p in params])):
        p.grad = grad.view_as(p)


def in_parts(backward, params: list, part: int):
    """step(ids) -> per-layer losses of the batch ids [B, ctx], back-propagated `part` windows at
    a time (a device's memory): each part's gradients weighted by its share of the batch and
    added in part order, as `shared` adds them over ranks, to the same bits."""

    def step(ids):
        total = params[0].new_zeros(sum(p.numel() for p in params))  # [n]
        losses = 0.0
        for part_ids in ids.split(part):
            weighted, row = flat_grad_part(backward, ids, part_ids, params)
            losses = losses + weighted
            total += row
        set_grads(params, total)
        return losses.tolist()

    return step


def shared(backward, params: list, part: int):
    """distill.fit's `share`: in_parts over torchrun's ranks. Rank r takes parts r, r + world, …
    of `part` windows (each rank at least one), and each round's weighted gradients are gathered
    and added in part order: any number of ranks gives the one-process student bit for bit."""
    if world() == 1:
        return in_parts(backward, params, part)

    def step(ids):
        parts = ids.split(part)  # each [b, ctx]
        if len(parts) < world():
            raise ValueError(f"shared: {world()} ranks share {len(parts)} parts of {part} windows")
        size = sum(p.numel() for p in params)
        total = params[0].new_zeros(size)  # [n]
        losses = 0.0
        for first in range(0, len(parts), world()):
            rows = [torch.zeros_like(total) for _ in range(world())]  # the round's, [n] each
            if first + rank() < len(parts):
                weighted, rows[rank()] = flat_grad_part(
                    backward, ids, parts[first + rank()], params
                )
                losses = losses + weighted
            dist.all_gather(rows, rows[rank()])
            for row in rows[: len(parts) - first]:  # in part order
                total += row
        dist.all_reduce(losses)
        set_grads(params, total)
        return losses.tolist()

    return step


def device_name(model) -> str:
    """Where and in what dtype a model runs, for the stage keys: "cpu/float32", "cuda/float32"."""
    p = next(model.parameters())
    return f"{p.device.type}/{str(p.dtype).removeprefix('torch.')}"


def provenance(model) -> dict:
    """What made the results: versions, the git commit of a checkout, threads, the device."""

    def git(*args) -> str:  # "" outside a checkout or without git
        try:
            command, repo = ["git", *args], Path(__file__).resolve().parents[2]
            done = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    device, gpu = next(model.parameters()).device, None
    if device.type == "cuda":
        try:
            gpu = torch.cuda.get_device_name(device)
        except (RuntimeError, AssertionError) as err:  # a simulated device has no name
            gpu = f"unknown ({err})"
    found = dict(dofmini=__version__, git_commit=git("rev-parse", "HEAD") or None)
    found["git_dirty"] = bool(git("status", "--porcelain", "dofmini", "reproduce.py"))
    found.update(python=platform.python_version(), torch=torch.__version__, numpy=np.__version__)
    found.update(threads=torch.get_num_threads(), device=device_name(model), gpu=gpu)
    return dict(found, cuda=torch.version.cuda if gpu else None)
