"""Wall time of reproduce.py's stages in one process against `torchrun` with N ranks (issue 32): a
benchmark that prints a table, not a test.

    python tests/bench_parallel.py [--model DIR] [--data DIR] [--variants fix,dof] [--ranks 2]

Runs `reproduce.py MODEL --profile default --limit 0 --variants V` twice into fresh folders, first
as one process (torch's own thread count), then under torchrun (one thread per rank, torchrun's
default), and prints per stage the seconds of each and the speedup, from each results.json (a
student's train_seconds and eval_seconds, the teacher's eval_seconds, DoF's seconds), the whole
run's wall time, and the numbers that differ by more than 1e-5 relative. Run it on a quiet
machine: another job's load counts in both runs, and unequally.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from conftest import REPO, SHARED
from test_parallel import TORCHRUN, differences


def timed_run(launcher: list, args: list, out: Path) -> tuple:
    """(results.json, wall seconds) of reproduce.py launched by `launcher` into `out`."""
    start = time.perf_counter()
    command = [*launcher, str(REPO / "reproduce.py"), *args, "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads((out / "results.json").read_text()), time.perf_counter() - start


def stage_seconds(results: dict) -> dict:
    """{stage: seconds} as results.json records them."""
    found = {"teacher evaluation": results["teacher"]["eval_seconds"]}
    found["DoF estimate"] = results["dof"]["seconds"]
    for name, student in results["students"].items():
        if "same_training_as" not in student:
            found[f"{name} training"] = student["train_seconds"]
        found[f"{name} evaluation"] = student["eval_seconds"]
    return found


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=SHARED / "weights" / "standin-gpt2")
    p.add_argument("--data", type=Path, default=SHARED / "data")
    p.add_argument("--variants", default="fix,dof")
    p.add_argument("--ranks", type=int, default=2)
    a = p.parse_args()
    args = [str(a.model), "--profile", "default", "--limit", "0", "--data", str(a.data)]
    args += ["--variants", a.variants]
    with tempfile.TemporaryDirectory() as tmp:
        one, one_wall = timed_run([sys.executable], args, Path(tmp) / "one")
        many, many_wall = timed_run([*TORCHRUN, str(a.ranks)], args, Path(tmp) / "many")
    print(f"# {a.model.name}, profile default, --variants {a.variants}; 1 process, {a.ranks} ranks")
    print(f"| stage | 1 process, s | {a.ranks} ranks, s | speedup |\n|---|---|---|---|")
    by_one, by_many = stage_seconds(one), stage_seconds(many)
    for stage, seconds in [*by_one.items(), ("whole run (wall)", one_wall)]:
        other = by_many.get(stage, many_wall)
        print(f"| {stage} | {seconds:.1f} | {other:.1f} | {seconds / other:.2f} |")
    differ = differences(one, many)
    print(f"numbers that differ by more than 1e-5 relative: {len(differ)}", *differ, sep="\n  ")


if __name__ == "__main__":
    main()
