"""Shared paths and fixtures. `../shared` (stand-in teachers and datasets) sits beside the checkout
in CI; in a user's fresh clone it is absent and the tests that need it skip, saying so.
`data_mirror` serves a data folder over HTTP on 127.0.0.1; `tiny_store` makes a run's inputs."""

import functools
import hashlib
import http.server
import importlib.util
import os
import random
import shutil
import signal
import subprocess
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import settings

# Every property test draws the same examples on every clone and run (derandomize: examples from
# the test's own source) and keeps no database of past failures across runs, so the README's test
# command gives one verdict everywhere. deadline None: a shared machine's pauses are no failures.
settings.register_profile("dofmini", derandomize=True, database=None, deadline=None)
settings.load_profile("dofmini")

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
FIXTURES = REPO / "tests" / "fixtures"


# a data store the user filled serves the tests that read data, as --data serves reproduce.py
USER_STORE = os.environ.get("DOFMINI_DATA")


def data_path(*parts: str) -> Path:
    """A path in the data store: $DOFMINI_DATA when it is set, else ../shared/data; or skip the
    calling test when it is absent."""
    if not USER_STORE:
        return shared_path("data", *parts)
    path = Path(USER_STORE).joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} is absent from the data store $DOFMINI_DATA")
    return path


def shared_path(*parts: str) -> Path:
    """A path under ../shared, or skip the calling test when it is absent."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(
            f"{path} is absent: the stand-in weights and datasets live in ../shared beside the "
            "checkout"
        )
    return path


@pytest.fixture(autouse=True, scope="session")
def private_cache(tmp_path_factory):
    """The tests' own user cache (a default data store), never the real one."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))


@pytest.fixture(scope="session")
def tiny():
    """The tiny GPT-2 fixture checkpoint (2 layers, 4 heads of 8, 96 token ids)."""
    from dofmini import load

    return load(FIXTURES / "gpt2-tiny")


@pytest.fixture(scope="session")
def tiny_ids():
    import torch

    return torch.randint(0, 96, (4096,), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="session")
def script():
    """reproduce.py as a module: its RunConfig, PROFILES and main."""
    spec = importlib.util.spec_from_file_location("reproduce", REPO / "reproduce.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def reproduce_here(script, monkeypatch, capsys):
    """reproduce.py run in this process, called as test_reproduce.reproduce is (its arguments, an
    `env` replacing the environment, the checkout as working folder) and answering as it does: a
    CompletedProcess of the exit status, stdout and stderr, a SystemExit's message on stderr as
    the interpreter prints it. No interpreter starts and no torch is imported again (~3 s a run).
    Left for subprocesses: what a process alone shows (signals, the lock, torchrun, a fresh
    clone's first run) and what libraries read once at import (the hub's endpoint, offline)."""
    from dofmini.study import data

    def run(*args, env=None):
        if env is not None:
            for name in set(os.environ) - set(env):
                monkeypatch.delenv(name)
            for name, value in env.items():
                monkeypatch.setenv(name, value)
        monkeypatch.chdir(REPO)
        # a failure leaves SIGINT and SIGTERM ignored (its exit ignores them): later subprocesses
        # of this one would inherit that
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        data.registry.cache_clear()  # read once a process: each run reads its own
        capsys.readouterr()
        code, said = 0, ""
        try:
            script.main([str(arg) for arg in args])
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:  # a message: the interpreter prints it and exits 1
                code, said = 1, f"{stop.code}\n"
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            data.registry.cache_clear()
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err + said)

    return run


@pytest.fixture(scope="session")
def standin_gpt2():
    from dofmini import load

    return load(shared_path("weights", "standin-gpt2"))


@pytest.fixture(scope="session")
def standin_pythia():
    from dofmini import load

    return load(shared_path("weights", "standin-pythia"))


@dataclass
class Mirror:
    """A folder served over HTTP on 127.0.0.1 by the `data_mirror` fixture."""

    url: str
    requests: list  # the paths asked for, in order
    cut: dict  # {path: bytes sent before the connection drops}, each used by one request


class _MirrorHandler(http.server.SimpleHTTPRequestHandler):
    def do_GET(self):
        path = urllib.parse.unquote(self.path.lstrip("/"))
        self.server.mirror.requests.append(path)
        cut = self.server.mirror.cut.pop(path, None)
        if cut is None:
            return super().do_GET()
        body = (Path(self.directory) / path).read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))  # promises the whole file
        self.end_headers()
        self.wfile.write(body[:cut])
        self.close_connection = True

    def log_message(self, format, *args):  # keeps the test output clean
        pass


@pytest.fixture
def data_mirror():
    """`data_mirror(folder)` serves `folder` over HTTP on 127.0.0.1 (a real ThreadingHTTPServer on a
    free port) and returns its `Mirror`; for DOFMINI_DATA_MIRROR=mirror.url. Servers stop after the
    test."""
    servers = []

    def serve(folder) -> Mirror:
        handler = functools.partial(_MirrorHandler, directory=str(folder))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.mirror = Mirror(f"http://127.0.0.1:{server.server_port}", [], {})
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        return server.mirror

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def tiny_store(root):
    """A data store of seeded made-up English under the real store paths, with a registry of its
    own pins ($DOFMINI_DATA_REGISTRY), and gpt2-tiny with a character tokenizer (its 96 ids): the
    whole pipeline in a fresh clone, no ../shared and no network."""
    words = "the of a city river was in is to by early north old king built first people".split()
    rng = random.Random(0)
    rows = ["group\tpath\tbytes\tsha256\turl"]
    for group, path in [("wikitext2", "wikitext-2-raw/wiki.valid.raw"),
                        ("wikitext2", "wikitext-2-raw/wiki.test.raw"),
                        ("corpus", "corpus/wikipedia/tiny.txt"),
                        ("heldout", "corpus/wikipedia-heldout.txt")]:  # fmt: skip
        lines = [" ".join(rng.choices(words, k=12)).capitalize() + "." for _ in range(400)]
        body = ("\n".join(lines) + "\n").encode()
        (root / "store" / path).parent.mkdir(parents=True, exist_ok=True)
        (root / "store" / path).write_bytes(body)
        rows.append(pin_row(group, path, body))
    (root / "registry.tsv").write_text("\n".join(rows) + "\n")
    model = root / "gpt2-tiny"
    shutil.copytree(FIXTURES / "gpt2-tiny", model)
    char_tokenizer().save(str(model / "tokenizer.json"))
    env = {**os.environ, "DOFMINI_DATA": str(root / "store")}
    return model, {**env, "DOFMINI_DATA_REGISTRY": str(root / "registry.tsv")}


def char_tokenizer():
    """A tokenizer of one id a character (printable ASCII and the newline: 96 ids, gpt2-tiny's
    vocabulary), so a token's offset is its character's."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {chr(c): i for i, c in enumerate(range(32, 127))} | {"\n": 95}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.decoder = decoders.Fuse()
    return tokenizer


def pin_row(group: str, path: str, body: bytes) -> str:
    """The registry row pinning `body` at `path` (its URL made up: these stores are not fetched)."""
    sha = hashlib.sha256(body).hexdigest()
    return f"{group}\t{path}\t{len(body)}\t{sha}\thttps://example.invalid/{path}"


def repin(store: Path, registry: Path, path: str, body: bytes):
    """The store's file `path` replaced by `body`, its row in `registry` pinning the new bytes."""
    (store / path).write_bytes(body)
    rows = [line.split("\t") for line in registry.read_text().splitlines()]
    made = [pin_row(row[0], path, body) if row[1:2] == [path] else "\t".join(row) for row in rows]
    registry.write_text("\n".join(made) + "\n")


def signalled(command, env, stage: str, signals) -> tuple:
    """Runs `command` and, once a line of its output starts with `stage`, sends it `signals` 2 ms
    apart; returns (its stderr, its return code). SIGINT acts as from a terminal even when the
    tests run in the background, where a shell starts them with SIGINT ignored."""
    default = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default)
    run = subprocess.Popen(command, env=env, **pipes)
    for line in run.stdout:
        if line.startswith(stage):
            for sig in signals:
                run.send_signal(sig)
                time.sleep(0.002)
            break
    _, err = run.communicate(timeout=600)
    return err, run.returncode
