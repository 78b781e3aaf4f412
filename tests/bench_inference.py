"""Inference benchmark: softmax teacher (SDPA, KV cache) against its linear-attention student
(chunked prefill, fixed recurrent state), printed as tables. Not a test: nothing here passes or
fails.

    python tests/bench_inference.py [--quick] [--device cuda] [--models standin,gpt2-small]
                                    [--threads N] [--contexts 1024,8192] [--batch B]
                                    [--tables prefill,decode,sequence]

Models: the GPT-2 stand-in (../shared/weights/standin-gpt2, positions tiled past its 1024 for timing
only) and a random-weight model with GPT-2 small's shape (12 layers, 12 heads, 768 wide, vocab
50257, weights seeded N(0, 0.02), positions extended to 16K+). Every measurement runs in a fresh
subprocess.
- Prefill: one call on T tokens filling the caches, as generate() does. Peak memory is the
  process's own accounting above its state once the model is built and warmed up: on CPU (Linux,
  glibc) the kernel's RSS high-water mark VmHWM, restarted through /proc/self/clear_refs after
  malloc_trim; on GPU torch.cuda.max_memory_allocated. It includes the [T, V] logits, which
  generate() also pays.
- Decode: teacher and student in one process, reaching each context by chunked prefill, their
  single-token steps interleaved so that a shared machine's changing load hits both alike; medians
  of single steps. Times include the LM head ([D] x [D, V] per token, the same for both); it is
  timed alone too, with the speed-up without it. KV cache bytes: 2·layers·heads·64·T·itemsize in
  use; student state bytes: the LinearState tensors, exactly.
On a machine shared with other jobs, run with OMP_WAIT_POLICY=PASSIVE: OpenMP threads that spin
between parallel regions then steal the core of their own main thread, and the many small ops of a
decode step slow down ~70x.
"""

import argparse
import copy
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from dofmini.generate import generate  # noqa: E402
from dofmini.hub import load  # noqa: E402
from dofmini.model import Config, Model  # noqa: E402
from dofmini.students import replace_attention  # noqa: E402

STANDIN = REPO.parent / "shared" / "weights" / "standin-gpt2"
WIKI = REPO.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.valid.raw"
SEED, BUDGET, WARMUP = 0, 64, 3
SHAPES = {"standin": (6, 4), "gpt2-small": (12, 12)}  # (layers, heads); head size 64 in both


def build(name: str, n_ctx: int, dims, device: str, dtype: torch.dtype):
    """The teacher (dims None) or its student with dims[i] features in layer i; n_ctx positions."""
    if name == "standin":
        base = load(STANDIN)
        model = Model(Config(**{**vars(base.config), "n_ctx": n_ctx}))
        state = base.state_dict()
        tiles = -(-n_ctx // len(state["wpe"]))
        state["wpe"] = state["wpe"].repeat(tiles, 1)[:n_ctx]  # [n_ctx, D] timing only past 1024
        model.load_state_dict(state)
    else:
        model = Model(Config("gpt2", 12, 12, 768, 3072, 50257, n_ctx, name="gpt2-small-random"))
        gen = torch.Generator().manual_seed(SEED)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.02, generator=gen)
    model = model.to(device, dtype).eval()
    if dims is None:
        return model
    return replace_attention(model, dims, SEED).to(device)  # new features: fp32


def sync(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def reset_peak(device: str) -> int:
    """Restart peak accounting here; returns the memory in use now (the baseline)."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    # glibc: hand freed heap pages back, so later use shows in the RSS
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    # Linux: restart the RSS high-water mark (VmHWM) from now
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return peak_bytes(device)


def peak_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated()
    # VmHWM, not getrusage's ru_maxrss: the latter also holds the parent's peak,
    # inherited at fork/exec
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024  # reported in kB


def cache_bytes(caches) -> int:
    return sum(
        t.numel() * t.element_size() for c in caches for t in vars(c).values() if torch.is_tensor(t)
    )


def decode_sweep(teacher, student, ids, contexts, steps: int, dev: str) -> list:
    """Rows of decode time per token at each context, teacher and student steps interleaved.

    See the module docstring.
    """
    models = (teacher, student)
    caches = [[b.attn.new_cache(ids.shape[0], ids.shape[1]) for b in m.blocks] for m in models]
    x = torch.randn(
        ids.shape[0], 1, teacher.config.d_model, device=dev, dtype=teacher.wte.dtype
    )  # [B, 1, D]
    rows, pos = [], 0
    for T in contexts:
        for lo in range(pos, T, 1024):
            for m, c in zip(models, caches):
                m(ids[:, lo : min(T, lo + 1024)], lo, c)
        times = [[], [], []]  # teacher, student, LM head alone
        for t in range(T, T + WARMUP + steps):
            for i, (m, c) in enumerate(zip(models, caches)):
                times[i].append(timed(lambda m=m, c=c, t=t: m(ids[:, t : t + 1], t, c), dev))
            times[2].append(timed(lambda: teacher.ln_f(x) @ teacher.head.T, dev))  # [B, 1, V]
        pos = T + WARMUP + steps
        # medians of single steps: robust to the bursts of a machine shared with other jobs
        ms = [1e3 * statistics.median(ts[WARMUP:]) for ts in times]
        rows.append(
            {
                "T": T,
                "teacher_ms": ms[0],
                "student_ms": ms[1],
                "head_ms": ms[2],
                "state_bytes": cache_bytes(caches[1]),
            }
        )
    return rows


@torch.no_grad()
def worker(job: dict) -> dict:
    """One measurement in this (fresh) process.

    See the module docstring for what the memory figures hold.
    """
    torch.set_num_threads(job["threads"])
    dev, dtype, B = job["device"], getattr(torch, job["dtype"]), job["batch"]
    model = build(
        job["model"], job["n_ctx"], job["dims"] if job["mode"] != "sweep" else None, dev, dtype
    )
    ids = torch.randint(
        0, model.config.vocab_size, (B, job["n_ctx"]), generator=torch.Generator().manual_seed(SEED)
    )
    ids = ids.to(dev)  # [B, n_ctx]
    model(ids[:, :64])  # warm-up: thread pools, allocator
    sync(dev)
    base = reset_peak(dev)
    if job["mode"] == "prefill":  # T tokens in one call, filling the caches as generate() does
        T = job["T"]
        fill = lambda: model(ids[:, :T], 0, [b.attn.new_cache(B, T) for b in model.blocks])  # noqa: E731
        out = {"prefill_s": min(timed(fill, dev) for _ in range(job["reps"]))}
    elif job["mode"] == "sweep":
        student = replace_attention(copy.deepcopy(model), job["dims"], SEED).to(dev)
        out = {"rows": decode_sweep(model, student, ids, job["contexts"], job["steps"], dev)}
    else:
        # one sequence (batch 1) of L tokens: a chunked/SDPA forward, and generating it from a
        # 1-token prompt
        L = job["seq_len"]
        out = {
            "forward_s": min(timed(lambda: model(ids[:1, :L]), dev) for _ in range(job["reps"])),
            "generate_s": timed(lambda: generate(model, ids[:1, :1], L - 1), dev),
            "itemsize": dtype.itemsize,
        }
    out["peak_bytes"] = peak_bytes(dev) - base
    return out


def run(job: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True, text=True
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"worker {job} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    # progress, and the raw numbers
    print("measured", job, lines[-1][7:], file=sys.stderr, flush=True)
    return json.loads(lines[-1][7:])


def standin_dof():
    """Layer DoF of the stand-in (Algorithm 1: J=1024, λ=2⁻⁴, G/J).

    On WikiText-2 valid, in 256-token windows.
    """
    from dofmini.dof import estimate_dof
    from dofmini.hub import load_tokenizer

    tokens = (
        load_tokenizer(STANDIN).encode(WIKI.read_text(encoding="utf-8")[:200_000]).ids[: 64 * 256]
    )
    dof = estimate_dof(
        load(STANDIN), torch.tensor(tokens), 2**-4, J=1024, seed=SEED, ctx=256
    )  # [L, H]
    return dof.amax(-1).tolist()


def variant_dims(layer_dof, n_layer):
    """Fix / DoF / DoF+clip dims at mean BUDGET features per layer (Algorithm 1, steps 6-7)."""
    from dofmini.dof import allocate

    # stretch a 6-layer profile to 12
    dof = [layer_dof[i * len(layer_dof) // n_layer] for i in range(n_layer)]
    return {
        "fix": [BUDGET] * n_layer,
        "dof": allocate(dof, BUDGET),
        "dof_clip": allocate(dof, BUDGET, cap=BUDGET),
    }


def mib(b):
    return f"{b / 2**20:9.1f}"


def prefill_table(name, Ts, common):
    n_layer = SHAPES[name][0]
    rows = {
        (T, kind): run(
            {
                **common,
                "model": name,
                "dims": dims,
                "mode": "prefill",
                "T": T,
                "reps": 3 if T <= 2048 else 1,
            }
        )
        for T in Ts
        for kind, dims in (("teacher", None), ("student", [BUDGET] * n_layer))
    }
    print(
        f"\n## {name}: prefill of T tokens in one call, caches filled "
        f"(student: M={BUDGET} per layer, chunk 64)"
    )
    print("      T | teacher s | student s | teacher/student | peak MiB teacher | peak MiB student")
    for T in Ts:
        t, s = rows[T, "teacher"], rows[T, "student"]
        print(
            f"{T:7d} | {t['prefill_s']:9.3f} | {s['prefill_s']:9.3f} | "
            f"{t['prefill_s'] / s['prefill_s']:15.2f} "
            f"|        {mib(t['peak_bytes'])} |        {mib(s['peak_bytes'])}"
        )
    faster = [T for T in Ts if rows[T, "student"]["prefill_s"] < rows[T, "teacher"]["prefill_s"]]
    cross = next((T for T in Ts if all(u in faster for u in Ts if u >= T)), None)
    print(
        f"crossover: the student prefills faster from T = {cross} on"
        if cross
        else "crossover: the student is not faster from any T measured on"
    )


def decode_table(name, Ts, common, steps):
    n_layer, n_head = SHAPES[name]
    r = run(
        {
            **common,
            "model": name,
            "dims": [BUDGET] * n_layer,
            "mode": "sweep",
            "contexts": Ts,
            "steps": steps,
        }
    )
    kv_per_token = (
        2 * n_layer * common["batch"] * n_head * 64 * getattr(torch, common["dtype"]).itemsize
    )
    print(
        f"\n## {name}: decode time per token at context T "
        "(one process, teacher and student steps interleaved; "
        f"median of {steps} steps after {WARMUP} warm-up)"
    )
    print(
        "      T | teacher ms | student ms | speed-up | LM head ms | speed-up w/o head "
        "| KV cache MiB | student state MiB"
    )
    for row in r["rows"]:
        t, s, head = row["teacher_ms"], row["student_ms"], row["head_ms"]
        print(
            f"{row['T']:7d} | {t:10.2f} | {s:10.2f} | {t / s:8.2f} | {head:10.2f} | "
            f"{(t - head) / (s - head):17.2f} "
            f"|    {mib(kv_per_token * row['T'])} |         {mib(row['state_bytes'])}"
        )
    rows = [row for row in r["rows"] if row["T"] >= 1024] or r["rows"]
    flat = [row["student_ms"] for row in rows]
    print(
        f"from T = {rows[0]['T']} to {rows[-1]['T']}: "
        f"student decode max/min = {max(flat) / min(flat):.2f}; "
        f"teacher {rows[-1]['teacher_ms'] / rows[0]['teacher_ms']:.2f}x slower at the end"
    )


def sequence_table(name, layer_dof, common, seq_len):
    n_layer, n_head = SHAPES[name]
    print(
        f"\n## {name}: one {seq_len}-token sequence, batch 1, "
        f"equal budget (mean {BUDGET} features per layer)"
        + (
            ""
            if name == "standin"
            else "; dims: the stand-in's DoF profile, each layer twice (illustrative)"
        )
    )
    print("variant            | total M | forward s | generate s | cache KiB at the end | dims")
    for label, dims in {"teacher (softmax)": None, **variant_dims(layer_dof, n_layer)}.items():
        r = run(
            {
                **common,
                "model": name,
                "dims": dims,
                "mode": "sequence",
                "seq_len": seq_len,
                "reps": 3,
            }
        )
        # fp32 LinearState [H, M, d + 1] per layer,
        # or the KV cache of seq_len positions (model dtype)
        cache = (
            4 * n_head * 65 * sum(dims)
            if dims
            else 2 * n_layer * n_head * 64 * seq_len * r["itemsize"]
        )
        print(
            f"{label:18s} | {sum(dims) if dims else '-':>7} | {r['forward_s']:9.3f} | "
            f"{r['generate_s']:10.3f} | {cache / 1024:20.1f} | {dims or 'softmax'}"
        )


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="contexts 512-2048, 8 decode steps, 256-token sequences",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--models", default="standin,gpt2-small")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument(
        "--batch", type=int, default=1, help="sequences per call in the prefill and decode tables"
    )
    ap.add_argument("--contexts", help="comma-separated T, increasing, instead of the default list")
    ap.add_argument("--tables", default="prefill,decode,sequence")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))))
        return
    Ts = [512, 1024, 2048] if args.quick else [512, 1024, 2048, 4096, 8192, 16384]
    Ts = [int(T) for T in args.contexts.split(",")] if args.contexts else Ts
    steps, seq_len = (8, 256) if args.quick else (32, 1000)
    common = {
        "device": args.device,
        "dtype": args.dtype,
        "threads": args.threads,
        "batch": args.batch,
        "n_ctx": max(Ts[-1], seq_len) + 64,
    }
    print(
        f"torch {torch.__version__}, device {args.device}, {args.dtype}, {args.threads} threads, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, "
        f"load average {os.getloadavg()[0]:.2f}; "
        f"seed {SEED}; batch {args.batch}"
    )
    layer_dof = None
    if "sequence" in args.tables:
        if not (STANDIN.exists() and WIKI.exists()):
            print(f"{STANDIN} or {WIKI} is absent: no DoF dims, so no Fix/DoF/DoF+clip table")
        else:
            layer_dof = standin_dof()
            print(
                "stand-in layer DoF (J=1024, lambda=2^-4, G/J, WikiText-2 valid):",
                [round(x, 1) for x in layer_dof],
            )
    for name in args.models.split(","):
        if name == "standin" and not STANDIN.exists():
            print(f"\n{STANDIN} is absent: skipping the stand-in")
            continue
        if "prefill" in args.tables:
            prefill_table(name, Ts, common)
        if "decode" in args.tables:
            decode_table(name, Ts, common, steps)
        if layer_dof is not None:
            sequence_table(name, layer_dof, common, seq_len)
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
