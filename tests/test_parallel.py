"""Data-parallel runs under torchrun, on CPU with gloo: two ranks give the one-process results, a
rank killed mid-training leaves progress that a run with another number of ranks resumes to the
same student, and gradient accumulation over a device's share is the whole batch's step."""

import json
import math
import os
import runpy
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, REPO, tiny_store

from dofmini.distill import TrainSettings, distill
from dofmini.study import devices
from dofmini.tensor_files import read_tensors

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
# one student trained through store.train_into; the last rank kills itself after step argv[2]
TRAIN = f"""
import os, signal, sys
from pathlib import Path
import torch
from dofmini import load
from dofmini.distill import TrainSettings, distill
from dofmini.study import devices, store
devices.start()
teacher = load({str(FIXTURES / "gpt2-tiny")!r})
ids = torch.randint(0, 96, (2048,), generator=torch.Generator().manual_seed(0))
settings = TrainSettings(steps=6, batch=4, ctx=16, part=1)
def train(on_step, **loop):
    def step(state):
        on_step(state)
        if state.step == int(sys.argv[2]) and devices.rank() == devices.world() - 1:
            os.kill(os.getpid(), signal.SIGKILL)
    return distill(teacher, [8, 8], ids, settings, on_step=step, share=devices.shared, **loop)
store.train_into(Path(sys.argv[1]), {{"loss": "softmax"}}, settings, ids, train, print, 2)
"""


def differences(a, b, where="") -> list:
    """Where two results.json differ by more than 1e-5 relative, timings and provenance aside."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(k for k in a.keys() | b.keys() if "seconds" not in k and k != "provenance")
        return [d for k in keys for d in differences(a.get(k), b.get(k), f"{where}/{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, pair in enumerate(zip(a, b)) for d in differences(*pair, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, float):
        return [] if math.isclose(a, b, rel_tol=1e-5) or a != a and b != b else [where]
    return [] if a == b else [where]


def run(args, ranks=None, env=None):
    launcher = [sys.executable] if ranks is None else [*TORCHRUN, str(ranks)]
    return subprocess.run([*launcher, *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=900)  # fmt: skip


def test_two_ranks_give_the_results_of_one_process(tmp_path, reproduce_here):
    model, env = tiny_store(tmp_path)
    args = [model, "--profile", "quick", "--limit", "0"]
    args += ["--variants", "dof,dijiang"]  # DoF (the writer's), distillation, direct training
    one = reproduce_here(*args, "--out", tmp_path / "one", env=env)
    two = run([REPO / "reproduce.py", *args, "--out", tmp_path / "two"], ranks=2, env=env)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    results = [json.loads((tmp_path / out / "results.json").read_text()) for out in ("one", "two")]
    assert len(results[0]["students"]) == 2 and differences(*results) == []
    assert two.stdout.count("[1/") == 1  # the writer alone logs
    assert "; 2 ranks, each at most 1 of a step's 2 parts):" in two.stdout  # the plan's line
    students = [
        sorted((tmp_path / out / "students").glob("*.safetensors")) for out in ("one", "two")
    ]
    assert len(students[0]) == 2 and [p.name for p in students[0]] == [p.name for p in students[1]]
    for path_one, path_two in zip(*students):  # each part's gradient added in part order
        (a, _), (b, _) = read_tensors(path_one), read_tensors(path_two)
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), path_two


def test_a_killed_rank_leaves_progress_that_another_number_of_ranks_resumes(
    tmp_path, monkeypatch, capsys
):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    whole, cut = tmp_path / "whole.safetensors", tmp_path / "cut.safetensors"

    def in_this_process(*args):  # one process: no rank kills itself (argv[2] 0: never)
        monkeypatch.setattr(sys, "argv", [str(script), *map(str, args)])
        runpy.run_path(str(script), run_name="__main__")
        return capsys.readouterr().out

    in_this_process(whole, 0)
    killed = run([script, cut, 5], ranks=2, env=env)  # after the progress of step 4
    assert killed.returncode != 0 and not cut.exists() and Path(f"{cut}.progress").is_file()
    resumed = in_this_process(cut, 0)
    assert "resuming from" in resumed and "at step 4/6" in resumed, resumed
    (a, meta_a), (b, meta_b) = read_tensors(whole), read_tensors(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)  # bit for bit
    assert differences(meta_a["info"], meta_b["info"]) == []


def test_a_device_taking_one_window_at_a_time_steps_as_the_whole_batch(tiny, tiny_ids):
    settings = TrainSettings(steps=3, batch=4, ctx=16)
    a, record_a = distill(tiny, [8, 8], tiny_ids, settings)  # the core's one backward
    by_window = replace(settings, part=1)
    b, record_b = distill(tiny, [8, 8], tiny_ids, by_window, share=devices.shared)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7)
    assert differences(record_a, record_b) == [] and record_a["loss_curve"]


def test_more_ranks_than_a_step_has_parts_are_refused_before_any_work(tmp_path):
    model, env = tiny_store(tmp_path)
    args = [REPO / "reproduce.py", model, "--profile", "quick", "--batch-per-device", "2"]
    done = run([*args, "--out", tmp_path / "out"], ranks=2, env=env)
    why = "the profile's 2 windows a step, back-propagated 2 at a time"
    assert done.returncode != 0
    assert f"2 ranks: expected at most one for each part ({why})" in done.stderr
    assert not (tmp_path / "out").exists()


def test_ranks_of_other_data_registries_stop_at_once_naming_it(tmp_path):
    """Rank 1 with a registry of its own (here one pin changed) would train on other data: every
    rank stops before any work with one line naming what differs."""
    model, env = tiny_store(tmp_path)
    registry = Path(env["DOFMINI_DATA_REGISTRY"])
    rows = registry.read_text().splitlines(keepends=True)
    cells = rows[-1].split("\t")
    other = "".join(rows[:-1]) + "\t".join([*cells[:3], "0" * 64, cells[4]])
    (tmp_path / "registry0.tsv").write_text(registry.read_text())
    (tmp_path / "registry1.tsv").write_text(other)
    wrapper = tmp_path / "rank.sh"  # each rank its own registry, by its LOCAL_RANK
    wrapper.write_text(
        f'export DOFMINI_DATA_REGISTRY="{tmp_path}/registry$LOCAL_RANK.tsv"\n'
        f'exec {sys.executable} {REPO / "reproduce.py"} "$@"\n'
    )
    args = ["--no-python", "sh", wrapper, model, "--profile", "quick", "--out", tmp_path / "out"]
    done = run(args, ranks=2, env=env)
    assert done.returncode != 0 and "Exception ignored" not in done.stderr, done.stderr[-3000:]
    why = "the ranks disagree: rank 1's data registry not rank 0's"
    assert f"reproduce.py: error: rank 0 of 2: {why}" in done.stderr
    assert f"reproduce.py: error: rank 1 of 2: {why}" in done.stderr
    assert not (tmp_path / "out").exists()


def test_a_world_size_without_torchrun_is_one_line(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in devices.TORCHRUN_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit, match="error: WORLD_SIZE=2 without RANK, LOCAL_RANK, MASTER_"):
        devices.start()
