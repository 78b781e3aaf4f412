"""File helpers every stage shares: whole-or-nothing writes, content hashes, and the listing of
what to fetch by hand."""

import contextlib
import hashlib
import json
import os
from pathlib import Path

from safetensors import SafetensorError

WRITES = True  # off on every rank of a torchrun but the writer (study.devices), which writes alone


def cache_dir() -> Path:
    """dofmini's folder under the user cache ($XDG_CACHE_HOME, else ~/.cache)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "dofmini"


def atomic_write(path, write) -> Path:
    """Create or replace `path` whole or not at all: `write(tmp)` fills `.NAME.PID.tmp` beside it,
    renamed over it once done, so a kill leaves the old file (or none), never a truncated one. An
    OSError (a full disk, a read-only folder) comes back naming `path`."""
    path = Path(path)
    if not WRITES:
        return path
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
    except (OSError, SafetensorError) as err:  # safetensors wraps a full disk's error in its own
        why = getattr(err, "strerror", None) or err
        number = getattr(err, "errno", None)
        raise OSError(number, f"cannot write {path}: {why}", str(path)) from None
    finally:
        with contextlib.suppress(OSError):  # in a read-only folder even this fails
            tmp.unlink(missing_ok=True)
    return path


def write_text(path, text: str) -> Path:
    """atomic_write for a UTF-8 text file."""
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def sha256_file(path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes, read in chunks of 4 MiB (about a second per 500 MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def by_hand(pairs, indent: int = 2) -> str:
    """What to fetch by hand and where it goes: a line with the URL, then "-> path", per pair."""
    pad = " " * indent
    return "".join(f"\n{pad}{url}\n{pad}  -> {path}" for url, path in pairs)


def as_json(value):
    """`value` as JSON gives it back (tuples become lists): how a saved key or setting compares."""
    return json.loads(json.dumps(value))


def changed_settings(old: dict, new: dict) -> str:
    """The keys whose values differ (or that one dict lacks), sorted, comma-joined; "" if none."""
    absent = object()
    differ = [k for k in old.keys() | new.keys() if old.get(k, absent) != new.get(k, absent)]
    return ", ".join(sorted(differ))
