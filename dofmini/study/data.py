"""The data store: every file the pipeline reads, pinned by size and sha256 in data_files.tsv, and
the download that fills it. README "Data" says where it lives and what moves it ($DOFMINI_DATA,
$DOFMINI_DATA_MIRROR, $DOFMINI_DATA_REGISTRY). Wikipedia sources are WikiExtractor output; the store
keeps the articles data_articles.txt names, as plain text."""

import functools
import http.client
import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import NamedTuple

from tqdm import tqdm

from ..files import atomic_write, by_hand, cache_dir, sha256_file
from .tasks import DataError, task_reads

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
    # fine-tuning only (task_train.SPLITS): read when a run fine-tunes
    "logiqa_ft": ("LogiQA (English) dev, LogiQA's fine-tuning split", "none stated; research use"),
    "arc_easy_train": ("ARC-Easy train", "CC BY-SA 4.0"),
    "arc_challenge_train": ("ARC-Challenge train", "CC BY-SA 4.0"),
    "winogrande_train": ("Winogrande 1.1 train_l", "CC BY"),
    "mmlu_train": ("MMLU validation, 57 subjects", "MIT"),
    "superglue_wsc": ("SuperGLUE WSC train and validation", "CC BY 4.0"),
}
WIKIEXTRACTOR_GROUPS = ("corpus", "heldout")


class Unreachable(DataError):
    """A source that cannot be reached: every other file from it would wait and fail alike."""


class DataFile(NamedTuple):
    group: str
    path: str  # in the store, "/"-separated
    size: int
    sha256: str
    url: str  # the public source


def _lines(file: Path) -> list:
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"cannot read {file}: {getattr(err, 'strerror', None) or err}") from None
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def read_registry(file: Path) -> tuple:
    """The rows of a registry file (data_files.tsv's format), checked: a bad row stops here, and
    a path listed twice (its text would count twice) is a bad row. A path is relative and plain
    ("/"-separated names, none empty, "." or ".."), so every file stays inside the store and has
    one spelling; a task's row pins a file its loader reads (tasks.task_reads)."""
    rows = {}
    lines = _lines(file)
    header = "group\tpath\tbytes\tsha256\turl"
    if lines[:1] != [header]:  # without it, the first row would be taken for the header
        raise DataError(f"{file} line 1: {lines[:1]}; expected the header {header!r}")
    for number, line in enumerate(lines[1:], start=2):
        cells = line.split("\t")
        valid = len(cells) == 5 and cells[0] in GROUPS and cells[2].isdigit()
        if not valid or cells[1] in rows or not re.fullmatch(r"[0-9a-f]{64}", cells[3]):
            raise DataError(
                f"{file} line {number}: {line!r}; expected a group ({', '.join(GROUPS)}), path "
                "(not listed before), bytes, sha256 (64 hex) and URL, tab-separated"
            )
        if why := _bad_path(cells[0], cells[1]):
            raise DataError(f"{file} line {number}: {line!r}; {why}")
        if why := _bad_url(cells[4]):  # the line left out: it may hold a password
            raise DataError(f"{file} line {number} ({cells[1]}): {why}")
        rows[cells[1]] = DataFile(cells[0], cells[1], int(cells[2]), cells[3], cells[4])
    return tuple(rows.values())


def _bad_path(group: str, path: str) -> str:
    """Why `path` cannot be a row of `group`, or "" when it can."""
    names = path.split("/")
    if path.startswith("/") or "\\" in path or {"", ".", ".."} & set(names):
        return f"the path {path!r}: expected names separated by '/', none empty, '.' or '..'"
    return task_reads(group, path)


@functools.cache
def registry() -> tuple:
    """The rows of $DOFMINI_DATA_REGISTRY, else of data_files.tsv; read on use, not on import."""
    default = Path(__file__).with_name("data_files.tsv")
    return read_registry(Path(os.environ.get("DOFMINI_DATA_REGISTRY") or default))


def _articles(lines: list) -> dict:
    """{store path: titles of its articles, in order}: a path line, then its titles tab-indented."""
    titles = {}
    for line in lines:
        if line.startswith("\t"):
            titles[next(reversed(titles))].append(line[1:])
        else:
            titles[line] = []
    return titles


ARTICLES = _articles(_lines(Path(__file__).with_name("data_articles.txt")))


def store_dir(arg=None) -> Path:
    """`arg` (the --data flag), else $DOFMINI_DATA, else $XDG_CACHE_HOME/dofmini/data (~/.cache)."""
    return Path(arg or os.environ.get("DOFMINI_DATA") or cache_dir() / "data").expanduser()


def files(groups) -> list:
    """The registry rows of `groups` (names of GROUPS, or one name)."""
    groups = [groups] if isinstance(groups, str) else list(groups)
    if unknown := [g for g in groups if g not in GROUPS]:
        raise DataError(f"unknown data group(s) {unknown}; known: {', '.join(GROUPS)}")
    return [f for f in registry() if f.group in groups]


def source(f: DataFile) -> str:
    """Where `f` comes from: $DOFMINI_DATA_MIRROR/<path> when that is set, else its public URL."""
    mirror = check_mirror()
    return f"{mirror.rstrip('/')}/{f.path}" if mirror else f.url


def _bad_url(url: str) -> str:
    """Why `url` cannot be a source, or "": an http, https or file URL that parses, without a user
    or password (refused, not sent: it would show in every plan, log line and error). The reason
    names no more of it than its scheme and host, in case it holds a password."""
    try:
        parts = urllib.parse.urlsplit(url)
        host, _ = parts.hostname, parts.port  # a port that is not a number raises here
    except ValueError as err:
        return f"the URL does not parse ({err})"
    if parts.scheme not in ("http", "https", "file") or parts.scheme != "file" and not host:
        got = f"scheme {parts.scheme!r}, host {host!r}"
        return f"the URL ({got}): expected http://HOST/..., https://HOST/... or file:///FOLDER"
    if "@" in parts.netloc:  # refused rather than sent as basic auth, to any host it redirects to
        return f"a user or password in the URL {parts.scheme}://...@{host} is refused"
    return ""


def check_mirror() -> str:
    """$DOFMINI_DATA_MIRROR, checked (_bad_url), or "" when unset; a DataError names it."""
    mirror = os.environ.get("DOFMINI_DATA_MIRROR", "")
    if why := mirror and _bad_url(mirror):
        raise DataError(f"DOFMINI_DATA_MIRROR: {why}")
    return mirror


def missing(groups, root) -> list:
    return [f for f in files(groups) if not (Path(root) / f.path).exists()]


def size_mb(rows) -> str:
    return f"{sum(f.size for f in rows) / 1e6:.1f} MB"


def describe(groups, root) -> str:
    """For a run plan: per group its dataset, files, size, licence, source and what is missing."""
    lines = [f"data store {Path(root).resolve()}:"]
    for group in dict.fromkeys(f.group for f in files(groups)):
        dataset, licence = GROUPS[group]
        rows = files(group)
        hosts = sorted({urllib.parse.urlsplit(source(f)).netloc or "a local folder" for f in rows})
        lines.append(
            f"  {group}: {dataset}; {len(rows)} file(s), {size_mb(rows)}, licence {licence}, from "
            f"{', '.join(hosts)}; {len(missing(group, root)) or 'none'} to download"
        )
    return "\n".join(lines)


def offline_listing(rows, root, indent: int = 2) -> str:
    """Where each of `rows` comes from and goes: one "URL -> path" line pair per file."""
    return by_hand(((source(f), Path(root).resolve() / f.path) for f in rows), indent)


def ensure(groups, root, log=print) -> dict:
    """{path in the store: sha256} of every file of `groups` under `root`, missing ones downloaded.
    Each file is checked (size, then sha256) or downloaded and checked; what verified stays, and
    one DataError names every failure. When a source cannot be reached, the DataError lists
    each file still missing, its URL and where to put it."""
    root, needed = Path(root), files(groups)
    for f in needed:  # a link in the store must not take a download outside it
        if not (root / f.path).parent.resolve().is_relative_to(root.resolve()):
            raise DataError(f"{f.path}: {root / f.path} leads outside the store {root.resolve()}")
    _remove_stale_temporaries(root, needed)
    absent, failures = missing(groups, root), []
    for f in needed:
        try:
            if f in absent:
                licence = GROUPS[f.group][1]
                log(f"downloading {f.path} ({size_mb([f])}, licence {licence}) from {source(f)}")
                atomic_write(root / f.path, functools.partial(fetch_verified, f))
            else:
                verify(root / f.path, f, "delete it to download it again")
        except Unreachable as err:
            left = missing(groups, root)
            raise DataError(
                f"{len(left)} data file(s), {size_mb(left)}, are missing and {err}. Download each "
                f"to the path shown (a Wikipedia file as served: it is converted on the next run), "
                f"or point --data, DOFMINI_DATA or DOFMINI_DATA_MIRROR at a copy of the store:"
                f"{offline_listing(left, root)}"
            ) from None
        except DataError as err:
            failures.append(str(err))
        except OSError as err:  # a read-only store, a full disk: atomic_write names the file
            failures.append(f"{f.path}: {err.strerror or err}")
    if failures:
        raise DataError(
            f"{len(failures)} of {len(needed)} data file(s) failed; the other "
            f"{len(needed) - len(failures)} are in place and verified:\n  " + "\n  ".join(failures)
        )
    return {f.path: f.sha256 for f in needed}


def _remove_stale_temporaries(root: Path, rows) -> None:
    """Delete each `.NAME.PID.tmp` of atomic_write whose process PID is gone (killed mid-write)."""
    for folder in {(root / f.path).parent for f in rows}:
        for tmp in folder.glob(".*.tmp"):
            try:
                os.kill(int(tmp.name.rsplit(".", 2)[-2]), 0)  # signal 0: is it running?
            except ProcessLookupError:
                tmp.unlink(missing_ok=True)
            except (ValueError, PermissionError):  # not a PID, or another user's process
                pass


def articles_from_wikiextractor(raw: bytes, titles: list, file="the source") -> bytes:
    """The store's form of a WikiExtractor file: the articles named in `titles`, in that order, each
    "= Title =", a blank line, then its lines without trailing whitespace or blank lines; a blank
    line between articles. Leading whitespace stays (the real sources have lines that begin with a
    space). The source's short stubs are left out by not being named. `file` names it in errors."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{file} is not UTF-8 ({err}); expected WikiExtractor output") from None
    found = {}
    for record in re.findall(r"<doc [^>]*>\n(.*?)\n</doc>\n", text, re.S):
        title, _, body = record.partition("\n")
        lines = (line.rstrip() for line in body.split("\n"))
        found.setdefault(title, "\n".join(line for line in lines if line))
    if lost := [t for t in titles if t not in found]:
        raise DataError(f"{len(lost)} article(s) are not in {file}, e.g. {lost[0]!r}")
    return "\n".join(f"= {t} =\n\n{found[t]}\n" for t in titles).encode("utf-8")


def verify(path: Path, f: DataFile, advice: str) -> None:
    """Raise DataError unless `path` holds the pinned bytes, comparing sizes before hashing. A
    Wikipedia file in its source form (WikiExtractor output) is converted in place first."""
    if not path.is_file():
        raise DataError(f"{f.path}: {path} is not a file; expected the file itself")
    if path.stat().st_size != f.size and f.group in WIKIEXTRACTOR_GROUPS:
        raw = path.read_bytes()
        if raw.startswith(b"<doc ") and f.path not in ARTICLES:
            raise DataError(f"{f.path}: data_articles.txt names no articles of it to keep")
        if raw.startswith(b"<doc "):
            converted = articles_from_wikiextractor(raw, ARTICLES[f.path], path)
            atomic_write(path, lambda tmp: tmp.write_bytes(converted))
    size = path.stat().st_size
    if size != f.size or sha256_file(path) != f.sha256:
        raise DataError(
            f"{f.path}: expected sha256 {f.sha256} ({f.size} bytes), found sha256 "
            f"{sha256_file(path)} ({size} bytes) in {path}; {advice}"
        )


def fetch_verified(f: DataFile, tmp: Path, bar: bool = True) -> None:
    """Stream `f` from its source into `tmp`, under a progress bar if `bar`, and verify it
    (converting a Wikipedia source); a DataError says whether to retry. It stops once past the
    pinned size (a Wikipedia source, unconverted, at 4 times it: its <doc> lines, short stubs)."""
    path, url = f.path, source(f)
    most = f.size * (4 if f.group in WIKIEXTRACTOR_GROUPS else 1)
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(tmp, "wb") as out:
            length = int(response.headers.get("Content-Length") or 0) or None
            # on stdout, beside the log: stderr holds a failed run's one-line error alone
            progress = dict(unit="B", unit_scale=True, desc=path, file=sys.stdout, disable=not bar)
            with tqdm(total=length, **progress) as counter:
                while block := response.read(1 << 16):
                    counter.update(out.write(block))
                    if out.tell() > most:
                        raise DataError(f"{path}: {url} sent more than {most} bytes; stopped")
            received = out.tell()
    except urllib.error.HTTPError as err:
        raise DataError(f"{path}: {url} answered HTTP {err.code} ({err.reason})") from None
    except (OSError, http.client.HTTPException, ValueError) as err:  # ValueError: not a URL
        reason = getattr(err, "reason", None)  # a URLError's: why no connection was made
        gone = isinstance(reason, FileNotFoundError)  # file:// with no file
        if isinstance(reason, OSError) and not gone:
            host = urllib.parse.urlsplit(url).netloc
            raise Unreachable(f"{host} is unreachable ({reason.strerror or reason})") from None
        retry = "" if gone else "; run again to retry"
        raise DataError(f"{path}: fetching {url} failed ({err}){retry}") from None
    if length and received != length:
        raise DataError(f"{path}: {url} stopped after {received} of {length} bytes; run again")
    verify(tmp, f, f"nothing kept from {url}")
