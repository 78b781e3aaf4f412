"""What reproduce.py says before it works: --help with every default, no abbreviated flag, the
device it picks (cpu here, cuda where torch sees one), the plan with each stage's estimate, and
one message when the weights and the data are missing and their hosts unreachable."""

import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import REPO, shared_path, tiny_store
from test_reproduce import missing_listing, offline_env

from dofmini.study import flags


def parse(script, *argv):
    return flags.parse(list(argv), script.RunConfig, script.PROFILES, "")


def test_help_shows_every_default(script, capsys):
    with pytest.raises(SystemExit) as done:
        parse(script, "--help")
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps some lines
    assert done.value.code == 0
    for said in ("--loss LOSSES the PRF students' losses, each at every budget: from softmax, "
                 "l2, direct, e.g. softmax,l2; default softmax",
                 "default the head size; study 16,32,64", "default 1024; quick 128",
                 "default performer,dijiang,fix,dof,dof_clip;", "each rank's own; default auto",
                 "default 100; quick 4; study 0; paper all", "default 0; study 0,1,2",
                 "default fp32", "default a quarter of the batch", "default runs/MODEL-PROFILE",
                 "default 2^-4 for GPT-2, 2^-8 for Pythia"):  # fmt: skip
        assert said in shown, said


def test_an_abbreviated_flag_is_refused_not_taken_for_another(script, capsys):
    assert parse(script, "gpt2", "--seeds", "1")["seeds"] == (1,)
    with pytest.raises(SystemExit) as refused:
        parse(script, "gpt2", "--s", "1")  # not --seeds 1
    assert refused.value.code == 2
    assert "unrecognized arguments: --s 1" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: auto is cuda")
def test_auto_is_the_cpu_without_cuda_and_says_so():
    assert flags.pick_device("auto") == "cpu"
    assert flags.device_line("cpu") == "device: cpu (no CUDA device seen)"


def test_auto_is_cuda_where_torch_sees_a_cuda_device(tmp_path):
    simulator = shared_path("tools", "simcuda_run.py")
    probe = tmp_path / "auto.py"
    code = "from dofmini.study import flags\nprint(flags.device_line(flags.pick_device('auto')))"
    probe.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(simulator), str(probe)], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "device: cuda (torch sees" in done.stdout


def test_the_plan_gives_each_stage_an_estimate_and_the_config_its_device(tmp_path, reproduce_here):
    model, env = tiny_store(tmp_path)
    args = ["--profile", "quick", "--limit", "0", "--variants", "fix,dof", "--plan-only"]
    result = reproduce_here(model, *args, "--out", tmp_path / "o", env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "device: cpu (no CUDA device seen)" in result.stdout or torch.cuda.is_available()
    estimate = r"~[\d.]+ (s|min|h) \(\d[\d.]*-\d[\d.]*\)"
    for stage in ("teacher evaluation", "DoF estimate", "fix/softmax/b8/s0", "dof/softmax/b8/s0"):
        assert re.search(rf"\n  {re.escape(stage)}: {estimate}\n", result.stdout), stage
    assert re.search(rf"\n  0 of 4 stages done; the rest: {estimate} here\n", result.stdout)
    assert not (tmp_path / "o").exists()


def test_nothing_here_and_no_network_is_one_message_naming_both(tmp_path):
    """An empty weights folder and data store, the hub and the mirror on closed ports: one
    message, naming the weights and the data, the fix last, the listing in a file; in seconds,
    not huggingface_hub's five retries."""
    env = offline_env(tmp_path)
    # the seconds from main() on: importing torch on a busy machine is not what is measured
    timed = (
        "import sys, time, reproduce\nt0 = time.time()\ntry:\n    reproduce.main(sys.argv[1:])\n"
    )
    timed += "finally:\n    print(time.time() - t0)"
    command = [sys.executable, "-c", timed, "gpt2", "--out", str(tmp_path / "out")]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    seconds = float(result.stdout.split()[-1])
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    message = result.stderr.strip().splitlines()
    assert message[0].startswith("reproduce.py: error: ") and len(message) <= 6, message
    assert "weights of gpt2: 3 file(s)" in message[1] and "Connection refused" in message[1]
    assert "data: 86 file(s), 31.2 MB" in message[2] and message[-1].startswith("Fix: ")
    listing = re.search(r"are in (\S+)\.$", message[-2])[1]
    assert os.path.dirname(listing) == env["TMPDIR"]
    listed = missing_listing(result.stderr)
    hub_url = f"{env['HF_ENDPOINT']}/openai-community/gpt2/resolve/main/model.safetensors"
    assert f"{hub_url}\n      -> {tmp_path / 'weights' / 'gpt2' / 'model.safetensors'}" in listed
    assert f"{env['DOFMINI_DATA_MIRROR']}/piqa/valid.jsonl" in listed
    assert seconds < 15, f"{seconds:.1f} s"
    assert not (tmp_path / "out").exists() and not (tmp_path / "weights").exists()
