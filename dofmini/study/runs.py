"""What a long run needs besides the method: stages saved with the settings that made them, token
caches, the record of what made the results, a timing probe and the progress clock.

A stage is reused only when the settings and inputs it was made from (its key) match exactly;
otherwise it is recomputed and a line names what changed. Every file goes through
files.atomic_write, so a kill at any moment leaves a stage either whole or absent.
"""

import json
import platform
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from .. import __version__
from ..distill import distill, train_direct
from ..files import atomic_write, write_text
from ..students import make_student


def log(message: str):
    """All progress goes to one stream, stdout."""
    print(message, flush=True)


def saved_result(path: Path, key: dict):
    """The result a stage saved at `path`, if it was made with `key`; else None."""
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    return saved["result"] if saved.get("key") == json.loads(json.dumps(key)) else None


def stage(path: Path, key: dict, compute):
    """compute() unless `path` holds a result made with the same `key` (settings and inputs)."""
    key = json.loads(json.dumps(key))
    result = saved_result(path, key)
    if result is not None:
        log(f"skip: {path} done")
        return result
    if path.is_file():
        log(f"redo: {path}: {_changed(json.loads(path.read_text()).get('key', {}), key)} changed")
    result = compute()
    write_text(path, json.dumps({"key": key, "result": result}, indent=1, sort_keys=True))
    return result


def _changed(old: dict, new: dict) -> str:
    """The names of the settings two keys disagree on."""
    return ", ".join(sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k)))


def _save_npy(path: Path, array: np.ndarray):
    with open(path, "wb") as f:  # a file object: given a name, np.save would append ".npy"
        np.save(f, array)


def token_ids(path: Path, key: dict, texts, tokenizer, max_chars) -> torch.Tensor:
    """Token ids of text files, encoded once and cached as .npy (no pickle) beside a key file."""
    key_path = path.with_suffix(".json")
    key = json.loads(json.dumps(key))
    if path.is_file() and key_path.is_file():
        saved = json.loads(key_path.read_text())
        if saved == key:
            return torch.from_numpy(np.load(path))
        log(f"redo: {path}: {_changed(saved, key)} changed")
    text = "".join(Path(f).read_text(encoding="utf-8") for f in texts)[:max_chars]
    ids = np.array(tokenizer.encode(text).ids, dtype=np.int64)
    atomic_write(path, lambda tmp: _save_npy(tmp, ids))
    write_text(key_path, json.dumps(key, sort_keys=True))
    return torch.from_numpy(ids)


def provenance() -> dict:
    """What made the results: package and library versions, and the git commit of a checkout."""
    checkout = Path(__file__).resolve().parents[1]

    def git(*args) -> str:
        done = subprocess.run(
            ["git", *args], cwd=checkout, capture_output=True, text=True, timeout=10
        )
        return done.stdout.strip() if done.returncode == 0 else ""

    try:
        commit = git("rev-parse", "HEAD") or None
        dirty = bool(git("status", "--porcelain", "dofmini", "reproduce.py"))
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, False
    return {
        "dofmini": __version__,
        "git_commit": commit,
        "git_dirty": dirty,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "threads": torch.get_num_threads(),
    }


def probe(teacher, ctx: int, J: int) -> dict:
    """Seconds per window of ctx tokens for the operations a run repeats, each timed once after a
    warm-up on random tokens: a forward pass with logits, a distillation step of each loss and a
    direct step; and one J×J Cholesky factorisation (DoF)."""
    device = next(teacher.parameters()).device
    ids = torch.randint(0, teacher.config.vocab_size, (2, ctx), generator=torch.Generator())
    ids = ids.to(device)
    dims = [teacher.config.head_dim] * teacher.config.n_layer
    student = make_student(teacher, "prf", dims, 0)
    flat = ids.flatten().cpu()
    quiet = dict(steps=1, batch=2, ctx=ctx, log=lambda _: None)
    work = {
        "forward": lambda: teacher(ids),
        "softmax": lambda: distill(teacher, dims, flat, loss="softmax", **quiet),
        "l2": lambda: distill(teacher, dims, flat, loss="l2", **quiet),
        "direct": lambda: train_direct(student, flat, **quiet),
    }
    costs = {}
    for name, run in work.items():
        run()  # warm-up
        t0 = time.perf_counter()
        run()
        costs[name] = (time.perf_counter() - t0) / len(ids)
    t0 = time.perf_counter()
    torch.linalg.cholesky(torch.eye(J, dtype=torch.float64))
    costs["cholesky"] = time.perf_counter() - t0
    return costs


def duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.0f} min"


class Clock:
    """The run's plan, [(stage name, estimated seconds)], and a progress line per stage: which stage
    of how many, and the whole run's estimated time left. The estimates are rescaled by the pace
    so far, measured only on stages that computed something: a stage reloaded as done takes no
    time, and counting it would make a resumed run's pace look many times faster than it is."""

    def __init__(self, plan: list):
        self.plan = plan
        self.t0 = time.time()
        self.current = None
        self.begun = set()
        self.worked = {}  # stage name -> seconds spent computing its results

    def timed(self, compute):
        """`compute`, with its seconds counted toward the current stage's pace."""

        def run():
            t0 = time.time()
            result = compute()
            self.worked[self.current] = self.worked.get(self.current, 0.0) + time.time() - t0
            return result

        return run

    def begin(self, name: str):
        if name in self.begun:  # a curve student evaluated again later is part of its stage
            return
        self.begun.add(name)
        self.current = name
        estimates = dict(self.plan)
        names = list(estimates)
        index = names.index(name)
        measured = sum(estimates[n] for n in self.worked if n != name)
        spent = sum(s for n, s in self.worked.items() if n != name)
        pace = spent / measured if measured > 30 else 1.0
        left = pace * sum(s for _, s in self.plan[index:])
        log(
            f"[{index + 1}/{len(names)}] {name} (~{duration(estimates[name] * pace)}; "
            f"run ~{duration(left)} left)"
        )
