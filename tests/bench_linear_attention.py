"""Speed and memory of causal PRF linear attention (issues 3, 13, 14): tables, not pass/fail.

    python tests/bench_linear_attention.py [--quick] [--training] [--lengths 1024,4096]
        [--chunks 64,128,256] [--device cpu|cuda] [--threads N] [--cpu-time] [--old REV]

B = 1, 12 heads, d = 64, M = 64, fp32, T from 256 to 32768 (to 4096 with --quick; --lengths picks
others). Compared:
- chunked: dofmini's causal_linear_attention on features Φ (the normaliser included);
- sdpa:    torch's scaled_dot_product_attention(is_causal=True) on q, k, v of the same sizes;
- naive:   a per-token cumsum that builds every token's M×d state, in 128 pieces along T with the
           last state carried, the way performer-pytorch's CPU fallback does (its memory then grows
           as T/128 per piece);
- matmul:  one square fp32 matmul doing as many FLOPs as the chunked form: the roofline.
--training (T = 1K to 32K unless --lengths) instead times the whole-sequence chunked form against
an old one (a8b0657, or the git revision --old names, loaded into a temp file), both in this one
process, interleaved, best of --rounds, forward and forward+backward (gradients for the inputs
against a fixed random cotangent), with time per 1K tokens (flat: linear in T) and new/old ratios,
for: features Φ
(plain); log-features N(0, 1) (log: PRF attention as LinearAttention runs it, every row on the fast
path of `log_chunks`); log-features 30·N(0, 1) (log-wide: keys rise far above their chunk's
reference, every chunk also takes the exact path, which a GPU computes always); and DiJiang's
decay γ. Each version runs twice: whole, as on a GPU, and in its CPU parts of SEGMENT tokens.
Then one decoding step in log space, old recurrent_step against the new form on one token.

Each (method, T) is measured in fresh subprocesses, one for time and one for memory. Time: best of
several calls after a warm-up (other processes on a shared machine only ever add time); with
--cpu-time, the process's CPU time instead of wall time, which on a busy shared machine leaves out
the time other processes hold the cores (fair with --threads 1; with more threads it adds up the
threads, spin-waits included). Peak memory: extra memory at peak during one forward call after the
warm-up, over what the inputs already hold. On CPU the kernel's peak-RSS counter is reset just
before that call (/proc/self/clear_refs, 5) and read after it (VmHWM − VmRSS before); the warm-up
has already paged in the library code the call runs, and glibc is told to map every allocation over
64 KiB on its own (MALLOC_MMAP_THRESHOLD_), so freed tensors go back to the system at once and a
reused heap cannot hide a peak (that setting makes every allocation fault in fresh pages, which is
why timing runs without it). On CUDA: torch.cuda.max_memory_allocated.
"""

import argparse
import importlib.util
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dofmini.dijiang import decay_form  # noqa: E402
from dofmini.linear_attention import LinearState, causal_linear_attention  # noqa: E402

H, D, M = 12, 64, 64


def naive_cumsum(phi_q, phi_k, v, pieces=128):
    """Per-token states S_t = Σ_{s≤t} φ_k,s v_sᵀ [B, H, t, M, d] by cumsum, piece by piece."""
    S, s, outs = 0, 0, []
    for q, k, x in zip(phi_q.chunk(pieces, 2), phi_k.chunk(pieces, 2), v.chunk(pieces, 2)):
        S = S + (k[..., :, None] * x[..., None, :]).cumsum(2)  # [B, H, t, M, d]
        s = s + k.cumsum(2)  # [B, H, t, M]
        outs.append(
            (q[..., None, :] @ S)[..., 0, :] / (q * s).sum(-1, keepdim=True)
        )  # [B, H, t, d]
        S, s = S[:, :, -1:], s[:, :, -1:]
    return torch.cat(outs, 2)


def chunked_flops(T, chunk):
    """Multiply-adds ×2 of the chunked form: per chunk of L tokens QKᵀ, AV, KᵀV and Q·state,
    E = d + 1."""
    E = D + 1
    sizes = [chunk] * (T // chunk) + ([T % chunk] if T % chunk else [])
    return sum(2 * H * L * (L * M + L * E + 2 * M * E) for L in sizes)


def matmul_side(T, chunk):
    return max(1, round((chunked_flops(T, chunk) / 2) ** (1 / 3)))


def rss_kb(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def inputs(method, T, chunk, device, gen):
    """The function timed and its arguments: positive features Φ for chunked and naive."""
    if method == "matmul":
        n = matmul_side(T, chunk)
        return torch.mm, [torch.randn(n, n, generator=gen).to(device) for _ in range(2)]
    a, b, v = (torch.randn(1, H, T, D, generator=gen).to(device) for _ in range(3))
    fn = {
        "chunked": lambda q, k, v: causal_linear_attention(q, k, v, chunk),
        "naive": naive_cumsum,
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }[method]
    return fn, [a.exp(), b.exp(), v] if method in ("chunked", "naive") else [a, b, v]


def worker(what, method, T, chunk, device, clock):
    """One (method, T) in this process; prints its best call's ms (what = "ms" forward, "fb"
    forward+backward) or one forward call's extra peak MB (what = "mb")."""
    gen = torch.Generator().manual_seed(0)
    fn, args = inputs(method, T, chunk, device, gen)
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if what == "fb":
        args = [x.requires_grad_() for x in args]
        cotangent = torch.randn(1, H, T, D, generator=gen).to(device)
        call = lambda: fn(*args).backward(cotangent)
    else:
        call = torch.no_grad()(lambda: fn(*args))
    call()  # warm-up
    sync()
    if what == "mb":
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS to the current RSS
            before = rss_kb("VmRSS") * 1024
        call()
        sync()
        peak = torch.cuda.max_memory_allocated() if cuda else rss_kb("VmHWM") * 1024
        return print((peak - before) / 2**20)
    times = []
    while not times or (len(times) < 20 and sum(times) < 2.0):  # slow calls: one only
        for x in args if what == "fb" else ():
            x.grad = None  # every call writes fresh gradients, none accumulates
        t = clock()
        call()
        sync()
        times.append(clock() - t)
    print(1e3 * min(times))


def measure(what, method, T, chunk, a):
    """ms or MB from a fresh subprocess; nan and a note saying why when it fails."""
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        what,
        method,
        str(T),
        "--chunks",
        str(chunk),
        "--device",
        a.device,
        "--threads",
        str(a.threads),
    ] + ["--cpu-time"] * a.cpu_time
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"} if what == "mb" else None
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode:
        return math.nan, f"{method} T={T} ({what}) failed: {out.stderr.strip().splitlines()[-1]}"
    return float(out.stdout), None


def load_twice(path, name):
    """Two copies of the module at path: (as it runs on CPU, in parts of SEGMENT tokens; its
    whole-sequence path, as on GPU, SEGMENT set past any T)."""
    copies = []
    for part in ("parts", "whole"):
        spec = importlib.util.spec_from_file_location(f"{name}_{part}", path)
        copies.append(importlib.util.module_from_spec(spec))
        spec.loader.exec_module(copies[-1])
    copies[1].SEGMENT = 1 << 40
    return copies


LEGACY = (
    "a8b0657"  # the version before the chunked rewrite, with its own keywords and decoding step
)


def old_path(rev=LEGACY):
    """linear_attention.py as of git revision `rev`, written to a temp file."""
    repo = Path(__file__).resolve().parents[1]
    show = ["git", "show", f"{rev}:dofmini/linear_attention.py"]
    path = Path(tempfile.mkdtemp()) / "old_linear_attention.py"
    path.write_text(
        subprocess.run(show, cwd=repo, capture_output=True, text=True, check=True).stdout
    )
    return path


LOG = lambda g: {"log_space": True}
KINDS = {  # inputs from N(0, 1) (features or log-features), the new and the old keywords for γ
    "plain": (lambda x: x.exp(), lambda g: {}, lambda g: {}),
    "log": (lambda x: x, LOG, LOG),
    "log-wide": (lambda x: 30 * x, LOG, LOG),  # every chunk also takes the exact path
    "decay": (lambda x: x.exp(), lambda g: {"form": decay_form(g)}, lambda g: {"decay": g}),
}


def compare(lengths, chunk, rounds, old_rev=LEGACY):
    """Old (--old, a8b0657 by default) against new, each whole and in CPU parts, in this one
    process, interleaved: each round times every version once per (kind, T, forward or
    forward+backward), after one untimed call; best of rounds."""
    new_path = Path(__file__).resolve().parents[1] / "dofmini" / "linear_attention.py"
    modules = {
        f"{name} {part}": m
        for name, path in (("new", new_path), ("old", old_path(old_rev)))
        for part, m in zip(("parts", "whole"), load_twice(path, name))
    }
    decay = torch.linspace(0.97, 0.998, H)  # [H] DiJiang-like γ
    best = {}
    for r in range(rounds):
        for kind, (prep, new_kw, old_kw) in KINDS.items():
            for T in lengths:
                gen = torch.Generator().manual_seed(T)
                a, b, v = (torch.randn(1, H, T, D, generator=gen) for _ in range(3))
                q, k = prep(a), prep(b)
                cot = torch.randn(1, H, T, D, generator=gen)
                for name, module in modules.items():
                    legacy = name.startswith("old") and old_rev == LEGACY
                    kw = (old_kw if legacy else new_kw)(decay)
                    call = lambda x: module.causal_linear_attention(*x, chunk, **kw)  # noqa: B023
                    if name == "new parts":  # first: after the last kind's largest T it is slow
                        with torch.no_grad():
                            call([q, k, v])  # untimed
                    for what in ("fwd", "fwd+bwd"):
                        x = [t.clone().requires_grad_(what != "fwd") for t in (q, k, v)]
                        with torch.set_grad_enabled(what != "fwd"):
                            t0 = time.perf_counter()
                            out = call(x)
                            if what != "fwd":
                                out.backward(cot)
                            ms = 1e3 * (time.perf_counter() - t0)
                        key = (kind, T, name, what)
                        best[key] = min(best.get(key, math.inf), ms)
        print(f"# round {r + 1} of {rounds} done", flush=True)
    for kind in KINDS:
        print(f"\n## {kind}: best of {rounds} interleaved rounds, ms, per 1K tokens, and ratios")
        head = ["T"] + [
            f"{w} {c}" for w in ("fwd", "fwd+bwd")
            for c in ("new whole ms", "per 1K", "new/old whole", "new parts ms", "new/old parts",
                      "new whole/parts")
        ]  # fmt: skip
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for T in lengths:
            cells = [str(T)]
            for w in ("fwd", "fwd+bwd"):
                ms = {name: best[kind, T, name, w] for name in modules}
                whole, parts = ms["new whole"], ms["new parts"]
                cells += [f"{whole:.1f}", f"{1024 * whole / T:.2f}"]
                cells += [f"{whole / ms['old whole']:.2f}x", f"{parts:.1f}"]
                cells += [f"{parts / ms['old parts']:.2f}x", f"{whole / parts:.2f}x"]
            print("| " + " | ".join(cells) + " |", flush=True)
    decode_table(modules["old whole"], rounds, old_rev == LEGACY)


def decode_table(old, rounds, legacy=True, tokens=200):
    """One decoding step (log space, B = 1): the old version's step (a8b0657's recurrent_step, or
    a later version's chunked form on one token) against the new one, interleaved, µs per token."""
    old_step = old.recurrent_step if legacy else None
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, tokens, D, generator=gen) for _ in range(3))
    steps = {
        "new": lambda s, t: causal_linear_attention(*t, 1, state=s, log_space=True),
        "old": lambda s, t: (
            old_step(s, *t, log_space=True)
            if legacy
            else old.causal_linear_attention(*t, 1, state=s, log_space=True)
        ),
    }
    best = {}
    with torch.no_grad():
        for _ in range(rounds):
            for name, step in steps.items():
                state = LinearState() if name == "new" else old.LinearState()
                parts = list(zip(*(x.split(1, 2) for x in (q, k, v))))
                t0 = time.perf_counter()
                for t in parts:
                    step(state, t)
                us = 1e6 * (time.perf_counter() - t0) / tokens
                best[name] = min(best.get(name, math.inf), us)
    print(f"\n## decoding, log space: new {best['new']:.0f} µs/token, old {best['old']:.0f}, "
          f"new/old {best['new'] / best['old']:.2f}x")  # fmt: skip


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="T up to 4096, one chunk size")
    p.add_argument(
        "--training", action="store_true", help="only forward and forward+backward times"
    )
    p.add_argument("--lengths", help="comma-separated T to measure instead of the default range")
    p.add_argument(
        "--chunks",
        default="64,128,256",
        help="chunk sizes to compare; the first is the default used",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument(
        "--cpu-time", action="store_true", help="time by process CPU time, not wall time"
    )
    p.add_argument("--rounds", type=int, default=3, help="--training: interleaved rounds")
    p.add_argument("--old", default=LEGACY, help="--training: the git revision to compare with")
    p.add_argument("--worker", nargs=3, metavar=("WHAT", "METHOD", "T"), help=argparse.SUPPRESS)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    chunks = [int(c) for c in a.chunks.split(",")]
    if a.worker:
        return worker(
            *a.worker[:2],
            int(a.worker[2]),
            chunks[0],
            a.device,
            time.process_time if a.cpu_time else time.perf_counter,
        )

    lengths = (
        [int(T) for T in a.lengths.split(",")]
        if a.lengths
        else [1024 * 2**i for i in range(6)]
        if a.training
        else [256 * 2**i for i in range(5 if a.quick else 8)]
    )
    chunk = chunks[0]
    print(
        f"# torch {torch.__version__}, device {a.device}, {a.threads} threads, "
        f"{'CPU' if a.cpu_time else 'wall'} time, load average at start {os.getloadavg()[0]:.1f}; "
        f"B=1 H={H} d={D} M={M} fp32, chunk={chunk}"
    )
    if a.training:
        return compare(lengths, chunk, a.rounds, a.old)
    head = (
        "T",
        "chunked ms",
        "sdpa ms",
        "naive ms",
        "sdpa/chunked",
        "naive/chunked",
        "chunked MB",
        "sdpa MB",
        "naive MB",
        "chunked GF/s",
        "matmul GF/s",
        "roofline",
    )
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head), flush=True)
    crossover, notes = None, []
    for T in lengths:
        ms, mb = {}, {}
        for what, into, methods in (
            ("ms", ms, ("chunked", "sdpa", "naive", "matmul")),
            ("mb", mb, ("chunked", "sdpa", "naive")),
        ):
            for method in methods:
                into[method], note = measure(what, method, T, chunk, a)
                notes += [note] if note else []
        gf = chunked_flops(T, chunk) / ms["chunked"] / 1e6
        gf_mm = 2 * matmul_side(T, chunk) ** 3 / ms["matmul"] / 1e6
        if ms["sdpa"] > ms["chunked"] and crossover is None:
            crossover = T
        elif not ms["sdpa"] > ms["chunked"]:
            crossover = None  # the chunked form must stay ahead from the crossover on
        print(
            f"| {T} | {ms['chunked']:.1f} | {ms['sdpa']:.1f} | {ms['naive']:.1f} | "
            f"{ms['sdpa'] / ms['chunked']:.2f}x | {ms['naive'] / ms['chunked']:.2f}x | "
            f"{mb['chunked']:.0f} | {mb['sdpa']:.0f} | {mb['naive']:.0f} | {gf:.1f} | "
            f"{gf_mm:.1f} | {100 * gf / gf_mm:.0f}% |",
            flush=True,
        )
    print(
        f"\ncrossover: the chunked form is faster than SDPA from T = {crossover} on"
        if crossover
        else "\ncrossover: the chunked form does not stay ahead of SDPA in this range"
    )
    for note in notes:
        print("note:", note)
    if len(chunks) > 1 and not a.quick:
        print(
            "\n## chunk size (chunked form, ms)\n| T | "
            + " | ".join(f"chunk {c}" for c in chunks)
            + " |\n|"
            + "---|" * (len(chunks) + 1),
            flush=True,
        )
        for T in (1024, 8192, 32768):
            print(
                f"| {T} | "
                + " | ".join(f"{measure('ms', 'chunked', T, c, a)[0]:.1f}" for c in chunks)
                + " |",
                flush=True,
            )


if __name__ == "__main__":
    main()
