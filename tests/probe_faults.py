"""Fault and bad-input probes of reproduce.py, as a user meets them: damaged checkpoints and data
stores, bad flags, runs that collide or are interrupted, settings that change. Each probe runs the
real command on gpt2-tiny with a tiny data store (no ../shared, no network) and is classed by what
came back: a clear error (non-zero exit, one "reproduce.py: ..." message, no traceback), as expected
(exit 0 and the expected effect), silent wrong (exit 0 without it), or a raw traceback. Prints a
table; exits 1 if any probe is silent wrong or a traceback.

    python tests/probe_faults.py [PATTERN]   # only the probes whose name PATTERN finds (re)
"""

import itertools
import json
import math
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import FIXTURES, REPO, repin, signalled, tiny_store  # noqa: E402
from test_finetune import tuning_store  # noqa: E402
from test_reuse import part, renamed, unit_edit  # noqa: E402

from dofmini.study.task_train import GROUP_FILES  # noqa: E402


def reproduce(model, *args, env, out):
    command = [sys.executable, str(REPO / "reproduce.py"), str(model), "--profile", "quick"]
    command += ["--limit", "0", "--variants", "fix,dof", "--out", str(out), *map(str, args)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def classify(done, expect_ok=None) -> str:
    if "Traceback" in done.stderr:
        return "raw traceback"
    if done.returncode != 0:  # one message, on one line or listing each failed file; argparse's
        usage = done.stderr.startswith("usage: ") and "reproduce.py: error: " in done.stderr
        clear = done.stderr.startswith("reproduce.py: ") or usage
        return "clear error" if clear else "raw traceback"
    return "as expected" if expect_ok and expect_ok(done) else "silent wrong"


def edit_tensors(folder: Path, change):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def main():
    only = sys.argv[1] if len(sys.argv) > 1 else ""
    with tempfile.TemporaryDirectory() as folder:
        bad = probe_library(only) + probe_all(Path(folder), only)
    sys.exit(1 if bad else 0)


def library_call(call, says: str) -> tuple:
    """(verdict, message) of a library call that must refuse its input: a ValueError, TypeError
    or RuntimeWarning whose message holds `says` is a clear error; a result is silent wrong."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            call()
    except (ValueError, TypeError, RuntimeWarning) as err:
        clear = says in str(err)
        return ("clear error" if clear else "raw traceback"), str(err)
    except Exception as err:  # noqa: BLE001 - any other failure is what the probe looks for
        return "raw traceback", f"{type(err).__name__}: {err}"
    return "silent wrong", "(returned)"


def probe_library(only: str = "") -> list:
    """Calls a vendoring engineer makes with inputs the functions cannot compute (issue 45)."""
    from dofmini import hub
    from dofmini.dof import dof_by_definition
    from dofmini.linear_attention import causal_linear_attention
    from dofmini.plain_forms import recurrent_step
    from dofmini.study.evaluate import score_requests
    from dofmini.study.finetune import accuracy
    from dofmini.study.task_train import load_split
    from dofmini.study.tasks import load_task
    from dofmini.tensor_files import save_tensors

    phi = torch.rand(1, 2, 5, 4)
    v = torch.randn(1, 2, 5, 3)
    tiny = hub.load(FIXTURES / "gpt2-tiny")
    near_e50 = torch.full((1, 2, 5, 4), math.exp(50.0))  # finite; their products are not
    far = torch.full((1, 1, 32, 8), 4.0) + torch.arange(32.0).view(1, 1, 32, 1) / 8
    squares = torch.linspace(70, 80, 32, dtype=torch.float64)  # ‖xᵢ‖²/√d: the Gram past e^70
    rounding = torch.diag((squares * 32**0.5).sqrt())  # 32 orthogonal points
    calls = [
        ("integer v", lambda: causal_linear_attention(phi, phi, v.long()), "expected a float"),
        ("negative features", lambda: causal_linear_attention(phi - 0.5, phi, v), "negative"),
        ("features on meta beside cpu", lambda: causal_linear_attention(phi, phi.to("meta"), v),
         "expected one"),
        ("features past float32's range", lambda: causal_linear_attention(
            torch.randn(1, 2, 5, 4).mul(100).exp(), phi, v), "log_space=True"),
        ("recurrent_step of 2 tokens", lambda: recurrent_step(
            phi[:, :, :2], phi[:, :, :2], v[:, :, :2], torch.zeros(1, 2, 4, 3)), "expected 1"),
        ("dof_by_definition past e^70", lambda: dof_by_definition(rounding, 1.0),
         "degrees_of_freedom"),
        ("dof_by_definition, an ill-conditioned Gram", lambda: dof_by_definition(far * 8, 2.0**-4),
         "degrees_of_freedom"),
        ("float token ids", lambda: tiny(torch.zeros(1, 4)), "ids"),
        ("load(dtype='float32')", lambda: hub.load(FIXTURES / "gpt2-tiny", dtype="float32"),
         "dtype"),
        ("features near e^50, linear space", lambda: causal_linear_attention(
            near_e50, near_e50, v), "log_space=True"),
        ("load_task(limit=-1)", lambda: load_task("arc_easy", FIXTURES / "tasks", -1), "limit -1"),
        ("load_split(split='test')", lambda: load_split("arc_easy", "test", FIXTURES / "tasks"),
         "split 'test'"),
        ("score_requests, a token id past the vocabulary", lambda: score_requests(
            tiny, [([1], [96])]), "score_requests"),
        ("accuracy of no examples", lambda: accuracy(tiny, []), "accuracy: encoded is empty"),
        ("save_tensors, one tensor under two names", lambda: save_tensors(
            {"a": v, "b": v}, Path(tempfile.gettempdir()) / "never.safetensors", {}),
         "share memory"),
    ]  # fmt: skip
    rows = []
    for name, call, says in calls:
        if re.search(only, name):
            rows.append(("library", name, *library_call(call, says)))
    print("| class | probe | verdict | what it said |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(str(c)[:160].replace("|", "/") for c in row) + " |")
    return [r for r in rows if r[2] in ("silent wrong", "raw traceback")]


def probe_all(root: Path, only: str = "") -> list:
    """Every probe under `root` (those whose name the regex `only` finds); prints the table and
    returns the silent wrong and tracebacks."""
    model, env = tiny_store(root)
    baseline = reproduce(model, env=env, out=root / "base")
    assert baseline.returncode == 0, baseline.stderr
    results = json.loads((root / "base" / "results.json").read_text())
    rows = []
    same = lambda d: json.loads(
        (Path(d.args[d.args.index("--out") + 1]) / "results.json").read_text()
    )["students"]
    strip = lambda s: {k: {f: v for f, v in r.items() if "seconds" not in f} for k, r in s.items()}

    def probe(kind, name, setup=None, args=(), expect_ok=None, out=None, model_dir=None):
        if not re.search(only, name):
            return
        case = root / f"case{len(rows)}"
        case.mkdir()
        folder, case_env = case / "gpt2-tiny", {**env}  # the folder's name is in the identity
        shutil.copytree(model_dir or model, folder)
        if setup:
            setup(folder, case, case_env)
        done = reproduce(folder, *args, env=case_env, out=case / "out" if out is None else out)
        verdict = classify(done, expect_ok)
        message = (done.stderr.strip().splitlines() or ["(exit 0)"])[0][:160]
        rows.append((kind, name, verdict, message))

    def store_copy(case_env, case):
        shutil.copytree(env["DOFMINI_DATA"], case / "store")
        case_env["DOFMINI_DATA"] = str(case / "store")
        return case / "store"

    weights = lambda f: f / "model.safetensors"
    probe(
        "checkpoint",
        "model.safetensors cut in half",
        lambda f, c, e: weights(f).write_bytes(
            weights(f).read_bytes()[: weights(f).stat().st_size // 2]
        ),
    )
    probe(
        "checkpoint",
        "header byte flipped",
        lambda f, c, e: weights(f).write_bytes(b"\x00" + weights(f).read_bytes()[1:]),
    )
    probe("checkpoint", "model.safetensors missing", lambda f, c, e: weights(f).unlink())
    probe("checkpoint", "config.json not JSON", lambda f, c, e: (f / "config.json").write_text("{"))
    probe(
        "checkpoint",
        "n_head does not divide n_embd",
        lambda f, c, e: (f / "config.json").write_text(
            (f / "config.json").read_text().replace('"n_head": 4', '"n_head": 5')
        ),
    )
    probe(
        "checkpoint",
        "a tensor of the wrong shape",
        lambda f, c, e: edit_tensors(
            f,
            lambda t: t.update(
                {"transformer.h.0.ln_1.weight": t["transformer.h.0.ln_1.weight"][:5]}
            ),
        ),
    )
    probe(
        "checkpoint",
        "a NaN in a weight",
        lambda f, c, e: edit_tensors(
            f, lambda t: t["transformer.h.0.ln_1.bias"].__setitem__(3, float("nan"))
        ),
    )
    probe(
        "checkpoint",
        "one tensor under two names",
        lambda f, c, e: edit_tensors(
            f, lambda t: t.update({"h.0.ln_1.weight": t["transformer.h.0.ln_1.weight"] * 0})
        ),
    )
    probe(
        "checkpoint",
        "weights times 1e30",
        lambda f, c, e: edit_tensors(f, lambda t: [v.mul_(1e30) for v in t.values()]),
    )
    probe(
        "checkpoint",
        "tokenizer of another model (ids past vocab_size)",
        lambda f, c, e: (
            shutil.copy(REPO.parent / "shared/weights/tokenizers/gpt2/tokenizer.json", f)
            if (REPO.parent / "shared/weights/tokenizers/gpt2").is_dir()
            else (f / "config.json").write_text(
                (f / "config.json").read_text().replace('"vocab_size": 96', '"vocab_size": 50')
            )
        ),
    )

    def tensor(name, change):
        """A setup that replaces tensor `name` by change(it), or drops it where change is None."""

        def edit(tensors):
            value = tensors.pop(name)
            tensors.update({} if change is None else {name: change(value)})

        return lambda f, c, e: edit_tensors(f, edit)

    def config(old, new):
        path = lambda f: f / "config.json"
        return lambda f, c, e: path(f).write_text(path(f).read_text().replace(old, new))

    def weight_bytes(change):
        return lambda f, c, e: weights(f).write_bytes(change(weights(f).read_bytes()))

    layer = "transformer.h.0."
    dropped = [layer + n for n in ("ln_1.weight", "attn.c_attn.weight", "attn.c_attn.bias")]
    dropped += [layer + n for n in ("attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.bias")]
    dropped += [f"transformer.{n}.weight" for n in ("wte", "wpe", "ln_f")] + [layer + "ln_2.bias"]
    for name in dropped:
        probe("checkpoint", f"{name} missing", tensor(name, None))
    inf_row = lambda x: x.index_fill(0, torch.tensor([3]), float("inf"))
    for label, name, change in [
        ("c_attn.weight transposed", layer + "attn.c_attn.weight", lambda x: x.T.contiguous()),
        ("wte one row short", "transformer.wte.weight", lambda x: x[:-1].clone()),
        ("wpe shorter than n_positions", "transformer.wpe.weight", lambda x: x[:32].clone()),
        ("ln_1.weight as int32", layer + "ln_1.weight", lambda x: x.int()),
        ("c_fc.weight as bool", layer + "mlp.c_fc.weight", lambda x: x > 0),
        ("an inf in wte", "transformer.wte.weight", inf_row),
    ]:
        probe("checkpoint", label, tensor(name, change))
    probe("checkpoint", "a tensor of a layer past n_layer", lambda f, c, e: edit_tensors(
        f, lambda t: t.update({"transformer.h.2.ln_1.weight": t[layer + "ln_1.weight"].clone()})
    ))  # fmt: skip
    for label, old, new in [
        ("n_layer missing", '"n_layer": 2,', ""),
        ("n_embd a string", '"n_embd": 32', '"n_embd": "32"'),
        ("n_layer 0", '"n_layer": 2', '"n_layer": 0'),
        ("n_layer 3 (weights for 2)", '"n_layer": 2', '"n_layer": 3'),
        ("vocab_size 200 (wte has 96)", '"vocab_size": 96', '"vocab_size": 200'),
        ("layer_norm_epsilon -1", '"layer_norm_epsilon": 1e-05', '"layer_norm_epsilon": -1'),
        ("activation relu", '"gelu_new"', '"relu"'),
        ("model_type llama", '"gpt2"', '"llama"'),
        ("n_positions 16 (ctx 64)", '"n_positions": 64', '"n_positions": 16'),
    ]:
        probe("checkpoint", f"config: {label}", config(old, new))

    def config_edit(**fields):  # keys "a.b" set key b of the object at a
        def setup(folder, case, case_env):
            config = json.loads((folder / "config.json").read_text())
            for key, value in fields.items():
                parent, _, leaf = key.replace("__", ".").rpartition(".")
                (config.setdefault(parent, {}) if parent else config)[leaf] = value
            (folder / "config.json").write_text(json.dumps(config))

        return setup

    for label, fields in [
        ("scale_attn_by_inverse_layer_idx true", dict(scale_attn_by_inverse_layer_idx=True)),
        ("scale_attn_weights false", dict(scale_attn_weights=False)),
        ("n_layer 1000000 (weights for 2)", dict(n_layer=1_000_000)),
        ("tie_word_embeddings false without lm_head", dict(tie_word_embeddings=False)),
    ]:
        probe("checkpoint", f"config: {label}", config_edit(**fields))

    def untied(folder, case, case_env):
        config_edit(tie_word_embeddings=False)(folder, case, case_env)
        edit_tensors(folder, lambda t: t.update({"lm_head.weight": torch.zeros(96, 32)}))

    probe(
        "checkpoint",
        "config: tie_word_embeddings false, its own lm_head (zeros: uniform, ppl = vocab 96)",
        untied,
        expect_ok=lambda d: (
            abs(
                json.loads((Path(d.args[d.args.index("--out") + 1]) / "results.json").read_text())[
                    "teacher"
                ]["wikitext2_ppl"]
                - 96
            )
            < 1e-3
        ),
    )
    for label, change in [
        ("empty model.safetensors", lambda b: b""),
        ("header length only", lambda b: b[:8]),
        ("last 100 bytes cut", lambda b: b[:-100]),
        ("a header length of 2^60", lambda b: (2**60).to_bytes(8, "little") + b[8:]),
    ]:
        probe("checkpoint", label, weight_bytes(change))
    probe("checkpoint", "tokenizer.json missing", lambda f, c, e: (f / "tokenizer.json").unlink())
    probe(
        "checkpoint",
        "tokenizer.json not JSON",
        lambda f, c, e: (f / "tokenizer.json").write_text("{"),
    )
    probe("checkpoint", "config.json missing", lambda f, c, e: (f / "config.json").unlink())

    def edited_in_place(folder, case, case_env):
        import os

        shutil.copytree(root / "base", case / "out")
        stat = weights(folder).stat()
        edit_tensors(folder, lambda t: t["transformer.h.0.ln_1.bias"].add_(0.5))
        os.utime(weights(folder), ns=(stat.st_atime_ns, stat.st_mtime_ns))

    probe(
        "checkpoint",
        "weights edited in place, size and mtime restored",
        edited_in_place,
        expect_ok=lambda d: "teacher.json: teacher changed" in d.stdout,
    )

    def flip_store_byte(folder, case, case_env):
        path = store_copy(case_env, case) / "wikitext-2-raw/wiki.test.raw"
        body = bytearray(path.read_bytes())
        body[100] ^= 1
        path.write_bytes(body)

    probe("data", "a store file with one byte flipped", flip_store_byte)

    def folder_for_file(folder, case, case_env):
        path = store_copy(case_env, case) / "corpus/wikipedia-heldout.txt"
        path.unlink()
        path.mkdir()

    probe("data", "a folder where a store file should be", folder_for_file)

    def non_utf8_source(folder, case, case_env):
        path = store_copy(case_env, case) / "corpus/wikipedia-heldout.txt"
        path.write_bytes(b'<doc id="1">\nA\n\n\xff\xfe\n</doc>\n')

    probe("data", "a Wikipedia source that is not UTF-8", non_utf8_source)
    probe(
        "data",
        "--data is a file",
        lambda f, c, e: (c / "x").write_text("x"),
        args=["--data", root / "base" / "results.json"],
    )

    def stale_tmp(folder, case, case_env):
        store = store_copy(case_env, case)
        (store / "wikitext-2-raw" / ".wiki.test.raw.4199999.tmp").write_bytes(b"x" * 1000)

    probe(
        "data",
        "a temporary left by a killed download",
        stale_tmp,
        expect_ok=lambda d: not list(Path(d.args[-1]).parent.glob("store/wikitext-2-raw/.*.tmp")),
    )

    def damaged(path, change):
        def setup(folder, case, case_env):
            change(store_copy(case_env, case) / path)

        return setup

    valid, heldout = "wikitext-2-raw/wiki.valid.raw", "corpus/wikipedia-heldout.txt"
    for label, path, change in [
        ("a store file missing (its URL unreachable)", valid, lambda p: p.unlink()),
        ("a store file cut short", valid, lambda p: p.write_bytes(p.read_bytes()[:-10])),
        ("a store file emptied", "corpus/wikipedia/tiny.txt", lambda p: p.write_bytes(b"")),
        ("a store file with a byte appended", heldout, lambda p: p.open("ab").write(b"x")),
    ]:  # fmt: skip
        probe("data", label, damaged(path, change))

    def registry(text):
        def setup(folder, case, case_env):
            (case / "registry.tsv").write_text(text(Path(env["DOFMINI_DATA_REGISTRY"]).read_text()))
            case_env["DOFMINI_DATA_REGISTRY"] = str(case / "registry.tsv")

        return setup

    lines = lambda t: t.splitlines(keepends=True)
    corpus_row = next(
        r for r in lines(Path(env["DOFMINI_DATA_REGISTRY"]).read_text()) if "tiny" in r
    )
    for label, edit in [
        ("a corpus row listed twice", lambda t: t + corpus_row),
        ("a registry without its header", lambda t: "".join(lines(t)[1:])),
        ("a registry without a row the run reads", lambda t: t.replace(lines(t)[1], "")),
    ]:
        probe("data", label, registry(edit))

    def reordered(folder, case, case_env):  # the same rows in another order: the same result
        registry(lambda t: lines(t)[0] + "".join(reversed(lines(t)[1:])))(folder, case, case_env)

    probe("data", "registry rows reordered", reordered,
          expect_ok=lambda d: strip(same(d)) == strip(results["students"]))  # fmt: skip
    probe("data", "$DOFMINI_DATA_REGISTRY names no file",
          lambda f, c, e: e.update(DOFMINI_DATA_REGISTRY=str(c / "absent.tsv")))  # fmt: skip
    probe(
        "data",
        "a registry row with a field missing",
        registry(lambda t: t.replace("\t", " ", 1).replace("\n", "\nwikitext2\tx\t3\n", 1)),
    )
    row = "\t".join(["corpus", "corpus/x.txt", "ten", "0" * 64, "https://example.invalid/x"])
    probe("data", "a registry row with bytes not a number", registry(lambda t: t + row + "\n"))

    for label, path in [
        ("a registry path leaving the store", "../outside.txt"),
        ("a registry path spelled twice", "corpus/wikipedia/./tiny.txt"),
    ]:
        probe("store", label, registry(lambda t, p=path: t + corpus_row.replace(
            "corpus/wikipedia/tiny.txt", p)))  # fmt: skip
    probe("store", "a mirror URL with a password",
          lambda f, c, e: e.update(DOFMINI_DATA_MIRROR="http://me:secret@127.0.0.1:9"))  # fmt: skip
    probe("store", "a mirror URL that does not parse",
          lambda f, c, e: e.update(DOFMINI_DATA_MIRROR="http://[::1"))  # fmt: skip

    def short_text(path, chars):  # its first `chars` characters, re-pinned
        def setup(folder, case, case_env):
            registry(lambda t: t)(folder, case, case_env)
            store = store_copy(case_env, case)
            repin(store, case / "registry.tsv", path, (store / path).read_bytes()[:chars])

        return setup

    for label, path, chars in [
        ("a 200-character held-out text", heldout, 200),
        ("an empty WikiText-2 test file, pinned", "wikitext-2-raw/wiki.test.raw", 0),
        ("a 40-character training corpus, pinned", "corpus/wikipedia/tiny.txt", 40),
        ("a corpus under a step's batch of windows, pinned", "corpus/wikipedia/tiny.txt", 100),
    ]:
        probe("data", label, short_text(path, chars))

    def unpinned_tasks(folder, case, case_env):  # every file in place, the tasks' rows alone
        (case / "tuned").mkdir()
        _, tuned = tuning_store(case / "tuned")
        registry = Path(tuned["DOFMINI_DATA_REGISTRY"])
        rows = registry.read_text().splitlines(keepends=True)
        registry.write_text("".join(r for r in rows if r.split("\t")[0] not in GROUP_FILES))
        case_env.update({name: tuned[name] for name in ("DOFMINI_DATA", "DOFMINI_DATA_REGISTRY")})

    probe("data", "--finetune, a registry without its rows (files in place)", unpinned_tasks,
          args=["--finetune", "--limit", "4", "--plan-only"])  # fmt: skip

    def mirror_closed(folder, case, case_env):
        (store_copy(case_env, case) / valid).unlink()
        case_env["DOFMINI_DATA_MIRROR"] = "http://127.0.0.1:9"

    probe("data", "a missing file and a mirror on a closed port", mirror_closed)

    def mirror_folder(folder, case, case_env):
        (store_copy(case_env, case) / valid).unlink()
        case_env["DOFMINI_DATA_MIRROR"] = str(case / "mirror")  # a plain path, not a URL

    probe("data", "a missing file and DOFMINI_DATA_MIRROR a plain folder path", mirror_folder)
    probe("data", "--data a folder that does not exist (every file missing)",
          args=["--data", root / "nowhere"])  # fmt: skip

    flags = ["--lam 0", "--lam nan", "--lam 1e20", "--budgets 0", "--budgets 100000000",
             "--budgets 8,x", "--seeds 5,5", "--loss kl", "--variants hedgehog", "--J 1",
             "--device cuda", "--device cuda:7", "--limit -1", "--lam -1", "--lam inf", "--lam x",
             "--J 0", "--J -5", "--J x", "--J 1000000000", "--budgets -4", "--budgets ,",
             "--seeds a", "--seeds -1", "--loss l2,l2", "--variants fix,fix", "--variants ,",
             "--device tpu", "--limit x", "--profile nope"]  # fmt: skip
    for flag in flags:
        probe("flags", flag, args=flag.split())
    for flag in ("--variants", "--budgets", "--seeds", "--loss"):
        probe("flags", f"{flag} ''", args=[flag, ""])
    probe("flags", "--out a 300-character name", out=root / ("a" * 300))
    probe("flags", "--data a 300-character name", args=["--data", root / ("d" * 300)])
    outside = ["--budgets 4", "--curve-dims 8"]  # budgets past the curves; one curve dim
    for oracle, more in itertools.product(("oracle", "oracle_e2e"), outside):
        probe("flags", f"--variants fix,{oracle} {more}",
              args=["--variants", f"fix,{oracle}", *more.split()])  # fmt: skip
    idle = ["--curve-dims 4,8", "--finetune-select 5", "--variants performer --loss l2",
            "--variants none --heldout-skip 3", "--variants none --batch-per-device 1"]  # fmt: skip
    warned = lambda done: ": warning: " in done.stdout and ", so not used" in done.stdout  # noqa: E731
    for flag in idle:  # a value the run will not use: warned about, the run as it would be
        probe("flags", f"{flag} (not used)", args=flag.split(), expect_ok=warned)
    probe("flags", "--out ''", out="")
    probe(
        "flags",
        "--out a file",
        lambda f, c, e: (c / "file").write_text("x"),
        out=root / "base" / "results.json",
    )
    command = [sys.executable, str(REPO / "reproduce.py"), "gtp2"]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if re.search(only, "a mistyped model name (gtp2)"):
        rows.append(("flags", "a mistyped model name (gtp2)", classify(done), done.stderr.strip()))

    held = []

    def locked(folder, case, case_env):
        import fcntl

        (case / "out").mkdir()
        lock = open(case / "out" / ".lock", "w")  # held until the probe ends
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write("4242")
        lock.flush()
        held.append(lock)

    probe("runs", "a second run into a folder in use", locked)

    def planted_lock(folder, case, case_env):
        (case / "out").mkdir()
        (case / "target").write_text("precious")
        (case / "out" / ".lock").symlink_to(case / "target")

    probe("runs", "a .lock link planted in --out", planted_lock)

    def swapped_student(folder, case, case_env):
        shutil.copytree(root / "base", case / "out")
        students = case / "out" / "students"
        shutil.copy(
            students / "fix-softmax-b8-s0.safetensors", students / "dof-softmax-b8-s0.safetensors"
        )

    probe(
        "runs",
        "another student's tensors under a student's name",
        swapped_student,
        expect_ok=lambda d: strip(same(d)) == strip(results["students"]),
    )
    probe(
        "runs",
        "a changed λ redoes the allocation only",
        lambda f, c, e: shutil.copytree(root / "base", c / "out"),
        args=["--lam", "0.5"],
        expect_ok=lambda d: (
            "allocation.json: lam changed" in d.stdout and "teacher.json: " not in d.stdout
        ),
    )
    probe(
        "runs",
        "a second fresh run gives the same numbers",
        expect_ok=lambda d: strip(same(d)) == strip(results["students"]),
    )

    def damaged_run(name, change):
        def setup(folder, case, case_env):
            shutil.copytree(root / "base", case / "out")
            change(case / "out" / name)

        return setup

    def garbage_progress(path):  # with its twin gone too, so that it is trained again
        path.unlink()
        path.with_name(path.name.replace("fix-", "dof-")).unlink()
        path.with_name(path.name + ".progress").write_bytes(b"garbage")

    cut = lambda size: lambda p: p.write_bytes(p.read_bytes()[:size])
    other = lambda name: lambda p: shutil.copy(p.with_name(name), p)
    b8 = "softmax-b8-s0"
    for label, name, change in [
        ("teacher.json cut short", "teacher.json", lambda p: p.write_text(p.read_text()[:20])),
        ("allocation.json not JSON", "allocation.json", lambda p: p.write_text("{")),
        ("allocation.json's result {}", "allocation.json", lambda p: p.write_text(json.dumps(
            {**json.loads(p.read_text()), "result": {}}))),  # fmt: skip
        ("a token cache cut short", "tokens-train.npy", cut(200)),
        ("a token cache of other text", "tokens-train.npy", other("tokens-heldout.npy")),
        ("results.json deleted", "results.json", lambda p: p.unlink()),
        ("a student file cut short", f"students/dof-{b8}.safetensors", cut(300)),
        ("a progress file of garbage", f"students/fix-{b8}.safetensors", garbage_progress),
        ("an eval file of another student", f"eval/dof-{b8}.json", other(f"fix-{b8}.json")),
    ]:  # fmt: skip
        probe("runs", label, damaged_run(name, change),
              expect_ok=lambda d: strip(same(d)) == strip(results["students"]))  # fmt: skip

    redone = lambda d: "redo: " in d.stdout and strip(same(d)) == strip(results["students"])  # noqa: E731
    unit = "units/softmax-l0-m8-s0.safetensors"
    for label, name, change in [
        ("an evaluation part emptied, its key kept", "teacher.json", part("wikitext2", {})),
        ("a unit of 4 features under an 8-feature key", unit,
         unit_edit(lambda t: {n: v[:, :4].clone() for n, v in t.items()})),
        ("a unit holding another layer's names", unit, unit_edit(renamed)),
        ("a unit of NaNs", unit, unit_edit(lambda t: {n: v * math.nan for n, v in t.items()})),
    ]:  # fmt: skip
        probe("runs", label, damaged_run(name, change), expect_ok=redone)

    probe("runs", "--plan-only leaves no --out behind", args=["--plan-only"],
          expect_ok=lambda d: not Path(d.args[d.args.index("--out") + 1]).exists())  # fmt: skip
    twice = [signal.SIGINT] * 10  # 2 ms apart: some land during the first's unwinding and exit
    interrupts = [([signal.SIGINT], "[3/"), (twice, "[3/"), ([signal.SIGKILL], "[4/")]
    interrupts.append(([signal.SIGTERM], "[4/"))
    for sigs, at in interrupts if not only else []:
        sig, name = sigs[0], f"{sigs[0].name} x{len(sigs)}"
        case = root / f"interrupt-{name}"
        case.mkdir()
        command = [sys.executable, str(REPO / "reproduce.py"), str(model), "--profile", "quick"]
        command += ["--limit", "0", "--variants", "fix,dof", "--out", str(case / "out")]
        err, code = signalled(command, env, at, sigs)
        # a kill leaves no message by nature; what counts is that the rerun is whole
        verdict = classify(subprocess.CompletedProcess([], code, "", err))
        verdict = "as expected" if sig == signal.SIGKILL and not err else verdict
        if sig != signal.SIGKILL and list((case / "out").rglob(".*.tmp")):
            verdict = "silent wrong"  # a temporary left behind
        rows.append(("runs", f"{name} at stage {at[1:-1]}", verdict, err.strip()[:140]))
        again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        resumed = again.returncode == 0 and strip(
            json.loads((case / "out" / "results.json").read_text())["students"]
        ) == strip(results["students"])
        verdict = "as expected" if resumed else "silent wrong"
        rows.append(
            ("runs", f"rerun after {name} equals an uninterrupted run", verdict, "(exit 0)")
        )

    print("| class | probe | verdict | what it said |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(str(c).replace("|", "/") for c in row) + " |")
    bad = [r for r in rows if r[2] in ("silent wrong", "raw traceback")]
    print(f"\n{len(rows)} probes; {len(bad)} silent wrong or raw traceback")
    return bad


if __name__ == "__main__":
    main()
