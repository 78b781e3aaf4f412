"""Time per training sample of the l2, softmax and direct losses on the GPT-2 stand-in.

At context 1024 (the paper, on GPUs: 60.6, 90.4 and 109.4 ms, L2 < softmax < direct), and the
softmax loss's training rate at context 256, batch 8 (what sizes reproduce.py's default profile).
--precision instead compares the layerwise losses in float32 and float64: the loss curves and the
held-out per-layer KL after a short run of each, and the time of one layer_pass step of each,
interleaved in one process.
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
from dofmini.distill import (  # noqa: E402
    DTYPES,
    TrainSettings,
    distill,
    layer_backward,
    train_direct,
)
from dofmini.students import make_student  # noqa: E402
from dofmini.study.evaluate import layer_pass  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared"
PAPER_MS = {"l2": 60.6, "softmax": 90.4, "direct": 109.4}


def seconds_per_step(teacher, ids, loss, ctx, batch, steps):
    """(wall, CPU) seconds per optimiser step, after one warm-up step.

    On a shared machine the CPU time of a one-thread run is the steadier figure.
    """
    dims = [64] * teacher.config.n_layer

    def run(n):
        settings = TrainSettings(steps=n, batch=batch, ctx=ctx)
        if loss == "direct":
            student = make_student(teacher, "prf", dims, feature_seed=0)
            return train_direct(student, ids, settings, log=lambda line: None)
        return distill(teacher, dims, ids, settings, loss=loss, log=lambda line: None)

    run(1)
    t0, c0 = time.perf_counter(), time.process_time()
    run(steps)
    return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps


def heldout_kl(teacher, student, held, ctx):
    """Per-layer KL(p‖p̂) on held-out windows, always in float64."""
    ids = held[: len(held) // ctx * ctx].view(-1, ctx)[:8]  # [W, ctx]
    layers = zip(student.blocks, teacher.capture(ids))
    with torch.no_grad():
        return [
            layer_pass(b.attn.features, q, k, None, {"kl"}, 256, dtype=torch.float64)["kl"]
            .mean()
            .item()
            for b, (q, k, _) in layers
        ]


def precision(teacher, ids, held, args):
    """float32 against float64: loss curves, held-out KL, and interleaved step times."""
    dims = [64] * teacher.config.n_layer
    every = max(1, args.steps // 4)
    settings = {
        name: TrainSettings(
            steps=args.steps, batch=args.batch, ctx=args.ctx, dtype=name, log_every=every
        )
        for name in DTYPES
    }
    students, curves = {}, {}
    for name, s in settings.items():
        students[name], record = distill(teacher, dims, ids, s, log=lambda line: None)
        curves[name] = record["loss_curve"]
    print(f"{args.steps} steps of the softmax loss, ctx {args.ctx}, batch {args.batch}, M = 64\n")
    print("| step | loss float32 | loss float64 | rel. diff |\n|---|---|---|---|")
    for (step, a), (_, b) in zip(curves["float32"], curves["float64"]):
        print(f"| {step} | {a:.6g} | {b:.6g} | {abs(a - b) / b:.1e} |")
    kl = {name: heldout_kl(teacher, st, held, args.ctx) for name, st in students.items()}
    print("\n| layer | held-out KL, float32-trained | float64-trained | rel. diff |")
    print("|---|---|---|---|")
    for layer, (a, b) in enumerate(zip(kl["float32"], kl["float64"])):
        print(f"| {layer} | {a:.6g} | {b:.6g} | {abs(a - b) / b:.1e} |")
    # one training step's layerwise work (every layer, forward and backward), alternating dtypes
    student = students["float32"]
    batch = ids[: args.batch * args.ctx].view(args.batch, args.ctx)  # [B, ctx]
    qkv = teacher.capture(batch)
    seconds = {name: [] for name in DTYPES}
    for _ in range(args.repeats):
        for name, dtype in DTYPES.items():
            t0 = time.perf_counter()
            for b, (q, k, _) in zip(student.blocks, qkv):
                layer_backward(b.attn.features, q.to(dtype), k.to(dtype), "ce", 256)
            seconds[name].append(time.perf_counter() - t0)
            student.zero_grad(set_to_none=True)
    best = {name: min(t) for name, t in seconds.items()}
    print(
        f"\nlayerwise step time, best of {args.repeats} interleaved: float64 / float32 = "
        f"{best['float64'] / best['float32']:.2f} ({next(teacher.parameters()).device})"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ctx", type=int, default=None, help="default 1024 (256 with --precision)")
    parser.add_argument("--batch", type=int, default=None, help="default 1 (4 with --precision)")
    parser.add_argument(
        "--steps", type=int, default=3, help="timed steps per loss, after one warm-up step"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--precision",
        action="store_true",
        help="compare float32 and float64 losses instead (--steps training steps, default ctx 256 "
        "and batch 4 when not given)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats for --precision")
    args = parser.parse_args()
    args.ctx = args.ctx or (256 if args.precision else 1024)
    args.batch = args.batch or (4 if args.precision else 1)
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = SHARED / "weights" / "standin-gpt2"
    text = SHARED / "data" / "wikitext-2-raw" / "wiki.valid.raw"
    if not folder.exists() or not text.exists():
        sys.exit(f"needs {folder} and {text}")
    teacher = load(folder).to(args.device)
    raw = text.read_text(encoding="utf-8")
    ids = torch.tensor(load_tokenizer(folder).encode(raw[:400_000]).ids)
    print(
        f"GPT-2 stand-in, {args.device}, {torch.get_num_threads()} torch threads, load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; ctx {args.ctx}, batch {args.batch}, "
        f"{args.steps} steps\n"
    )
    if args.precision:
        held = torch.tensor(load_tokenizer(folder).encode(raw[600_000:700_000]).ids)
        return precision(teacher, ids, held, args)
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
