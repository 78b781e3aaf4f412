"""Time per training sample of the l2, softmax and direct losses on the GPT-2 stand-in.

At context 1024 (the paper, on GPUs: 60.6, 90.4 and 109.4 ms, L2 < softmax < direct), and the
softmax loss's training rate at context 256, batch 8 (what sizes reproduce.py's default profile).
Run: python tests/bench_distill.py [--help]
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dofmini import load, load_tokenizer  # noqa: E402
from dofmini.distill import distill, train_direct  # noqa: E402
from dofmini.students import make_student  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared"
PAPER_MS = {"l2": 60.6, "softmax": 90.4, "direct": 109.4}


def seconds_per_step(teacher, ids, loss, ctx, batch, steps):
    """(wall, CPU) seconds per optimiser step, after one warm-up step.

    On a shared machine the CPU time of a one-thread run is the steadier figure.
    """
    dims = [64] * teacher.config.n_layer

    def run(n):
        kwargs = dict(steps=n, batch=batch, ctx=ctx, data_seed=0, log=lambda line: None)
        if loss == "direct":
            student = make_student(teacher, "prf", dims, feature_seed=0)
            return train_direct(student, ids, **kwargs)
        return distill(teacher, dims, ids, loss=loss, feature_seed=0, **kwargs)

    run(1)
    t0, c0 = time.perf_counter(), time.process_time()
    run(steps)
    return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--steps", type=int, default=3, help="timed steps per loss, after one warm-up step"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = SHARED / "weights" / "standin-gpt2"
    text = SHARED / "data" / "wikitext-2-raw" / "wiki.valid.raw"
    if not folder.exists() or not text.exists():
        sys.exit(f"needs {folder} and {text}")
    teacher = load(folder).to(args.device)
    ids = torch.tensor(
        load_tokenizer(folder).encode(text.read_text(encoding="utf-8")[:400_000]).ids
    )
    print(
        f"GPT-2 stand-in, {args.device}, {torch.get_num_threads()} torch threads, load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; ctx {args.ctx}, batch {args.batch}, "
        f"{args.steps} timed steps\n"
    )
    print(
        "| loss | wall ms / sample | ratio to l2 | CPU ms / sample | ratio to l2 "
        "| paper ms (GPU) | paper ratio |\n"
        "|---|---|---|---|---|---|---|"
    )
    ms = {}
    for loss in ("l2", "softmax", "direct"):
        seconds = seconds_per_step(teacher, ids, loss, args.ctx, args.batch, args.steps)
        ms[loss] = [1000 * t / args.batch for t in seconds]
        (wall, cpu), (wall_l2, cpu_l2) = ms[loss], ms["l2"]
        print(
            f"| {loss} | {wall:.0f} | {wall / wall_l2:.2f} | {cpu:.0f} | {cpu / cpu_l2:.2f} "
            f"| {PAPER_MS[loss]} | {PAPER_MS[loss] / PAPER_MS['l2']:.2f} |",
            flush=True,
        )
    wall, cpu = seconds_per_step(teacher, ids, "softmax", 256, 8, args.steps)
    print(
        f"\nsoftmax loss, ctx 256, batch 8: {wall:.2f} s/step wall ({60 / wall:.1f} steps/min, "
        f"{480 / wall:.0f} samples/min); {cpu:.2f} s/step CPU"
    )


if __name__ == "__main__":
    main()
