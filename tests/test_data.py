"""The data store: registry checks that run in a fresh clone, the Wikipedia conversion, and
downloads from a real HTTP server on 127.0.0.1 (no other network)."""

import contextlib
import hashlib
import http.server
import os
import re
import shutil
import socket
import string
import threading

import check_sources as sources
import pytest
from conftest import data_path
from hypothesis import given, settings
from hypothesis import strategies as st

from dofmini.files import sha256_file
from dofmini.study import data, task_train
from dofmini.study.evaluate import PPL_TEXTS
from dofmini.study.tasks import TASKS, load_task

SERVED = ["wikitext2", "piqa", "logiqa"]  # 3.5 MB in 5 files over 3 folders: a quick full fill


@pytest.fixture(autouse=True)
def no_user_store(monkeypatch, tmp_path):
    """No test sees the caller's store or mirror settings, writes to ~/.cache or uses a proxy."""
    for name in ("DOFMINI_DATA", "DOFMINI_DATA_MIRROR", "http_proxy", "HTTP_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def stored(root) -> set:
    """Every file under `root` (temporaries included), as "/"-separated relative paths."""
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def paths(groups) -> set:
    return {f.path for f in data.files(groups)}


def test_every_group_resolves_and_covers_what_the_code_reads():
    tuning = {"logiqa_ft", "arc_easy_train", "arc_challenge_train", "winogrande_train"}
    tuning |= {"mmlu_train", "superglue_wsc"}  # fine-tuning only (task_train.py)
    assert set(data.GROUPS) == {"wikitext2", "corpus", "heldout", *TASKS, *tuning}
    assert all(data.files(group) for group in data.GROUPS)
    assert {f.group for f in data.registry()} == set(data.GROUPS)
    assert set(PPL_TEXTS.values()) <= paths(PPL_TEXTS)
    assert len(paths("corpus")) == 17
    assert all(re.fullmatch(r"corpus/wikipedia/[^/]+\.txt", p) for p in paths("corpus"))
    assert len(paths("mmlu")) == 57
    assert all(re.fullmatch(r"mmlu/test/[a-z_]+_test\.csv", p) for p in paths("mmlu"))
    with pytest.raises(data.DataError, match="unknown data group.*'hellaswag'"):
        data.files(["piqa", "hellaswag"])


def test_registry_rows_are_well_formed():
    assert len({f.path for f in data.registry()}) == len(data.registry())
    for f in data.registry():
        assert re.fullmatch(r"[\w.-]+(/[\w.-]+)*", f.path) and ".." not in f.path.split("/")
        assert f.size > 0 and re.fullmatch(r"[0-9a-f]{64}", f.sha256)
        assert f.url.startswith("https://") and " " not in f.url
    assert set(data.ARTICLES) == paths(data.WIKIEXTRACTOR_GROUPS)
    for titles in data.ARTICLES.values():
        assert titles and len(set(titles)) == len(titles)


def test_store_location(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data.store_dir() == tmp_path / "xdg" / "dofmini" / "data"
    monkeypatch.setenv("DOFMINI_DATA", str(tmp_path / "env"))
    assert data.store_dir() == tmp_path / "env"
    assert data.store_dir(tmp_path / "flag") == tmp_path / "flag"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.delenv("DOFMINI_DATA")
    assert str(data.store_dir()).endswith(".cache/dofmini/data")


def wikiextractor(articles, trailing=" ") -> bytes:
    """`articles` [(title, [lines])] in WikiExtractor's layout, as the Wikipedia sources have them:
    `trailing` after every other line, and a short stub (which the store leaves out) after each."""
    records = []
    for i, (title, lines) in enumerate(articles):
        text = "\n".join(line + trailing * (n % 2) for n, line in enumerate(lines))
        records.append(f'<doc id="{i}" url="u?curid={i}" title="{title}">\n{title}\n\n{text}')
        records.append(f'<doc id="{i}0" url="u" title="Zz {i}">\nZz {i}\n\nZz may refer to:')
    return "".join(f"{record}\n\n</doc>\n" for record in records).encode("utf-8")


def shared_as_wikiextractor(f: data.DataFile) -> bytes:
    """The shared copy of Wikipedia file `f`, put back into WikiExtractor's layout."""
    text = data_path(f.path).read_text(encoding="utf-8")
    parts = re.split(r"(?m)^= (.*) =\n\n", text)[1:]
    return wikiextractor([(t, b.rstrip("\n").split("\n")) for t, b in zip(parts[::2], parts[1::2])])


words = st.text(string.ascii_lowercase + " .,;é€", min_size=1).map(str.strip).filter(bool)


@settings(deadline=None)  # a loaded CI machine is slow; no test here is timed
@given(st.dictionaries(words, st.lists(words, min_size=1, max_size=5), min_size=1, max_size=5))
def test_wikiextractor_records_become_the_store_form(articles):
    raw = wikiextractor(list(articles.items()), trailing=" \t")
    expected = "\n".join(f"= {t} =\n\n" + "\n".join(lines) + "\n" for t, lines in articles.items())
    assert data.articles_from_wikiextractor(raw, list(articles)) == expected.encode("utf-8")
    with pytest.raises(data.DataError, match="1 article.*'Zz absent'"):
        data.articles_from_wikiextractor(raw, [*articles, "Zz absent"])


def test_wikipedia_sources_convert_to_the_pinned_files():
    """Each pinned Wikipedia file, put back into WikiExtractor's layout, converts to its pin."""
    for f in data.files(data.WIKIEXTRACTOR_GROUPS):
        converted = data.articles_from_wikiextractor(
            shared_as_wikiextractor(f), data.ARTICLES[f.path]
        )
        assert hashlib.sha256(converted).hexdigest() == f.sha256, f.path


def test_wikipedia_source_downloaded_or_placed_is_converted(data_mirror, monkeypatch, tmp_path):
    (heldout,) = data.files("heldout")
    served, store = tmp_path / "served", tmp_path / "store"
    served.mkdir()
    (served / "wiki_45").write_bytes(shared_as_wikiextractor(heldout))
    source = heldout._replace(url=f"{data_mirror(served).url}/wiki_45")
    monkeypatch.setattr(data, "registry", lambda: (source,))  # the registry, with this source's URL
    assert data.ensure("heldout", store, log=lambda message: None) == {heldout.path: heldout.sha256}
    assert sha256_file(store / heldout.path) == heldout.sha256 and stored(store) == {heldout.path}
    shutil.copy(served / "wiki_45", store / heldout.path)  # as the offline message says to
    assert data.ensure("heldout", store) == {heldout.path: heldout.sha256}
    assert sha256_file(store / heldout.path) == heldout.sha256 and stored(store) == {heldout.path}


def test_every_shared_copy_matches_its_pin():
    shared = data_path()
    fine_tuning = {group for _, group in task_train.SPLITS.values() if group}
    absent = []
    for f in data.registry():
        path = shared / f.path
        if f.group in fine_tuning and not path.exists():
            absent.append(f.path)
            continue
        assert path.stat().st_size == f.size and sha256_file(path) == f.sha256, f.path
    if absent:  # every other file was checked above
        pytest.skip(
            f"{len(absent)} fine-tuning files (e.g. {absent[0]}) are not in {shared} yet: "
            "the fine-tuning splits' copies arrive in ../shared/data next round"
        )


def test_empty_store_fills_from_the_mirror_then_downloads_nothing(
    data_mirror, monkeypatch, tmp_path
):
    mirror = data_mirror(data_path())
    monkeypatch.setenv("DOFMINI_DATA_MIRROR", mirror.url)
    store = tmp_path / "store"
    plan = data.describe(SERVED, store).splitlines()
    assert [line.rsplit("; ", 1)[1] for line in plan[1:]] == ["2 to download"] * 2 + [
        "1 to download"
    ]
    hashes = data.ensure(SERVED, store, log=lambda message: None)
    assert hashes == {f.path: f.sha256 for f in data.files(SERVED)}
    assert all(sha256_file(store / path) == sha for path, sha in hashes.items())
    assert stored(store) == paths(SERVED) and sorted(mirror.requests) == sorted(paths(SERVED))
    assert data.ensure(SERVED, store) == hashes and len(mirror.requests) == len(hashes)
    assert data.missing(SERVED, store) == [] and "none to download" in data.describe("piqa", store)


def test_store_holds_every_file_the_tasks_read(monkeypatch, tmp_path):
    monkeypatch.setenv("DOFMINI_DATA_MIRROR", f"file://{data_path()}")
    data.ensure(TASKS, tmp_path, log=lambda message: None)
    assert stored(tmp_path) == paths(TASKS)
    for name in TASKS:
        assert len(load_task(name, tmp_path, limit=2)) == 2


def test_cut_download_leaves_nothing_and_a_rerun_completes(data_mirror, monkeypatch, tmp_path):
    mirror = data_mirror(data_path())
    monkeypatch.setenv("DOFMINI_DATA_MIRROR", mirror.url)
    cut = "wikitext-2-raw/wiki.test.raw"
    mirror.cut[cut] = 600_000
    with pytest.raises(data.DataError, match=f"{cut}: .* stopped after 600000 of 1290590 bytes"):
        data.ensure(["wikitext2"], tmp_path, log=lambda message: None)
    assert stored(tmp_path) == {"wikitext-2-raw/wiki.valid.raw"}  # no partial file, no temporary
    data.ensure(["wikitext2"], tmp_path, log=lambda message: None)
    assert stored(tmp_path) == paths("wikitext2") and mirror.requests.count(cut) == 2
    assert sha256_file(tmp_path / cut) == {f.path: f.sha256 for f in data.registry()}[cut]


def test_flipped_byte_is_named_with_both_hashes(data_mirror, monkeypatch, tmp_path):
    served, store = tmp_path / "served", tmp_path / "store"
    shutil.copytree(data_path("piqa"), served / "piqa")
    corrupt = served / "piqa" / "valid.jsonl"
    body = bytearray(corrupt.read_bytes())
    body[len(body) // 2] ^= 1
    corrupt.write_bytes(body)
    actual, pinned = sha256_file(corrupt), data.files("piqa")[0].sha256
    monkeypatch.setenv("DOFMINI_DATA_MIRROR", data_mirror(served).url)
    with pytest.raises(data.DataError) as raised:
        data.ensure(["piqa"], store, log=lambda message: None)
    assert "piqa/valid.jsonl" in str(raised.value) and pinned in str(raised.value)
    # the labels verified and stay
    assert actual in str(raised.value) and stored(store) == {"piqa/valid-labels.lst"}
    shutil.copy(corrupt, store / "piqa")
    with pytest.raises(data.DataError, match=f"expected sha256 {pinned}.* found sha256 {actual}"):
        data.ensure(["piqa"], store)


def test_offline_gives_one_message_listing_every_missing_file(monkeypatch, tmp_path):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    monkeypatch.setenv("DOFMINI_DATA_MIRROR", url)
    with pytest.raises(data.DataError) as raised:
        data.ensure(SERVED, tmp_path / "store")
    message = str(raised.value)  # the first refused connection stops the download
    assert f"{url.removeprefix('http://')} is unreachable (Connection refused)" in message
    size = sum(f.size for f in data.files(SERVED)) / 1e6
    assert message.startswith(f"5 data file(s), {size:.1f} MB, are missing and 127.0.0.1:")
    for f in data.files(SERVED):
        assert f"{url}/{f.path}\n    -> {tmp_path / 'store' / f.path}" in message
    assert "DOFMINI_DATA or DOFMINI_DATA_MIRROR at a copy of the store" in message
    assert not stored(tmp_path / "store")  # nothing fetched, not even a temporary


def test_every_missing_file_is_attempted_and_one_message_names_each_failure(
    data_mirror, monkeypatch, tmp_path
):
    """A mirror serving one wrong file and missing another: the rest of the groups' files are
    downloaded and verified, and one error names both failures."""
    served, store = tmp_path / "served", tmp_path / "store"
    for group in SERVED:
        for f in data.files(group):
            (served / f.path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(data_path(f.path), served / f.path)
    wrong, gone = "wikitext-2-raw/wiki.valid.raw", "logiqa/Test.txt"
    (served / wrong).write_bytes(b"not the pinned bytes\n")
    (served / gone).unlink()
    mirror = data_mirror(served)
    monkeypatch.setenv("DOFMINI_DATA_MIRROR", mirror.url)
    with pytest.raises(data.DataError) as raised:
        data.ensure(SERVED, store, log=lambda message: None)
    message = str(raised.value)
    assert message.startswith("2 of 5 data file(s) failed; the other 3 are in place and verified")
    assert (
        f"{wrong}: expected sha256" in message and f"{gone}: {mirror.url}/{gone} answered HTTP 404"
    )
    assert stored(store) == paths(SERVED) - {wrong, gone}


def test_stale_temporaries_of_killed_downloads_are_removed(monkeypatch, tmp_path):
    monkeypatch.setenv("DOFMINI_DATA_MIRROR", f"file://{data_path()}")
    folder = tmp_path / "wikitext-2-raw"
    folder.mkdir()
    dead = 2**22 + 12345  # above Linux's default pid_max of 2^22: no such process
    stale = folder / f".wiki.valid.raw.{dead}.tmp"
    stale.write_bytes(b"x" * 1000)
    live = folder / f".wiki.other.{os.getpid()}.tmp"  # a running download's: kept
    live.write_bytes(b"y")
    data.ensure("wikitext2", tmp_path, log=lambda message: None)
    assert not stale.exists() and live.exists()


def test_a_folder_or_a_non_utf8_source_is_named(monkeypatch, tmp_path):
    (tmp_path / "wikitext-2-raw" / "wiki.test.raw").mkdir(parents=True)
    monkeypatch.setenv("DOFMINI_DATA_MIRROR", f"file://{data_path()}")
    with pytest.raises(data.DataError, match="wiki.test.raw is not a file; expected the file"):
        data.ensure("wikitext2", tmp_path, log=lambda message: None)
    with pytest.raises(data.DataError, match="heldout.txt is not UTF-8"):
        data.articles_from_wikiextractor(b'<doc id="1">\n\xff\n</doc>\n', ["A"], "heldout.txt")
    with pytest.raises(data.DataError, match="1 article.* not in wiki_45, e.g. 'A'"):
        data.articles_from_wikiextractor(b"", ["A"], "wiki_45")


def test_a_bad_registry_row_is_named(tmp_path):
    registry = tmp_path / "files.tsv"
    registry.write_text("group\tpath\tbytes\tsha256\turl\npiqa\tx.txt\t12\tabc\thttps://h/x\n")
    with pytest.raises(data.DataError, match=r"files.tsv line 2: .*expected a group \(wikitext2"):
        data.read_registry(registry)
    registry.write_text(
        f"group\tpath\tbytes\tsha256\turl\nhellaswag\tx.txt\t12\t{'0' * 64}\thttps://h/x\n"
    )
    with pytest.raises(data.DataError, match="line 2: 'hellaswag.*expected a group \\(wikitext2"):
        data.read_registry(registry)


def test_a_registry_without_its_header_or_with_a_path_twice_is_refused(tmp_path):
    registry, header = tmp_path / "files.tsv", "group\tpath\tbytes\tsha256\turl\n"
    row = f"corpus\tcorpus/x.txt\t12\t{'0' * 64}\thttps://h/x\n"
    registry.write_text(row)  # its first row would otherwise be dropped as the header
    with pytest.raises(data.DataError, match=r"files.tsv line 1: \['corpus.*expected the header"):
        data.read_registry(registry)
    registry.write_text(header + row + row)  # the same text would be trained on twice
    with pytest.raises(data.DataError, match=r"files.tsv line 3: .*path \(not listed before\)"):
        data.read_registry(registry)
    registry.write_text(header + row)
    assert [f.path for f in data.read_registry(registry)] == ["corpus/x.txt"]


def test_source_check_prints_a_table_and_fails_on_a_mismatch(data_mirror, monkeypatch, tmp_path):
    served = tmp_path / "served"
    for f in data.files(["piqa", "heldout"]):
        (served / f.path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(data_path(f.path), served / f.path)
    (heldout,) = data.files("heldout")
    (served / heldout.path).write_bytes(shared_as_wikiextractor(heldout))  # as its source serves it
    monkeypatch.setenv("DOFMINI_DATA_MIRROR", data_mirror(served).url)
    lines = []
    assert sources.check_sources(["piqa", "heldout"], log=lines.append)
    assert len(lines) == 4 and all(line.endswith("| yes |") for line in lines[1:])
    (served / "piqa" / "valid-labels.lst").write_bytes(b"0\n1\n")
    lines.clear()
    assert not sources.check_sources(["piqa", "heldout"], log=lines.append)
    (bad,) = [line for line in lines if "**no**" in line]
    assert bad.startswith("| piqa/valid-labels.lst |") and "| **no**: piqa/valid-labels.lst" in bad
    assert not list(tmp_path.glob("**/.*.tmp"))
    with pytest.raises(SystemExit) as exited:
        sources.main(["--groups", "piqa"])
    assert exited.value.code == 1


def registry_with(tmp_path, group: str, path: str, url: str = "https://h/x"):
    registry = tmp_path / "files.tsv"
    registry.write_text(
        f"group\tpath\tbytes\tsha256\turl\n{group}\t{path}\t12\t{'0' * 64}\t{url}\n"
    )
    return registry


@pytest.mark.parametrize(
    "path", ["../x/c.txt", "/tmp/c.txt", "corpus/wikipedia/./a.txt", "corpus//a.txt", "corpus\\a"]
)
def test_a_registry_path_outside_the_store_or_spelled_twice_is_refused(tmp_path, path):
    with pytest.raises(data.DataError, match="line 2: .*none empty, '.' or '..'"):
        data.read_registry(registry_with(tmp_path, "corpus", path))


def test_a_task_row_pins_only_a_file_its_loader_reads(tmp_path):
    """A row pinning another name would be verified while the loader reads an unpinned file."""
    with pytest.raises(
        data.DataError, match="the piqa task reads piqa/valid.jsonl, piqa/valid-lab"
    ):
        data.read_registry(registry_with(tmp_path, "piqa", "piqa/other.jsonl"))
    with pytest.raises(data.DataError, match="mmlu task reads mmlu/test/<subject>_test.csv, not"):
        data.read_registry(registry_with(tmp_path, "mmlu", "mmlu/dev/x_test.csv"))
    assert data.read_registry(registry_with(tmp_path, "mmlu", "mmlu/test/x_test.csv"))


def test_a_link_leading_out_of_the_store_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("DOFMINI_DATA_MIRROR", f"file://{data_path()}")
    (tmp_path / "store").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "store" / "wikitext-2-raw").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(data.DataError, match="wiki.valid.raw leads outside the store"):
        data.ensure("wikitext2", tmp_path / "store", log=lambda message: None)
    assert not list((tmp_path / "elsewhere").iterdir())


def test_a_url_with_a_password_is_refused_without_showing_it(monkeypatch, tmp_path):
    with pytest.raises(data.DataError) as raised:
        data.read_registry(registry_with(tmp_path, "corpus", "corpus/a.txt", "https://u:pw@h/x"))
    assert "user or password in the URL https://...@h is refused" in str(raised.value)
    monkeypatch.setenv("DOFMINI_DATA_MIRROR", "http://me:secret@127.0.0.1:9")
    with pytest.raises(data.DataError) as raised:
        data.describe("wikitext2", tmp_path)
    assert "secret" not in str(raised.value) and "DOFMINI_DATA_MIRROR: a user" in str(raised.value)


@pytest.mark.parametrize("mirror", ["http://[::1", "ftp://h/x", "/a/folder", "http://h:port/"])
def test_a_malformed_mirror_is_one_error_before_any_work(monkeypatch, tmp_path, mirror):
    """Even with nothing to download: describe, a run's first step, checks it."""
    monkeypatch.setenv("DOFMINI_DATA_MIRROR", mirror)
    with pytest.raises(data.DataError, match="^DOFMINI_DATA_MIRROR: the URL"):
        data.describe("wikitext2", tmp_path)


class _Endless(http.server.BaseHTTPRequestHandler):
    """Answers every GET with bytes that never end (no Content-Length)."""

    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        with contextlib.suppress(OSError):  # the client hangs up
            while True:
                self.wfile.write(b"x" * 65536)

    def log_message(self, format, *args):
        pass


def test_a_download_stops_past_the_pinned_size_and_leaves_nothing(monkeypatch, tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Endless)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        monkeypatch.setenv("DOFMINI_DATA_MIRROR", f"http://127.0.0.1:{server.server_port}")
        with pytest.raises(data.DataError, match=r"piqa/valid-labels.lst: .* more than 3676 bytes"):
            data.ensure("piqa", tmp_path, log=lambda message: None)
    finally:
        server.shutdown()
        server.server_close()
    assert not stored(tmp_path)  # no file, no temporary


def test_a_wikipedia_source_without_its_articles_listed_is_one_error(tmp_path):
    source = tmp_path / "a.txt"
    source.write_bytes(b'<doc id="1">\nA\n\nText.\n</doc>\n')
    row = data.DataFile("corpus", "corpus/wikipedia/unlisted.txt", 1, "0" * 64, "https://h/x")
    with pytest.raises(data.DataError, match="unlisted.txt: data_articles.txt names no articles"):
        data.verify(source, row, "")
