"""File helpers every stage shares: whole-or-nothing writes and content hashes."""

import hashlib
import os
from pathlib import Path


def cache_dir() -> Path:
    """dofmini's folder under the user cache ($XDG_CACHE_HOME, else ~/.cache)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "dofmini"


def atomic_write(path, write) -> Path:
    """Create or replace `path` whole or not at all.

    `write(tmp)` fills a temporary file beside `path`, which then replaces it in one rename: a kill
    at any moment leaves the old file (or none), never a truncated one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
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


def changed_settings(old: dict, new: dict) -> str:
    """The names of the keys whose values differ between two settings dicts (a key missing from
    one counts as differing), sorted and comma-joined; "" when they agree."""
    differ = [
        k for k in old.keys() | new.keys() if k not in old or k not in new or old[k] != new[k]
    ]
    return ", ".join(sorted(differ))
