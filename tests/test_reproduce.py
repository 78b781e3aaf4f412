"""`reproduce.py` end to end on the GPT-2 stand-in (quick profile, as a subprocess), its argument errors, and the
vendorability of the modules the README says can be copied alone."""

import ast
import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from conftest import REPO, shared_path

VARIANT_KEYS = {
    "performer/none",
    "dijiang/direct",
    "fix/softmax",
    "dof/softmax",
    "dof_clip/softmax",
}
TASKS = {"piqa", "arc_easy", "arc_challenge", "winogrande", "wsc273", "mmlu", "logiqa", "lambada"}
TRAINING_LINE = re.compile(r"^(distill \w+|direct) \d+/\d+: loss", re.M)  # distill's progress lines
VENDORABLE = {
    "linear_attention.py": {"torch"},
    "dof.py": {"torch", "numpy"},
    "plots.py": set(),
    "tasks.py": set(),
    "generate.py": {"torch"},
}


def reproduce(*args, timeout=600):
    return subprocess.run(
        [sys.executable, str(REPO / "reproduce.py"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    model = shared_path("weights", "standin-gpt2")
    shared_path("data", "wikitext-2-raw")
    out = tmp_path_factory.mktemp("quick")
    first = reproduce(model, "--profile", "quick", "--out", out)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    return model, out, first


def test_quick_profile_writes_every_variant_and_task(quick_run):
    _, out, first = quick_run
    results = json.loads((out / "results.json").read_text())
    assert set(results["variants"]) == VARIANT_KEYS
    assert set(results["teacher"]["tasks"]) == TASKS
    for key, variant in results["variants"].items():
        assert set(variant["tasks"]) == TASKS, key
        assert variant["wikitext2_ppl"] > 1 and len(variant["dims"]) == 6
        assert set(variant["layer_error"]) == {"kernel_l2", "kl", "output_rel"}
        if key.startswith(("fix/", "dof/", "dof_clip/")):
            assert set(variant["layer_error_before"]) == {"kernel_l2", "kl", "output_rel"}
    dims = results["dof"]["dims"]
    assert sum(dims["dof"]) == sum(dims["fix"]) == 6 * 64 and max(dims["dof_clip"]) <= 64
    assert results["dof"]["seed"] == results["config"]["seed"] == 0
    assert "DoF removes" in (out / "report.md").read_text()
    assert "greedy continuations" in first.stdout and TRAINING_LINE.search(first.stdout)


def test_quick_profile_svgs_parse(quick_run):
    _, out, _ = quick_run
    svgs = sorted(out.glob("*.svg"))
    assert {p.name for p in svgs} >= {"allocation.svg", "error_kl.svg", "error_output_rel.svg"}
    for svg in svgs:
        assert ET.parse(svg).getroot().tag.endswith("svg")


def test_second_run_skips_every_stage(quick_run):
    model, out, _ = quick_run
    again = reproduce(model, "--profile", "quick", "--out", out)
    assert again.returncode == 0, again.stderr[-3000:]
    skipped = sorted(
        Path(line.split("skip: ")[1].split()[0]).relative_to(out).as_posix()
        for line in again.stdout.splitlines()
        if "skip: " in line
    )
    # each variant has two stages (train, evaluate), saved as students/<key>.json and eval/<key>.json
    keys = [k.replace("/", "-") for k in VARIANT_KEYS]
    untrained = [
        f"eval/{v}-untrained.json" for v in ("fix", "dof", "dof_clip")
    ]  # errors before training
    assert skipped == sorted(
        ["teacher.json", "allocation.json"]
        + untrained
        + [f"{d}/{k}.json" for d in ("students", "eval") for k in keys]
    )
    assert not TRAINING_LINE.search(again.stdout), "a finished student was trained again"


@pytest.mark.parametrize(
    "args, message",
    [
        (["gpt5"], "unknown model 'gpt5'"),
        (["{empty}"], "has no config.json"),
        (["{standin}", "--variants", "fix,hedgehog"], "unknown variant 'hedgehog'"),
        (["{standin}", "--loss", "kl"], "unknown loss 'kl'"),
    ],
)
def test_bad_arguments_give_one_line(tmp_path, args, message):
    fill = {"{empty}": str(tmp_path), "{standin}": str(REPO / "tests" / "fixtures" / "gpt2-tiny")}
    result = reproduce(*[fill.get(a, a) for a in args], timeout=120)
    assert result.returncode != 0
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="this machine has CUDA, so --device cuda is valid here"
)
def test_cuda_without_cuda_is_refused():
    result = reproduce(REPO / "tests" / "fixtures" / "gpt2-tiny", "--device", "cuda", timeout=120)
    assert result.returncode != 0 and "--device cuda is not available" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("module", sorted(VENDORABLE))
def test_vendorable_module_imports_only_torch_numpy_stdlib(module):
    tree = ast.parse((REPO / "dofmini" / module).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, (
                f"{module} imports a sibling module ({node.module}); it must stand alone"
            )
            imported.add(node.module.split(".")[0])
    outside = {name for name in imported if name not in sys.stdlib_module_names} - VENDORABLE[
        module
    ]
    assert not outside, (
        f"{module} imports {outside}; vendorable modules may use only {VENDORABLE[module] or 'stdlib'}"
    )
