"""The data store: every file the pipeline reads, pinned, and the download that fills the store.

`data_files.tsv` lists each file: group, path in the store, size, sha256 and public source; a file
counts only with exactly those bytes. The store is `--data DIR`, else $DOFMINI_DATA, else
$XDG_CACHE_HOME/dofmini/data (~/.cache/dofmini/data). $DOFMINI_DATA_MIRROR=URL replaces every source
by URL/<path in the store> (http://, https:// or file://). The Wikipedia sources are WikiExtractor
output (`<doc>` records); the store keeps the articles `data_articles.txt` names, as plain text.
"""

import http.client
import os
import re
import socket
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import NamedTuple

from tqdm import tqdm

from ..files import atomic_write, cache_dir, sha256_file

# group: (dataset, licence); the task groups are the names of tasks.TASKS
GROUPS = {
    "wikitext2": ("WikiText-2 (raw), validation and test", "CC BY-SA 3.0"),
    "corpus": ("English Wikipedia (2015 dump) text: distillation corpus", "CC BY-SA 3.0 + GFDL"),
    "heldout": ("English Wikipedia (2015 dump) text, never trained on", "CC BY-SA 3.0 + GFDL"),
    "piqa": ("PIQA validation", "AFL-3.0"),
    "arc_easy": ("ARC-Easy test", "CC BY-SA 4.0"),
    "arc_challenge": ("ARC-Challenge test", "CC BY-SA 4.0"),
    "winogrande": ("Winogrande 1.1 dev", "CC BY"),
    "wsc273": ("Winograd Schema Challenge collection (WSC273: the first 273)", "CC BY 4.0"),
    "mmlu": ("MMLU test, 57 subjects", "MIT"),
    "logiqa": ("LogiQA (English) test", "none stated by its authors; research use"),
    "lambada": ("LAMBADA, OpenAI's detokenised test", "CC BY 4.0"),
}
WIKIEXTRACTOR_GROUPS = ("corpus", "heldout")
CONNECT_SECONDS = 4.0  # all hosts are tried at once, so an offline machine hears back within this


class DataError(RuntimeError):
    """A data file that differs from its pin, or that is missing and cannot be downloaded."""


class DataFile(NamedTuple):
    group: str
    path: str  # in the store, "/"-separated
    size: int
    sha256: str
    url: str  # the public source


def _package_lines(name: str) -> list:
    text = Path(__file__).with_name(name).read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line and not line.startswith("#")]


FILES = tuple(
    DataFile(group, path, int(size), sha256, url)
    for group, path, size, sha256, url in (
        line.split("\t") for line in _package_lines("data_files.tsv")[1:]
    )
)


def _articles(lines: list) -> dict:
    """{store path: titles of its articles, in order}: a path line, then its titles tab-indented."""
    titles = {}
    for line in lines:
        if line.startswith("\t"):
            titles[next(reversed(titles))].append(line[1:])
        else:
            titles[line] = []
    return titles


ARTICLES = _articles(_package_lines("data_articles.txt"))


def store_dir(arg=None) -> Path:
    """`arg` (the --data flag), else $DOFMINI_DATA, else $XDG_CACHE_HOME/dofmini/data (~/.cache)."""
    if arg or os.environ.get("DOFMINI_DATA"):
        return Path(arg or os.environ["DOFMINI_DATA"]).expanduser()
    return cache_dir() / "data"


def files(groups) -> list:
    """The registry rows of `groups` (names of GROUPS, or one name)."""
    groups = [groups] if isinstance(groups, str) else list(groups)
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise DataError(f"unknown data group(s) {unknown}; known: {', '.join(GROUPS)}")
    return [f for f in FILES if f.group in groups]


def source(f: DataFile) -> str:
    """Where `f` comes from: $DOFMINI_DATA_MIRROR/<path> when that is set, else its public URL."""
    mirror = os.environ.get("DOFMINI_DATA_MIRROR")
    return f"{mirror.rstrip('/')}/{f.path}" if mirror else f.url


def missing(groups, root) -> list:
    """(path in the store, URL, size) of each file of `groups` absent from `root`."""
    return [
        (f.path, source(f), f.size) for f in files(groups) if not (Path(root) / f.path).is_file()
    ]


def describe(groups, root) -> str:
    """For a run plan: per group its dataset, files, size, licence, source and what is missing."""
    absent = {path for path, _, _ in missing(groups, root)}
    lines = [f"data store {Path(root).resolve()}:"]
    for group in dict.fromkeys(f.group for f in files(groups)):
        rows = [f for f in FILES if f.group == group]
        hosts = sorted({urllib.parse.urlsplit(source(f)).netloc or "a local folder" for f in rows})
        todo = sum(f.path in absent for f in rows)
        lines.append(
            f"  {group}: {GROUPS[group][0]}; {len(rows)} file(s), {_mb(rows)}, licence "
            f"{GROUPS[group][1]}, from {', '.join(hosts)}; {todo or 'none'} to download"
        )
    return "\n".join(lines)


def ensure(groups, root, log=None) -> dict:
    """{path in the store: sha256} of every file of `groups` under `root`, missing ones downloaded.

    Present files are checked first (size, then sha256). A missing file's host must take a TCP
    connection within CONNECT_SECONDS; else one DataError lists every missing file, its URL and
    where to put it, before any download. Each download is checked before it is kept."""
    log = log or (lambda message: print(message, flush=True))
    root = Path(root)
    needed = files(groups)
    absent = [f for f in needed if not (root / f.path).is_file()]
    for f in (f for f in needed if f not in absent):
        _verify(root / f.path, f, "delete it to download it again")
    unreachable = _unreachable([source(f) for f in absent])
    if unreachable:
        listing = "".join(f"\n  {source(f)}\n    -> {root.resolve() / f.path}" for f in absent)
        raise DataError(
            f"{len(absent)} data file(s), {_mb(absent)}, are missing and {', '.join(unreachable)} "
            f"took no connection in {CONNECT_SECONDS:.0f} s. Download each to the path shown (a "
            f"Wikipedia file as served: it is converted on the next run), or point --data or "
            f"DOFMINI_DATA_MIRROR at a copy of the store:{listing}"
        )
    for f in absent:
        _download(f, root / f.path, log)
    return {f.path: f.sha256 for f in needed}


def articles_from_wikiextractor(raw: bytes, titles: list) -> bytes:
    """The store's form of a WikiExtractor file: the articles named in `titles`, in that order, each
    "= Title =", a blank line, then its lines without trailing spaces or blank lines; a blank line
    between articles. The source's short stubs are left out by not being named."""
    found = {}
    for record in re.findall(r"<doc [^>]*>\n(.*?)\n</doc>\n", raw.decode("utf-8"), re.S):
        title, _, text = record.partition("\n")
        lines = (line.rstrip() for line in text.split("\n"))
        found.setdefault(title, "\n".join(line for line in lines if line))
    lost = [t for t in titles if t not in found]
    if lost:
        raise DataError(f"{len(lost)} article(s) are not in the source, e.g. {lost[0]!r}")
    return "\n".join(f"= {t} =\n\n{found[t]}\n" for t in titles).encode("utf-8")


def _mb(rows) -> str:
    return f"{sum(f.size for f in rows) / 1e6:.1f} MB"


def _verify(path: Path, f: DataFile, advice: str) -> None:
    """Raise DataError unless `path` holds the pinned bytes, comparing sizes before hashing. A
    Wikipedia file in its source form (WikiExtractor output) is converted in place first."""
    if path.stat().st_size != f.size and f.group in WIKIEXTRACTOR_GROUPS:
        raw = path.read_bytes()
        if raw.startswith(b"<doc "):
            converted = articles_from_wikiextractor(raw, ARTICLES[f.path])
            atomic_write(path, lambda tmp: tmp.write_bytes(converted))
    size = path.stat().st_size
    if size != f.size or sha256_file(path) != f.sha256:
        raise DataError(
            f"{f.path}: expected sha256 {f.sha256} ({f.size} bytes), found sha256 "
            f"{sha256_file(path)} ({size} bytes) in {path}; {advice}"
        )


def _endpoint(url: str):
    """(host, port) a fetch of `url` connects to, its proxy's if it has one; None for a file."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return None
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(parts.hostname):
        parts = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def _unreachable(urls: list) -> list:
    """The "host:port" of each endpoint of `urls` taking no TCP connection within CONNECT_SECONDS;
    daemon threads try all at once, so a hanging name lookup cannot hold the caller."""
    endpoints = {_endpoint(url) for url in urls} - {None}
    reached = set()

    def connect(endpoint):
        try:
            socket.create_connection(endpoint, timeout=CONNECT_SECONDS).close()
            reached.add(endpoint)
        except OSError:
            pass

    threads = [threading.Thread(target=connect, args=(e,), daemon=True) for e in endpoints]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + CONNECT_SECONDS
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return sorted(f"{host}:{port}" for host, port in endpoints - set(reached))


def _download(f: DataFile, dest: Path, log) -> None:
    """Stream `f` into a temporary file beside `dest` under a progress bar, check it (converting a
    Wikipedia source), then rename it to `dest`: a failure leaves neither `dest` nor a temporary."""
    url = source(f)
    log(f"downloading {f.path} ({_mb([f])}, licence {GROUPS[f.group][1]}) from {url}")

    def fetch(tmp: Path):
        try:
            with urllib.request.urlopen(url, timeout=60) as response, open(tmp, "wb") as out:
                length = int(response.headers.get("Content-Length") or 0) or None
                with tqdm(
                    total=length, unit="B", unit_scale=True, desc=f.path, file=sys.stdout
                ) as bar:
                    while block := response.read(1 << 16):
                        bar.update(out.write(block))
                received = out.tell()
        except (OSError, http.client.HTTPException) as err:
            raise DataError(f"{f.path}: fetching {url} failed ({err}); run again") from err
        if length and received != length:
            raise DataError(
                f"{f.path}: {url} stopped after {received} of {length} bytes; run again"
            )
        _verify(tmp, f, f"nothing was kept from {url}")

    atomic_write(dest, fetch)
