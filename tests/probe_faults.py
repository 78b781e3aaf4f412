"""Fault and bad-input probes of reproduce.py, as a user meets them: damaged checkpoints and data
stores, bad flags, runs that collide or are interrupted, settings that change. Each probe runs the
real command on gpt2-tiny with a tiny data store (no ../shared, no network) and is classed by what
came back: a clear error (non-zero exit, one "reproduce.py: ..." message, no traceback), as expected
(exit 0 and the expected effect), silent wrong (exit 0 without it), or a raw traceback. Prints a
table; exits 1 if any probe is silent wrong or a traceback.

    python tests/probe_faults.py
"""

import json
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from conftest import REPO, tiny_store  # noqa: E402


def reproduce(model, *args, env, out):
    command = [sys.executable, str(REPO / "reproduce.py"), str(model), "--profile", "quick"]
    command += ["--limit", "0", "--variants", "fix,dof", "--out", str(out), *map(str, args)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def classify(done, expect_ok=None) -> str:
    if "Traceback" in done.stderr:
        return "raw traceback"
    if done.returncode != 0:  # one message, on one line or listing each failed file
        return "clear error" if done.stderr.startswith("reproduce.py: ") else "raw traceback"
    return "as expected" if expect_ok and expect_ok(done) else "silent wrong"


def edit_tensors(folder: Path, change):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def main():
    root = Path(tempfile.mkdtemp())
    model, env = tiny_store(root)
    baseline = reproduce(model, env=env, out=root / "base")
    assert baseline.returncode == 0, baseline.stderr
    results = json.loads((root / "base" / "results.json").read_text())
    rows = []

    def probe(kind, name, setup=None, args=(), expect_ok=None, out=None, model_dir=None):
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
    flags = ["--lam 0", "--lam nan", "--lam 1e20", "--budgets 0", "--budgets 100000000",
             "--budgets 8,x", "--seeds 5,5", "--seed 3 --seeds 1", "--loss softmax:32", "--loss kl",
             "--variants hedgehog", "--J 1", "--sweep", "--device cuda", "--device cuda:7",
             "--limit -1"]  # fmt: skip
    for flag in flags:
        probe("flags", flag, args=flag.split())
    probe("flags", "--out ''", out="")
    command = [sys.executable, str(REPO / "reproduce.py"), "gtp2"]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
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

    def swapped_student(folder, case, case_env):
        shutil.copytree(root / "base", case / "out")
        students = case / "out" / "students"
        shutil.copy(
            students / "fix-softmax-b8-s0.safetensors", students / "dof-softmax-b8-s0.safetensors"
        )

    same = lambda d: json.loads(
        (Path(d.args[d.args.index("--out") + 1]) / "results.json").read_text()
    )["students"]
    strip = lambda s: {k: {f: v for f, v in r.items() if "seconds" not in f} for k, r in s.items()}
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

    case = root / "interrupt"
    case.mkdir()
    command = [sys.executable, str(REPO / "reproduce.py"), str(model), "--profile", "quick"]
    command += ["--limit", "0", "--variants", "fix,dof", "--out", str(case / "out")]
    run = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    for line in run.stdout:
        if line.startswith("[3/"):
            run.send_signal(signal.SIGINT)
            break
    _, err = run.communicate(timeout=300)
    rows.append(
        (
            "runs",
            "Ctrl-C mid-run",
            classify(subprocess.CompletedProcess([], run.returncode, "", err)),
            err.strip()[:140],
        )
    )
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    resumed = again.returncode == 0 and strip(
        json.loads((case / "out" / "results.json").read_text())["students"]
    ) == strip(results["students"])
    rows.append(
        (
            "runs",
            "rerun after Ctrl-C equals an uninterrupted run",
            "as expected" if resumed else "silent wrong",
            "(exit 0)",
        )
    )

    print("| class | probe | verdict | what it said |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(str(c).replace("|", "/") for c in row) + " |")
    bad = [r for r in rows if r[2] in ("silent wrong", "raw traceback")]
    print(f"\n{len(rows)} probes; {len(bad)} silent wrong or raw traceback")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
