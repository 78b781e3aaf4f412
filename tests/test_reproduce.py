"""`reproduce.py` end to end on the GPT-2 stand-in (quick profile): every student of a seeds ×
budgets grid, reruns that recompute nothing, a changed flag that recomputes what it touches,
one-line errors for bad values before any model work, and the vendorability of the modules the
README says can be copied alone. First runs, signals, the lock and offline runs go through a new
process (`reproduce`); reruns and refusals run in this one (conftest's reproduce_here)."""

import ast
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import FIXTURES, REPO, data_path, repin, shared_path, signalled, tiny_store
from safetensors.torch import load_file, save_file

TASKS = {"piqa", "arc_easy", "arc_challenge", "winogrande", "wsc273", "mmlu", "logiqa", "lambada"}
TRAINING_LINE = re.compile(r"^(softmax|l2|direct) \d+/\d+: loss", re.M)  # distill's progress lines
VENDORABLE = {"linear_attention.py": {"torch"}, "dof.py": {"torch"}, "model.py": {"torch"},
              "plain_forms.py": {"torch"}, "log_space.py": {"torch"},
              "checks.py": set(),
              "generate.py": {"torch"}, "study/tasks.py": set(),
              "study/stats.py": set(), "study/oracle.py": {"torch"}}  # fmt: skip


def test_the_whole_pipeline_runs_in_a_fresh_clone_then_reruns_computing_nothing(tmp_path):
    model, env = tiny_store(tmp_path)
    out = tmp_path / "out"
    first = reproduce(model, "--profile", "quick", "--limit", "0", "--out", out, env=env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert {s.split("/")[0] for s in results["students"]} == {
        "performer",
        "dijiang",
        "fix",
        "dof",
        "dof_clip",
    }
    assert all(s["wikitext2_ppl"] > 1 for s in results["students"].values())
    assert results["inputs"]["corpus/wikipedia/tiny.txt"] and (out / "report.md").is_file()
    held_out = results["held_out"]  # the tiny store's held-out text has no titles: one article
    assert sorted(held_out) == ["curves", "e2e", "errors", "swaps"]
    assert all(role["article_count"] == len(set(role["articles"])) for role in held_out.values())
    drawn = [w for role in held_out.values() for w in role["windows"]]
    assert len(drawn) == len(set(drawn)) and results["e2e_articles"] == held_out["e2e"]["articles"]
    assert TRAINING_LINE.search(first.stdout)
    again = reproduce(model, "--profile", "quick", "--limit", "0", "--out", out, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "redo:" not in again.stdout and not TRAINING_LINE.search(again.stdout)
    assert json.loads((out / "results.json").read_text())["students"] == results["students"]


def reproduce(*args, timeout=900, env=None):  # a hang guard, not a speed claim
    return subprocess.run([sys.executable, str(REPO / "reproduce.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=env)  # fmt: skip


@pytest.fixture(scope="module")
def grid_run(tmp_path_factory):
    """Seeds 0, 1, budgets 8, 16: Fix, DoF and both oracles, on the quick profile, no tasks; the
    curves at 8, 16 and 32 (32, past the budgets, is a Fix student trained for the curves alone)."""
    model = shared_path("weights", "standin-gpt2")
    store = data_path()
    out = tmp_path_factory.mktemp("grid")
    args = [model, "--profile", "quick", "--out", out, "--data", store]
    # oracle_e2e's dims come from the saved swap curves: the rerun's plan marks it done too
    args += ["--seeds", "0,1", "--budgets", "8,16"]
    args += ["--variants", "performer,fix,dof,oracle,oracle_e2e", "--curve-dims", "8,16,32"]
    args += ["--limit", "0"]
    first = reproduce(*args)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    return args, out, first


def test_grid_has_every_variant_budget_and_seed(grid_run):
    _, out, first = grid_run
    results = json.loads((out / "results.json").read_text())
    expected = {f"{v}/{loss}/b{b}/s{s}" for v, loss in
                (("performer", "none"), ("fix", "softmax"), ("dof", "softmax"),
                 ("oracle", "softmax"), ("oracle_e2e", "softmax")) for b in (8, 16)
                for s in (0, 1)}  # fmt: skip
    assert set(results["students"]) == expected
    for name, student in results["students"].items():
        assert sum(student["dims"]) == 6 * student["budget"], name
        assert set(student["layer_error"]) == {"kernel_l2", "kl", "output_rel", "kl_heads"}
        assert [len(heads) for heads in student["layer_error"]["kl_heads"]] == [4] * 6
        assert student["tasks"] == {} and student["wikitext2_ppl"] > 1
        if not name.startswith("performer"):
            assert student["loss_curve"] and "layer_error_before" in student
    curves = results["curves"]
    assert curves["dims"] == [8, 16, 32] and set(curves["kl"]) == {"0", "1"}
    assert all(len(curves["oracle"][b]) == 6 for b in ("8", "16"))
    assert np.shape(curves["kl_heads"]["1"]) == (3, 6, 4)  # [M][layer][head]
    assert results["config"]["seeds"] == [0, 1] and results["provenance"]["dofmini"]
    assert not any(str(out) in json.dumps(v) for v in results["inputs"].values())
    text = (out / "report.md").read_text()
    assert "dof − fix, softmax loss, budget 16 (2 seeds)" in text and "Spearman" in text
    assert "| heads |" in text and "| layers, DoF mean over heads |" in text  # the evidence
    assert "| fix/softmax/b16 (steps 1/2/4) |" in text  # the flattening table
    assert curves["curve_only_train_seconds"] > 0
    # every (layer, M, seed) the softmax students and the curves hold is one unit, trained once
    layerwise = [s for s in results["students"].values() if s["loss"] == "softmax"]
    units = {(i, m, s["seed"]) for s in layerwise for i, m in enumerate(s["dims"])}
    units |= {(i, m, seed) for seed in (0, 1) for m in curves["dims"] for i in range(6)}
    cost = results["bank"]
    assert cost["units"] == len(units) < cost["layer_trainings_alone"]
    assert cost["unit_train_seconds"] > 0 and f"from {len(units)} layer units" in text
    # at budget 8, the least of curve_dims, the oracle can only give every layer 8 (Fix's dims):
    # its student is Fix's training, copied, not trained again
    for seed in (0, 1):
        oracle, fix = (results["students"][f"{v}/softmax/b8/s{seed}"] for v in ("oracle", "fix"))
        assert oracle["same_training_as"] == f"fix/softmax/b8/s{seed}"
        assert oracle["layer_error"] == fix["layer_error"] and oracle["dims"] == [8] * 6
    assert "copied" in first.stdout
    assert "[1/" in first.stdout and "plan (" in first.stdout


def test_rerun_recomputes_nothing(grid_run, reproduce_here):
    args, out, _ = grid_run
    before = (out / "results.json").read_text()
    again = reproduce_here(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "redo:" not in again.stdout and not TRAINING_LINE.search(again.stdout)
    planned = re.search(r"\n  (\d+) of (\d+) stages done\n", again.stdout)  # all marked done
    assert planned and planned[1] == planned[2] and "  dof/softmax/b8/s1: done" in again.stdout
    after = json.loads((out / "results.json").read_text())
    assert after["students"] == json.loads(before)["students"]


def test_changed_flag_recomputes_what_it_touches(grid_run, tmp_path, reproduce_here):
    args, out, _ = grid_run
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(out), str(copy)], check=True)
    args = [str(copy) if a == out else a for a in args]
    changed = reproduce_here(*args, "--lam", "0.5")
    assert changed.returncode == 0, changed.stderr[-3000:]
    redo = f"redo: {copy / 'allocation.json'}: lam changed"
    assert redo in changed.stdout
    planned = rf"\n  DoF estimate: ~[^\n]+; {re.escape(redo)}\n"  # the plan says why, first
    assert re.search(planned, changed.stdout.split("[1/", 1)[0])
    assert f"redo: {copy / 'teacher.json'}" not in changed.stdout  # λ does not touch the teacher
    results = json.loads((copy / "results.json").read_text())
    assert results["dof"]["lam"] == 0.5 == results["config"]["lam"]


def test_a_damaged_student_file_is_trained_again(grid_run, tmp_path, reproduce_here):
    args, out, _ = grid_run
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(out), str(copy)], check=True)
    args = [str(copy) if a == out else a for a in args]
    student = copy / "students" / "dof-softmax-b16-s1.safetensors"
    student.write_bytes(student.read_bytes()[:300])
    again = reproduce_here(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"redo: cannot read {student}" in again.stdout
    assert "dof/softmax/b16/s1: dims" in again.stdout  # trained again, nothing else
    assert again.stdout.count(": dims [") == 1, again.stdout
    before = json.loads((out / "results.json").read_text())["students"]["dof/softmax/b16/s1"]
    after = json.loads((copy / "results.json").read_text())["students"]["dof/softmax/b16/s1"]
    assert after["layer_error"] == before["layer_error"]


def test_a_resumed_run_reports_in_the_order_of_an_uninterrupted_one(
    grid_run, tmp_path, reproduce_here
):
    """Students whose files are missing are evaluated after the others; the report still lists
    every rule in plan order, as the uninterrupted run did."""
    args, out, _ = grid_run
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(out), str(copy)], check=True)
    args = [str(copy) if a == out else a for a in args]
    for seed in (0, 1):  # the whole dof/b8 group: it is assembled again from its layer units
        (copy / "students" / f"dof-softmax-b8-s{seed}.safetensors").unlink()
    again = reproduce_here(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count(": dims [") == 2, again.stdout

    def order(folder):
        text = (folder / "report.md").read_text()
        verdicts = re.findall(r"^- (\S+): (?:better|worse|inconclusive|cannot)", text, re.M)
        sections = re.findall(r"^\*\*(\S+ − fix, .+)\*\*$", text, re.M)
        return verdicts, sections

    verdicts, sections = order(out)
    assert "dof/softmax/b8" in verdicts
    assert "dof − fix, softmax loss, budget 8 (2 seeds)" in sections
    assert order(copy) == (verdicts, sections)


@pytest.mark.parametrize("args, message", [
    (["gpt5"], "unknown model 'gpt5'"),
    (["{empty}"], "has no config.json"),
    (["{tiny}", "--variants", "fix,hedgehog"], "unknown variant 'hedgehog'"),
    (["{tiny}", "--loss", "kl"], "unknown loss 'kl'"),
    (["{tiny}", "--lam", "0"], "--lam 0.0: expected a positive finite number"),
    (["{tiny}", "--lam", "-1"], "--lam -1.0: expected a positive finite number"),
    (["{tiny}", "--lam", "nan"], "--lam nan: expected a positive finite number"),
    (["{tiny}", "--limit", "-1"], "--limit -1: expected 0 (no tasks) or more"),
    (["{tiny}", "--seeds", "0,-3"], "--seeds -3: expected 0.."),
    (["{tiny}", "--seeds", "5,5"], "--seeds 5,5: a value appears twice"),
    (["{tiny}", "--variants", "fix,fix"], "--variants fix,fix: a value appears twice"),
    (["{tiny}", "--loss", "l2,softmax,l2"], "--loss l2,softmax,l2: a value appears twice"),
    (["{tiny}", "--seeds", str(2**40)], f"--seeds {2**40}: expected 0.."),
    (["{tiny}", "--budgets", "0"], "--budgets 0: expected 1..4096 features per layer"),
    (["{tiny}", "--budgets", "8,x"], "--budgets '8,x': expected comma-separated integers"),
    (["{tiny}", "--out", "{file}"], "exists and is not a directory"),
    (["{tiny}", "--out", ""], "--out '': expected a folder"),
    (["{tiny}", "--variants", ""], "--variants '': expected a value, or no flag"),
    (["{tiny}", "--budgets", ""], "--budgets '': expected a value"),
    (["{tiny}", "--seeds", ""], "--seeds '': expected a value"),
    (["{tiny}", "--loss", ""], "--loss '': expected a value"),
    (["{tiny}", "--out", "{long}"], "/" + "a" * 300 + ": File name too long"),
    (["{tiny}", "--data", "{long}"], "/" + "a" * 300 + ": File name too long"),
    (["{long}"], "/" + "a" * 300 + ": File name too long"),
    (["gtp2"], "unknown model 'gtp2'"),
    (["{tiny}", "--budgets", "100000000"], "--budgets 100000000: expected 1..4096"),
    (["{tiny}", "--J", "1"], "--J 1: expected 2 or more"),
    (["{tiny}", "--batch-per-device", "0"], "--batch-per-device 0: expected 1 or more windows"),
    (["{tiny}", "--device", "cuda:7"], "--device cuda:7 is not available here"),
    (["{tiny}", "--device", "tpu"], "--device tpu is not available here"),
    (["{tiny}", "--data", "{file}"], "is a file; expected the data store's folder"),
])  # fmt: skip
def test_bad_values_give_one_line_before_model_work(tmp_path, args, message, reproduce_here):
    (tmp_path / "file").write_text("x")
    fill = {"{empty}": tmp_path, "{tiny}": FIXTURES / "gpt2-tiny", "{file}": tmp_path / "file"}
    fill["{long}"] = tmp_path / ("a" * 300)  # one name longer than the system allows
    env = {"PATH": "", "DOFMINI_DATA": str(tmp_path / "store"), "HOME": str(tmp_path)}
    result = reproduce_here(*[fill.get(a, a) for a in args], env=env)
    assert result.returncode != 0
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""  # stopped before any work


@pytest.mark.parametrize("registry, message", [
    (None, "absent.tsv: No such file"),
    ("group\tpath\tbytes\tsha256\turl\nwikitext2\tx\t3\n", "line 2: 'wikitext2\\tx\\t3'"),
    ("group\tpath\tbytes\tsha256\turl\ncorpus\tx\tten\t" + "0" * 64 + "\thttps://h/x\n",
     "expected a group"),
    ("corpus\tx\t3\t" + "0" * 64 + "\thttps://h/x\n", "line 1: ['corpus\\tx\\t3"),
])  # fmt: skip
def test_a_bad_data_registry_is_one_line_naming_it(tmp_path, registry, message, reproduce_here):
    path = tmp_path / "absent.tsv"
    if registry:
        path.write_text(registry)
    env = {"PATH": "", "HOME": str(tmp_path), "DOFMINI_DATA_REGISTRY": str(path)}
    args = ["--data", tmp_path / "store", "--out", tmp_path / "out"]
    result = reproduce_here(FIXTURES / "gpt2-tiny", *args, env=env)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"reproduce.py: error: cannot read {path}: ") or (
        str(path) in result.stderr and message in result.stderr
    ), result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="this machine has CUDA, so cuda is valid here"
)
def test_cuda_without_cuda_is_refused(reproduce_here):
    result = reproduce_here(FIXTURES / "gpt2-tiny", "--device", "cuda")
    assert result.returncode != 0 and "--device cuda is not available" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("module", sorted(VENDORABLE))
def test_vendorable_module_imports_only_torch_numpy_stdlib(module):
    tree = ast.parse((REPO / "dofmini" / module).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}  # fmt: skip
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # siblings a vendored module may bring: vendorable ones (checks.py)
                assert f"{node.module}.py" in VENDORABLE, f"{module} imports {node.module}"
                continue
            imported.add(node.module.split(".")[0])
    outside = {name for name in imported if name not in sys.stdlib_module_names}
    outside -= VENDORABLE[module]
    assert not outside, (
        f"{module} imports {outside}; it may use only {VENDORABLE[module] or 'stdlib'}"
    )


def test_quick_run_fills_an_empty_store_through_a_mirror(data_mirror, tmp_path, reproduce_here):
    mirror = data_mirror(data_path())
    model = tmp_path / "standin"
    shutil.copytree(shared_path("weights", "standin-gpt2"), model)
    env = {**os.environ, "DOFMINI_DATA": str(tmp_path / "store"), "DOFMINI_DATA_MIRROR": mirror.url}
    # Fix alone: the other variants read no data file it does not (the fresh clone's run, above,
    # trains all five)
    args = ["--profile", "quick", "--variants", "fix", "--out", tmp_path / "out"]
    result = reproduce_here(model, *args, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(results["students"]) == ["fix/softmax/b64/s0"]
    assert set(results["teacher"]["tasks"]) == set(TASKS)
    assert len(mirror.requests) == 86  # every file of the store, each fetched once
    assert all(path in results["inputs"] for path in mirror.requests)


def closed_port_url() -> str:
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{closed.getsockname()[1]}"


def offline_env(tmp_path) -> dict:
    """A first run with nothing downloaded and every source unreachable: the hub and the data;
    temporary files (the listing of what is missing) under tmp_path/tmp."""
    url = closed_port_url()
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {**os.environ, "DOFMINI_DATA": str(tmp_path / "store"), "DOFMINI_DATA_MIRROR": url}
    env["TMPDIR"] = str(tmp_path / "tmp")
    return {**env, "DOFMINI_WEIGHTS": str(tmp_path / "weights"), "HF_ENDPOINT": closed_port_url()}


def missing_listing(stderr: str) -> str:
    """The file an offline run's message names, listing each missing file's URL and path."""
    return open(re.search(r"destination are in (\S+)\.\n", stderr)[1]).read()


def test_offline_attempts_keep_one_listing_a_store(tmp_path):
    """Each attempt replaces the store's listing of what is missing: no trail of them in the
    temporary folder."""
    env = offline_env(tmp_path)
    for _ in range(2):
        result = reproduce("gpt2", "--out", tmp_path / "out", env=env, timeout=120)
        assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    listings = [p.name for p in (tmp_path / "tmp").iterdir() if p.name.startswith("dofmini-")]
    assert len(listings) == 1 and listings[0].startswith("dofmini-missing-"), listings
    assert "gpt2" in missing_listing(result.stderr)


@pytest.mark.parametrize("missing", ["data", "weights"])
def test_offline_first_run_names_the_host_and_every_missing_file(tmp_path, missing):
    """Nothing downloaded: the weights and the data are named; with the data in place, the
    weights alone."""
    env, out = offline_env(tmp_path), tmp_path / "out"
    if missing == "weights":
        env["DOFMINI_DATA"] = str(data_path())
    result = reproduce("gpt2", "--out", out, env=env, timeout=600)
    assert result.returncode != 0 and "plan (each" not in result.stdout  # before any model work
    assert "Traceback" not in result.stderr and result.stderr.count("reproduce.py: error:") == 1
    hub_url = f"{env['HF_ENDPOINT']}/openai-community/gpt2/resolve/main"
    mirror, host = env["DOFMINI_DATA_MIRROR"], env["HF_ENDPOINT"].removeprefix("http://")
    weights, data = ["model.safetensors", "tokenizer.json"], ["wikitext-2-raw/wiki.test.raw"]
    expected = [(f"{hub_url}/{f}", tmp_path / "weights" / "gpt2" / f) for f in weights]
    if missing == "data":
        stored = [*data, "piqa/valid.jsonl"]
        expected += [(f"{mirror}/{f}", tmp_path / "store" / f) for f in stored]
    listed = missing_listing(result.stderr)
    for url, dest in expected:
        assert f"{url}\n      -> {dest}" in listed
    assert f"weights of gpt2: 3 file(s) from {host} (unreachable: " in result.stderr
    has_data = f"data: 86 file(s), 31.2 MB, from {mirror.removeprefix('http://')}"
    assert (has_data in result.stderr) == (missing == "data")
    assert not out.exists()
    made = [p for p in tmp_path.rglob("*") if p.is_file() and p.parent != tmp_path / "tmp"]
    assert not made  # nothing fetched, not in part


def test_plan_only_with_nothing_downloaded_lists_what_is_missing(tmp_path):
    env, out = offline_env(tmp_path), tmp_path / "out"
    result = reproduce("gpt2", "--plan-only", "--out", out, env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "not here yet (the stages" in result.stdout and "weights, 3 file(s)" in result.stdout
    assert "data, 86 file(s), 31.2 MB" in result.stdout and "86 to download" not in result.stderr
    assert "estimate: it times the run's work on the weights and data" in result.stdout
    assert not out.exists()


def test_a_second_run_into_the_same_folder_stops_naming_the_first(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write("4242")
        lock.flush()
        result = reproduce(FIXTURES / "gpt2-tiny", "--out", out, env=offline_env(tmp_path))
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert f"--out {out} is in use by another run (PID 4242)" in result.stderr


def test_offline_run_stops_before_model_work_naming_every_missing_file(tmp_path):
    env, store, out = offline_env(tmp_path), tmp_path / "store", tmp_path / "out"
    url = env["DOFMINI_DATA_MIRROR"]
    result = reproduce(FIXTURES / "gpt2-tiny", "--profile", "quick", "--out", out, env=env)
    assert result.returncode != 0 and "plan (each" not in result.stdout
    assert "Traceback" not in result.stderr and "weights of" not in result.stderr
    listed = missing_listing(result.stderr)
    for path in (f"{url}/wikitext-2-raw/wiki.test.raw", str(store / "piqa" / "valid.jsonl")):
        assert path in listed
    assert not store.exists() or not any(p.is_file() for p in store.rglob("*"))
    assert not out.exists()


def overflowing_copy(model, root):
    """gpt2-tiny with every weight times 1e30: finite in float32, but its forward pass overflows."""
    from safetensors.torch import load_file, save_file

    folder = root / "huge"
    shutil.copytree(model, folder)
    tensors = {n: t * 1e30 for n, t in load_file(str(model / "model.safetensors")).items()}
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("case, message", [
    ("J", "--J 2048 is more than the 1024 queries and keys per head"),
    ("huge", "the teacher's logits on random tokens are not finite"),
    ("lam", ""),
])  # fmt: skip
def test_what_only_the_model_and_data_reveal_ends_in_one_line(
    tmp_path, case, message, reproduce_here
):
    model, env = tiny_store(tmp_path)
    args = ["--profile", "quick", "--limit", "0", "--variants", "fix,dof", "--out", tmp_path / "o"]
    args += {"J": ["--J", "2048"], "lam": ["--lam", "1e20"]}.get(case, [])
    model = overflowing_copy(model, tmp_path) if case == "huge" else model
    result = reproduce_here(model, *args, env=env)
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    if message:
        assert result.returncode != 0 and message in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


STEP = "a step's 2 windows of ctx 64, as the estimate times it"  # the quick profile's batch


@pytest.mark.parametrize("path, chars, message", [
    ("wikitext-2-raw/wiki.test.raw", 0, "0 tokens; 64 needed (a window of ctx 64)"),
    ("corpus/wikipedia/tiny.txt", 40, f"40 tokens; 128 needed ({STEP})"),
    ("corpus/wikipedia/tiny.txt", 100, f"100 tokens; 128 needed ({STEP})"),
])  # fmt: skip
def test_a_pinned_text_too_short_is_one_line_naming_it_before_any_work(
    tmp_path, path, chars, message, reproduce_here
):
    """An empty WikiText-2 test file, a corpus under a window or under a step's batch of them, each
    pinned as it is: one line naming the file, its tokens and the need (a tokenizer of one id a
    character: chars are tokens), and no stage begun."""
    model, env = tiny_store(tmp_path)
    store = tmp_path / "store"
    repin(store, tmp_path / "registry.tsv", path, (store / path).read_bytes()[:chars])
    args = ["--profile", "quick", "--limit", "0", "--variants", "fix,dof", "--out", tmp_path / "o"]
    result = reproduce_here(model, *args, env=env)
    assert result.returncode == 1 and "[1/" not in result.stdout
    assert result.stderr == f"reproduce.py: error: {store / path}: {message}\n", result.stderr


def test_ctrl_c_says_how_to_resume(tmp_path):
    model, env = tiny_store(tmp_path)
    args = [sys.executable, str(REPO / "reproduce.py"), str(model), "--profile", "quick"]
    args += ["--limit", "0", "--out", str(tmp_path / "o")]
    err, code = signalled(args, env, "[1/", [signal.SIGINT])  # once the stages have begun
    assert code != 0 and "Traceback" not in err
    assert "interrupted; run the same command again to resume" in err


def interrupted_twice_or_terminated(tmp_path, rerun, signals, stage="[1/"):
    """A quick run on the tiny store, sent `signals` (2 ms apart) once `stage` begins; then the
    same command again, by rerun (reproduce_here): (the interrupted run's stderr, its return code,
    the rerun)."""
    model, env = tiny_store(tmp_path)
    args = [str(model), "--profile", "quick", "--limit", "0", "--variants", "fix"]
    args += ["--out", str(tmp_path / "o")]
    command = [sys.executable, str(REPO / "reproduce.py"), *args]
    err, code = signalled(command, env, stage, signals)
    return err, code, rerun(*args, env=env)


def test_ctrl_c_repeated_ms_apart_ends_in_one_line_and_the_run_resumes(tmp_path, reproduce_here):
    """Ten in 20 ms: before, one landing in the exit's atexit callbacks printed a traceback."""
    err, code, again = interrupted_twice_or_terminated(
        tmp_path, reproduce_here, [signal.SIGINT] * 10
    )
    assert code != 0 and "Traceback" not in err and "Exception ignored" not in err, err
    assert err.strip() == "reproduce.py: error: interrupted; run the same command again to resume"
    assert again.returncode == 0 and (tmp_path / "o" / "results.json").is_file(), again.stderr


def test_sigterm_ends_the_run_like_ctrl_c_leaving_no_temporary(tmp_path, reproduce_here):
    stopped = interrupted_twice_or_terminated(tmp_path, reproduce_here, [signal.SIGTERM], "[2/")
    err, code, again = stopped
    assert err.strip() == "reproduce.py: error: terminated; run the same command again to resume"
    assert code != 0 and again.returncode == 0, again.stderr
    assert "redo:" not in again.stdout and "skip: " in again.stdout  # finished stages stayed
    assert not list((tmp_path / "o").rglob(".*.tmp"))


def test_sigterm_inside_a_write_removes_its_temporary(tmp_path):
    """Sent while atomic_write fills its temporary: the write unwinds (the temporary removed),
    and the run ends in one line, as a Ctrl-C does."""
    code = (
        "import os, signal, sys; from pathlib import Path; from dofmini.files import atomic_write; "
        "from dofmini.study.guard import one_line_errors\n"
        "def write(tmp):\n tmp.write_text('half'); os.kill(os.getpid(), signal.SIGTERM)\n"
        f" sys.exit('not stopped')\nwith one_line_errors(sys.exit):\n"
        f" atomic_write(Path({str(tmp_path / 'x.json')!r}), write)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip() == "terminated; run the same command again to resume"
    assert list(tmp_path.iterdir()) == []  # neither x.json nor .x.json.PID.tmp


def test_plan_only_leaves_no_cache_and_no_lock(tmp_path, reproduce_here):
    model, env = tiny_store(tmp_path)
    kept, fresh = tmp_path / "kept", tmp_path / "fresh"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    for out in (kept, fresh):
        args = ["--profile", "quick", "--limit", "0", "--plan-only", "--out", out]
        result = reproduce_here(model, *args, env=env)
        assert result.returncode == 0 and "plan (each" in result.stdout, result.stderr
    assert [p.name for p in kept.iterdir()] == ["notes.txt"] and not fresh.exists()


def test_results_and_the_evaluation_key_list_every_file_read_in_order(tmp_path):
    """Every data file the run opens after verifying the store, in the order opened, is in
    results.json's inputs ("read" gives the order) and pinned by the teacher evaluation's key;
    files listed but never opened (Winogrande's labels) are pinned inputs the run verifies."""
    model, store, out = shared_path("weights", "standin-gpt2"), data_path(), tmp_path / "o"
    args = [model, "--profile", "quick", "--variants", "none", "--limit", "1", "--data", store]
    args = [str(a) for a in [*args, "--out", out]]
    code = (
        "import sys, reproduce; opened = []; store = sys.argv[1]\n"
        "sys.addaudithook(lambda event, a: event == 'open' and str(a[0]).startswith(store + '/')"
        " and opened.append(str(a[0])[len(store) + 1 :]))\n"
        "reproduce.main(sys.argv[2:]); print('OPENED', *opened)"
    )
    command = [sys.executable, "-c", code, str(store), *args]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    inputs, opened = results["inputs"], done.stdout.split("OPENED ")[1].split()
    opened = opened[len([k for k in inputs if "/" in k]) :]  # after each file's verification
    assert "piqa/valid-labels.lst" in opened and "mmlu/test/virology_test.csv" in opened
    first_opened = list(dict.fromkeys(opened))
    assert [p for p in inputs["read"] if p in opened] == first_opened
    # the plan's estimate times each task's first example, so a task file may open once more
    assert all(opened.count(p) <= 2 for p in first_opened)
    key = json.loads((out / "teacher.json").read_text())["key"]["data"]
    assert key == {p: sha for p, sha in inputs.items() if "/" in p} and set(opened) <= set(key)


def test_a_profile_setting_is_not_undone_by_an_absent_flag(script, tmp_path):
    """The study profile skips the tasks; leaving out --limit must not switch them on."""
    argv = [FIXTURES / "gpt2-tiny", "--profile", "study", "--out", tmp_path / "o"]
    cfg = script.parse_args([str(arg) for arg in argv])
    assert (cfg.limit, cfg.steps, cfg.variants[:3]) == (0, 400, ("fix", "dof", "dof_sqrt"))


IDLE_FLAGS = {  # variants: the flags given whose part of the run does not run, and the warnings
    "none": (["--heldout-skip", "5", "--batch-per-device", "1", "--loss", "l2"],
             ["--batch-per-device 1: nothing trains",
              "--loss l2: no variant here trains with it (DiJiang trains direct)",
              "--heldout-skip 5: no student reads held-out windows"]),
    "fix": (["--curve-dims", "4,8", "--finetune-select", "5"],
            ["--curve-dims 4,8: no oracle among the variants",
             "--finetune-select 5: no --finetune"]),
    "fix,oracle": (["--curve-dims", "8,16", "--loss", "l2", "--heldout-skip", "1"], []),
}  # fmt: skip


@pytest.mark.parametrize("variants", IDLE_FLAGS)
def test_a_flag_value_the_run_will_not_use_is_said_before_any_work(
    tmp_path, variants, reproduce_here
):
    model, env = tiny_store(tmp_path)
    given, said = IDLE_FLAGS[variants]
    args = ["--profile", "quick", "--limit", "0", "--plan-only", "--variants", variants, *given]
    result = reproduce_here(model, *args, "--out", tmp_path / "o", env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    warnings = [line for line in result.stdout.splitlines() if "warning: " in line]
    assert warnings == [f"reproduce.py: warning: {why}, so not used" for why in said]
    before_any_work = result.stdout.index("plan (")
    assert all(result.stdout.index(line) < before_any_work for line in warnings)


ORACLE_REFUSALS = {  # flags: what the one line says (both oracles: 0.8.5 checked only "oracle")
    ("oracle", "--budgets", "4"): "budgets [4]: oracle allocates between its curves' dims; "
    "expected budgets in 8",
    ("oracle_e2e", "--budgets", "4"): "budgets [4]: oracle_e2e allocates between its curves' "
    "dims; expected budgets in 8",
    ("oracle", "--curve-dims", "8"): "--curve-dims 8: oracle interpolates its curves; expected 2",
    ("oracle_e2e", "--curve-dims", "16"): "--curve-dims 16: oracle_e2e interpolates its curves",
}


@pytest.mark.parametrize("flags", ORACLE_REFUSALS)
def test_oracle_budgets_or_curves_it_cannot_allocate_from_are_refused_before_training(
    tmp_path, flags, reproduce_here
):
    model, env = tiny_store(tmp_path)
    oracle, *more = flags
    args = ["--profile", "quick", "--limit", "0", "--variants", f"fix,{oracle}", *more]
    result = reproduce_here(model, *args, "--out", tmp_path / "o", env=env)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    refused = ORACLE_REFUSALS[flags]
    assert refused in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "plan (" not in result.stdout and not TRAINING_LINE.search(result.stdout)
    assert not list((tmp_path / "o").glob("students/*"))


def test_a_context_shorter_than_the_profile_runs_in_windows_of_that_context(
    tmp_path, reproduce_here
):
    """n_positions 16 under the quick profile's ctx 64: windows of 16, not a failure."""
    model, env = tiny_store(tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "n_positions": 16}))
    tensors = load_file(model / "model.safetensors")
    tensors["transformer.wpe.weight"] = tensors["transformer.wpe.weight"][:16].clone()
    save_file(tensors, model / "model.safetensors")
    args = ["--profile", "quick", "--limit", "0", "--variants", "fix", "--out", tmp_path / "o"]
    result = reproduce_here(model, *args, env=env)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert json.loads((tmp_path / "o" / "results.json").read_text())["config"]["ctx"] == 16
