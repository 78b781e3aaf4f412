"""A bank's units trained per student against all in one pass (issue 43): seconds a unit-step.

Every layer at each of --dims (one seed, the softmax loss) is trained two ways, interleaved in
one process, a few steps each round: as a study trained them before 0.8.2, one pass a Fix
student (its layers at one M, the teacher run once for them), and as 0.8.2's bank does, every
unit in one pass (the teacher run once for all). Both give the same tensors (tests/test_distill.py);
this prints their time per unit and step, best of rounds, and the ratio.
Run: python tests/bench_bank.py [--teacher FOLDER] [--rounds R] [--threads N]
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dofmini import load  # noqa: E402
from dofmini.distill import TrainSettings, distill_layers  # noqa: E402

STANDIN = Path(__file__).resolve().parents[2] / "shared" / "weights" / "standin-gpt2"


def seconds(teacher, ids, pairs, settings) -> float:
    """Seconds of settings.steps steps training `pairs` in one pass (after one warm-up step)."""
    times = []
    on_step = lambda state: times.append(time.perf_counter())  # noqa: E731
    distill_layers(
        teacher, pairs, ids, settings, loss="softmax", log=lambda _: None, on_step=on_step
    )
    return times[-1] - times[0]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--teacher", type=Path, default=STANDIN)
    p.add_argument("--dims", default="4,8,16,32,64,128")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    teacher = load(args.teacher)
    n_layer = teacher.config.n_layer
    ids = torch.randint(0, teacher.config.vocab_size, (64 * 256,), generator=torch.Generator())
    settings = TrainSettings(steps=args.steps + 1, batch=8, ctx=256)
    dims = [int(m) for m in args.dims.split(",")]
    per_student = [[(layer, m) for layer in range(n_layer)] for m in dims]
    every = [pair for pairs in per_student for pair in pairs]
    best = {"per student": float("inf"), "one pass": float("inf")}
    for _ in range(args.rounds):
        apart = sum(seconds(teacher, ids, pairs, settings) for pairs in per_student)
        together = seconds(teacher, ids, every, settings)
        best["per student"] = min(best["per student"], apart)
        best["one pass"] = min(best["one pass"], together)
    unit_steps = len(every) * args.steps
    print(
        f"{teacher.config.name}: {len(every)} units ({n_layer} layers x M in {dims}), "
        f"{args.steps} steps of 8 x 256 tokens, {args.threads} thread(s), best of {args.rounds}"
    )
    for way, total in best.items():
        print(f"  {way}: {1000 * total / unit_steps:.1f} ms a unit-step")
    print(f"  per student / one pass: {best['per student'] / best['one pass']:.2f}")


if __name__ == "__main__":
    main()
