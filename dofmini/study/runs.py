"""What a long run needs besides the method: stages saved with their key (the settings and inputs
that made them; reused only on an exact match, else a line names what changed), token caches,
resumable trainings, and the record of what made the results (the run as a process, its lock,
signals and one-line errors: guard.py). Every file goes through files.atomic_write, so a kill
leaves a stage either whole or absent."""

import dataclasses
import hashlib
import io
import json
import platform
import re
import subprocess
from pathlib import Path

import numpy as np
import torch

from .. import __version__
from ..checkpoint import CheckpointError
from ..files import as_json, atomic_write, by_hand, changed_settings, sha256_file, write_text
from ..students import save_student
from ..tensor_files import read_tensors, save_tensors
from . import data, devices


class RunError(Exception):
    """A setting that proves impossible once the model and the data are seen."""


def log(message: str):
    """All progress goes to one stream, stdout."""
    print(message, flush=True)


def _stored(path: Path) -> dict:
    """Our record at `path`; {} when absent or damaged (cut short, not JSON, not a record)."""
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return {}
    return stored if isinstance(stored, dict) else {}


def _why_redo(path: Path, old, key: dict) -> str:
    if old is None:
        return f"redo: {path}: damaged or of an older version (no record of its settings)"
    return f"redo: {path}: {changed_settings(old, as_json(key))} changed"


def saved(path: Path, key: dict, valid=None):
    """The result a stage saved at `path`, if it was made with `key` and, given `valid`, if
    valid(result) holds (it has the shape the stage writes); else None."""
    stored = _stored(path)
    result = stored.get("result") if stored.get("key") == as_json(key) else None
    return None if result is None or valid and not valid(result) else result


def stage(path: Path, key: dict, compute, split: bool = False, valid=None):
    """compute() unless `path` holds a result made with the same `key` (settings and inputs), one
    valid(result) accepts when given; under torchrun by every rank if `split` (sharing its work),
    else by the writer (the rest read it)."""
    if not split:
        return devices.writer_first(lambda: stage(path, key, compute, True, valid))
    if (result := saved(path, key, valid)) is not None:
        log(f"skip: {path} done")
        return result
    if saved(path, key) is not None:
        log(f"redo: {path}: its result is not of the shape this stage writes")
    elif path.exists():
        log(_why_redo(path, _stored(path).get("key"), key))
    result = compute()
    write_text(path, json.dumps({"key": as_json(key), "result": result}, indent=1, sort_keys=True))
    return result


def token_ids(path: Path, key: dict, texts, tokenizer, max_chars, keep=True) -> torch.Tensor:
    """Token ids of text files, encoded once and cached as .npy (no pickle) beside a key file that
    also holds the cache's sha256, so a cache replaced or damaged since is encoded again; `keep`
    False (a plan) reads a cache but writes none."""
    key_path = path.with_suffix(".json")
    stored = _stored(key_path)
    if stored.get("key") == as_json(key) and path.is_file():
        if sha256_file(path) == stored.get("sha256"):
            return torch.from_numpy(np.load(path))
        log(f"redo: {path}: its bytes are not those its record names")
    elif key_path.exists() or path.exists():
        log(_why_redo(path, stored.get("key"), key))
    text = "".join(Path(f).read_text(encoding="utf-8") for f in texts)[:max_chars]
    ids = np.array(tokenizer.encode(text).ids, dtype=np.int64)
    npy = io.BytesIO()
    np.save(npy, ids)  # to bytes: given a file name, np.save would append ".npy"
    if keep:
        atomic_write(path, lambda tmp: tmp.write_bytes(npy.getvalue()))
        write_text(key_path, json.dumps({"key": as_json(key), "sha256": sha256_file(path)}))
    return torch.from_numpy(ids)


def training_record(settings) -> dict:
    """The training settings a result depends on: all but how often it logs."""
    fields = dataclasses.asdict(settings)
    return {k: v for k, v in fields.items() if k != "log_every"}


def train_into(path, record, settings, token_ids, train, log, save_every=50, save=save_student):
    """The record {"train_seconds", "loss_curve"} of train(log=, resume=, on_step=) -> (model,
    record) (distill, distill_layer or train_direct, partly applied). Its progress goes to
    `<path>.progress` every save_every steps, and one of the same record, settings and tokens
    resumes from it exactly (tensors, Adam, the data order, the loss curve; its seconds add up);
    the model goes to `path` once, at the end, by save(model, path, {**record, "info": that})."""
    tokens = hashlib.sha256(torch.as_tensor(token_ids).long().cpu().numpy().tobytes()).hexdigest()
    keep = as_json({**record, **training_record(settings), "tokens": tokens[:16]})
    progress = Path(f"{path}.progress")

    def save_progress(state):  # every save_every steps but the last
        if state.step == 1:
            device = next(iter(state.params.values())).device
            log(f"peak memory after the first step: {peak_memory(device)} (each rank)")
        if state.step % save_every == 0 and state.step < settings.steps:
            tensors = {f"param.{n}": p for n, p in state.params.items()}
            tensors["rng"] = state.gen.get_state()
            for index, adam in state.opt.state_dict()["state"].items():
                tensors |= {f"adam.{index}.{key}": t for key, t in adam.items()}
            meta = dict(settings=keep, step=state.step, seconds=state.seconds)
            save_tensors(tensors, progress, {**meta, "loss_curve": state.curve})

    resume = lambda state: progress.exists() and _resume(progress, keep, state, log, settings.steps)
    model, info = train(log=log, resume=resume, on_step=save_progress)
    save(model, path, {**record, "info": info})
    progress.unlink(missing_ok=True)
    return info


def peak_memory(device) -> str:
    """This process's peak so far on `device`: CUDA's allocator's, else the peak resident set
    (Linux's VmHWM)."""
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB allocated on {device}"
    status = Path("/proc/self/status")
    found = re.search(r"VmHWM:\s+(\d+) kB", status.read_text()) if status.exists() else None
    return f"{int(found[1]) / 2**20:.2f} GiB resident" if found else "not readable on this system"


def _resume(path: Path, keep: dict, state, log, steps: int):
    """Restore `state` from a progress file of the settings `keep`; one of other settings, or that
    cannot be read, is named and set aside."""
    try:
        stored, meta = read_tensors(path)
        changed = changed_settings(meta.get("settings", {}), keep)
        why = changed and f"progress of other settings ({changed} changed)"
    except CheckpointError as err:  # a damaged file costs its steps, not the run
        why = f"unreadable ({err})"
    if why:
        log(f"{path}: {why}; starting over")
        return path.unlink()
    with torch.no_grad():
        for n, p in state.params.items():
            p.copy_(stored[f"param.{n}"])
    adam = state.opt.state_dict()  # its "state" empty: no step is taken before a resume
    for name, t in stored.items():
        if name.startswith("adam."):  # adam.{index}.{exp_avg, exp_avg_sq, step}
            _, index, key = name.split(".")
            adam["state"].setdefault(int(index), {})[key] = t
    state.opt.load_state_dict(adam)
    state.gen.set_state(stored["rng"])
    state.step, state.seconds = int(meta["step"]), float(meta["seconds"])
    state.curve = meta["loss_curve"]
    log(f"resuming from {path} at step {state.step}/{steps}")


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
