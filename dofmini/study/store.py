"""The run's store: every result saved under --out with its key (the settings and inputs that made
it), reused only on an exact match, else a line names what changed. One "saved under this key?"
serves JSON results and safetensors files (a student, a layer unit) alike; one progress format
serves every resumable training (layerwise, direct, fine-tuning); token caches follow the same
rule. Every file goes through files.atomic_write, so a kill leaves a file whole or absent."""

import dataclasses
import hashlib
import io
import json
import pickle
import re
from pathlib import Path

import numpy as np
import torch

from ..checkpoint import CheckpointError
from ..files import as_json, atomic_write, changed_settings, sha256_file, write_text
from ..students import save_student
from ..tensor_files import read_tensors
from . import devices


class RunError(Exception):
    """A setting that proves impossible once the model and the data are seen."""


def log(message: str):
    """All progress goes to one stream, stdout."""
    print(message, flush=True)


def lookup(path: Path, key: dict, valid=None) -> tuple:
    """(What `path` holds for `key`: a JSON file's result, a safetensors file's record once its
    training finished ("info"), checked by valid(result) when given; else None. Why it is made
    again: one line, or None when there is nothing there or a training to resume)."""
    if not path.is_file():
        return None, None
    tensors = path.suffix == ".safetensors"
    try:
        record = read_tensors(path, tensors=False)[1] if tensors else json.loads(path.read_text())
    except CheckpointError as err:
        return None, f"redo: {err}"
    except (OSError, ValueError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        record = None
    if not isinstance(record, dict) or "key" not in record:
        return None, f"redo: {path}: damaged or of an older version (no record of its settings)"
    if record["key"] != as_json(key):
        return None, f"redo: {path}: {changed_settings(record['key'], as_json(key))} changed"
    if not tensors and "result" not in record:
        return None, f"redo: {path}: of an older version (no result in its record)"
    result = record.get("result") if not tensors else record if "info" in record else None
    if result is not None and valid and not valid(result):
        return None, f"redo: {path}: its result is not of the shape this stage writes"
    return result, None


def saved(path: Path, key: dict, valid=None):
    """What `path` holds for `key` (lookup), or None."""
    return lookup(path, key, valid)[0]


def load_or_compute(path: Path, key: dict, compute, split: bool = False, valid=None):
    """saved(path, key, valid), else compute() saved there: a JSON result is written with its key;
    a safetensors file compute() writes itself, with the key in its record. Under torchrun every
    rank computes if `split` (sharing the work), else the writer alone (the rest read it)."""
    if not split:
        return devices.writer_first(lambda: load_or_compute(path, key, compute, True, valid))
    result, why = lookup(path, key, valid)
    if result is not None:
        log(f"skip: {path} done")
        return result
    if why:
        log(why)
    result = compute()
    if path.suffix == ".safetensors":
        devices.barrier()  # the writer has saved it
        return saved(path, key)
    write_text(path, json.dumps({"key": as_json(key), "result": result}, indent=1, sort_keys=True))
    return result


def token_ids(path: Path, key: dict, texts, tokenizer, max_chars, keep=True) -> torch.Tensor:
    """Token ids of text files, encoded once and cached as .npy (no pickle) beside a record that
    holds the key and the cache's sha256, so a cache replaced or damaged since is encoded again;
    `keep` False (a plan) reads a cache but writes none."""
    record = path.with_suffix(".json")
    sha256, why = lookup(record, key)
    if sha256 is not None and path.is_file() and sha256_file(path) == sha256:
        return torch.from_numpy(np.load(path))
    if record.exists():
        log(why or f"redo: {path}: its bytes are not those its record names")
    text = "".join(Path(f).read_text(encoding="utf-8") for f in texts)[:max_chars]
    ids = np.array(tokenizer.encode(text).ids, dtype=np.int64)
    npy = io.BytesIO()
    np.save(npy, ids)  # to bytes: given a file name, np.save would append ".npy"
    if keep:
        atomic_write(path, lambda tmp: tmp.write_bytes(npy.getvalue()))
        made = {"key": as_json(key), "result": sha256_file(path)}
        write_text(record, json.dumps(made))
    return torch.from_numpy(ids)


def training_record(settings) -> dict:
    """The training settings a result depends on: all but how often it logs."""
    fields = dataclasses.asdict(settings)
    return {k: v for k, v in fields.items() if k != "log_every"}


def save_progress(path: Path, meta: dict, params: dict, opt, gen=None):
    """A training's progress: `meta` (its settings under "settings", the step, the seconds, the
    curves), its tensors, its optimiser and its data order's generator, by torch.save."""
    state = dict(meta=meta, params={n: p.detach().cpu() for n, p in params.items()})
    state.update(opt=opt.state_dict(), rng=None if gen is None else gen.get_state())
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def load_progress(path: Path, settings: dict, params: dict, opt, log, gen=None) -> dict | None:
    """The meta of save_progress's file at `path`, its tensors, optimiser and generator restored
    (read with weights_only: nothing is unpickled but tensors and plain values); None when there
    is none. One of other `settings`, or that cannot be read, is named and set aside."""
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        changed = changed_settings(state["meta"].get("settings", {}), settings)
        why = changed and f"progress of other settings ({changed} changed)"
    except (RuntimeError, OSError, EOFError, KeyError, TypeError, pickle.UnpicklingError) as err:
        why = f"unreadable (cannot read {path}: {type(err).__name__}: {err})"
    if why:
        log(f"{path}: {why}; starting over")
        return path.unlink()
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(state["params"][n])
    opt.load_state_dict(state["opt"])
    if gen is not None:
        gen.set_state(state["rng"])
    return state["meta"]


def train_into(path, record, settings, token_ids, train, log, save_every=50, save=save_student):
    """The record {"train_seconds", "loss_curve"} of train(log=, resume=, on_step=) -> (model,
    record) (distill, distill_layers or train_direct, partly applied). Its progress goes to
    `<path>.progress` every save_every steps, and one of the same record, settings and tokens
    resumes from it exactly (tensors, Adam, the data order, the loss curve; its seconds add up);
    the model goes to `path` once, at the end, by save(model, path, {**record, "info": that})."""
    tokens = hashlib.sha256(torch.as_tensor(token_ids).long().cpu().numpy().tobytes()).hexdigest()
    keep = as_json({**record, **training_record(settings), "tokens": tokens[:16]})
    progress = Path(f"{path}.progress")

    def save_progress_of(state):  # every save_every steps but the last
        if state.step == 1:
            device = next(iter(state.params.values())).device
            log(f"peak memory after the first step: {peak_memory(device)} (each rank)")
        if state.step % save_every == 0 and state.step < settings.steps:
            meta = dict(settings=keep, step=state.step, seconds=state.seconds)
            save_progress(progress, {**meta, "loss_curve": state.curve}, state.params, state.opt,
                          state.gen)  # fmt: skip

    def resume(state) -> bool:
        meta = load_progress(progress, keep, state.params, state.opt, log, state.gen)
        if meta is None:
            return False
        state.step, state.seconds, state.curve = meta["step"], meta["seconds"], meta["loss_curve"]
        log(f"resuming from {progress} at step {state.step}/{settings.steps}")
        return True

    model, info = train(log=log, resume=resume, on_step=save_progress_of)
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
