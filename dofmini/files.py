"""File helpers every stage shares: whole-or-nothing writes, content hashes, and a quick check that
the hosts a download needs take a connection."""

import contextlib
import hashlib
import json
import os
import socket
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

from safetensors import SafetensorError

CONNECT_SECONDS = 4.0  # all hosts are tried at once, so an offline machine hears back within this
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
        why, number = getattr(err, "strerror", None) or err, getattr(err, "errno", None)
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


def _endpoint(url: str):
    """(host, port) a fetch of `url` connects to, its proxy's if it has one; None for a file."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return None
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(parts.hostname):
        parts = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    default_port = 443 if parts.scheme == "https" else 80
    return parts.hostname, parts.port or default_port


def unreachable(urls) -> list:
    """The "host:port" of each endpoint of `urls` taking no TCP connection within CONNECT_SECONDS;
    daemon threads try all at once, so a hanging name lookup holds neither caller nor exit."""
    endpoints = {_endpoint(url) for url in urls} - {None}
    reached = set()

    def connect(endpoint):
        with contextlib.suppress(OSError):
            socket.create_connection(endpoint, timeout=CONNECT_SECONDS).close()
            reached.add(endpoint)

    threads = [threading.Thread(target=connect, args=(e,), daemon=True) for e in endpoints]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + CONNECT_SECONDS
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return sorted(f"{host}:{port}" for host, port in endpoints - set(reached))


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
