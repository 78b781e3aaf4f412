"""The method's steps on a CUDA device, simulated where no GPU exists: the simulator in
../shared/tools gives tensors that report cuda:0 and checks every op against eager CUDA's device
rules (a CPU tensor or generator in a CUDA op fails as on a GPU), counting host syncs and float64
ops. On a machine with a GPU the same script runs on the real device."""

import ast
import subprocess
import sys

import pytest
import torch
from conftest import REPO, shared_path, tiny_store


def run_steps(*prefix, device="cuda"):
    script = REPO / "tests" / "gpu_steps.py"
    command = [sys.executable, *map(str, prefix), str(script), device]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)


def test_every_step_runs_on_a_simulated_cuda_device_without_float64():
    done = run_steps(shared_path("tools", "simcuda_run.py"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "every step ran on cuda" in done.stdout
    stats = ast.literal_eval(done.stdout.split("STATS ", 1)[1].splitlines()[0])
    f64_sites = done.stdout.split("top f64 sites ", 1)[1].splitlines()[0]
    assert stats.get("f64_ops", 0) == 0, f"float64 on the device at {f64_sites}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_every_step_runs_on_a_real_cuda_device():
    done = run_steps()
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_gpu_run_never_reuses_a_cpu_run_in_the_same_folder(tmp_path, reproduce_here):
    """The device is part of every stage's key: the simulated CUDA run into a CPU run's folder
    redoes every stage, saying so."""
    simulator = shared_path("tools", "simcuda_run.py")
    model, env = tiny_store(tmp_path)
    args = [model, "--profile", "quick", "--limit", "0", "--variants", "fix,dof"]
    args += ["--out", tmp_path / "out"]
    cpu = reproduce_here(*args, env=env)
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    simulated = [sys.executable, simulator, REPO / "reproduce.py", *args, "--device", "cuda"]
    gpu = subprocess.run(list(map(str, simulated)), env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert gpu.returncode == 0, gpu.stdout[-3000:] + gpu.stderr[-3000:]
    assert f"redo: {tmp_path / 'out' / 'teacher.json'}: device changed" in gpu.stdout
    assert f"redo: {tmp_path / 'out' / 'allocation.json'}: device changed" in gpu.stdout
    lines = gpu.stdout.splitlines()
    redone = {line.split(": ")[1] for line in lines if line.startswith("redo: ")}
    skipped = {
        line.split(": ")[1].removesuffix(" done") for line in lines if line.startswith("skip: ")
    }
    assert skipped <= redone  # only what this run itself made again (a draw two students share)
