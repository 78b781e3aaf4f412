"""The run as a process (dofmini/study/guard.py): Ctrl-C ends it with a non-zero exit and the one
line that says how to resume, however many signals arrive and wherever the first one lands."""

import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO

# A run's loop under the guard: most of its Python time in a finalizer (as a training's garbage
# collection runs them), where Python prints and drops an exception a signal handler raises
LOOP = """import sys, time
from dofmini.study import guard

def fail(message):
    raise SystemExit(f"child: error: {message}")

class Finalized:
    def __del__(self):
        sum(range(2000))

with guard.one_line_errors(fail):
    print("ready", flush=True)
    end = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < end:
        Finalized()
print("finished")
"""


def interrupted(signals: int, gap: float, seconds: float = 1.0) -> subprocess.CompletedProcess:
    """LOOP run for at most `seconds`, sent `signals` SIGINTs `gap` seconds apart once it is in
    the guard; its exit status and output. SIGINT acts as from a terminal even when the tests run
    in the background, where a shell starts them with SIGINT ignored."""
    default = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    command = [sys.executable, "-c", LOOP, str(seconds)]
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default)
    run = subprocess.Popen(command, cwd=REPO, env={"PYTHONPATH": str(REPO)}, **pipes)
    assert run.stdout.readline() == "ready\n"
    for _ in range(signals):
        run.send_signal(signal.SIGINT)
        time.sleep(gap)
    out, err = run.communicate(timeout=120)
    return subprocess.CompletedProcess(command, run.returncode, out, err)


@pytest.mark.parametrize("signals, gap", [(2, 0.01), (1, 0.0), (10, 0.002)])
def test_ctrl_c_ends_the_run_non_zero_with_the_resume_line(signals, gap):
    """Before: the first signal's KeyboardInterrupt, raised in a finalizer, was dropped, and every
    later signal was ignored: the run went on, deaf, and exited 0."""
    done = interrupted(signals, gap)
    assert done.returncode != 0 and "finished" not in done.stdout, (done.stdout, done.stderr)
    assert done.stderr == "child: error: interrupted; run the same command again to resume\n"
