"""Inference benchmark: softmax teacher (SDPA, KV cache) against its linear-attention student (chunked prefill,
fixed recurrent state), printed as tables. Not a test: nothing here passes or fails.

    python tests/bench_inference.py [--quick] [--device cuda] [--models standin,gpt2-small] [--threads N]
                                    [--contexts 1024,8192] [--batch B] [--no-sequences]

Models: the GPT-2 stand-in (../shared/weights/standin-gpt2, positions tiled past its 1024 for timing only) and a
random-weight model with GPT-2 small's shape (12 layers, 12 heads, 768 wide, vocab 50257, weights seeded
N(0, 0.02), positions extended to 16K+). Every measurement runs in a fresh subprocess. Peak memory is that
process's own accounting above its state once the model is built and warmed up: on CPU (Linux, glibc) the
kernel's RSS high-water mark VmHWM, restarted through /proc/self/clear_refs after malloc_trim; on GPU
torch.cuda.max_memory_allocated. It includes the [T, V] logits of the prefill, which generate() also pays.
Decode times include the LM head ([D] x [D, V] per token, the same for teacher and student); it is timed alone
too, and the speed-up without it is given beside.
Cache bytes are exact: the KV buffers (allocated for context + decode steps) or the LinearState tensors.
On a machine shared with other jobs, run with OMP_WAIT_POLICY=PASSIVE: OpenMP threads that spin between parallel
regions then steal the core of their own main thread, and the many small ops of a decode step slow down ~70x.
"""
import argparse
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
from dofmini.linear_attention import replace_attention  # noqa: E402
from dofmini.model import Config, Model, load  # noqa: E402

STANDIN = REPO.parent / "shared" / "weights" / "standin-gpt2"
WIKI = REPO.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.valid.raw"
SEED, BUDGET, WARMUP = 0, 64, 3
SHAPES = {"standin": (6, 4), "gpt2-small": (12, 12)}  # (layers, heads); head size 64 in both


def build(name: str, n_ctx: int, dims, device: str, dtype: torch.dtype):
    """The teacher (dims None) or its student with dims[i] features in layer i, positions up to n_ctx."""
    if name == "standin":
        base = load(STANDIN)
        model = Model(Config(**{**vars(base.config), "n_ctx": n_ctx}))
        state = base.state_dict()
        state["wpe"] = state["wpe"].repeat(-(-n_ctx // len(state["wpe"])), 1)[:n_ctx]  # timing only past 1024
        model.load_state_dict(state)
    else:
        model = Model(Config("gpt2", 12, 12, 768, 3072, 50257, n_ctx, name="gpt2-small-random"))
        gen = torch.Generator().manual_seed(SEED)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.02, generator=gen)
    model = model.to(device, dtype).eval()
    return model if dims is None else replace_attention(model, dims, SEED).to(device)  # new features: fp32


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
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc: hand freed heap pages back, so later use shows in the RSS
    with open("/proc/self/clear_refs", "w") as f:  # Linux: restart the RSS high-water mark (VmHWM) from now
        f.write("5")
    return peak_bytes(device)


def peak_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated()
    # VmHWM, not getrusage's ru_maxrss: the latter also holds the parent's peak, inherited at fork/exec
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024  # reported in kB


def cache_bytes(caches) -> int:
    return sum(t.numel() * t.element_size() for c in caches for t in vars(c).values() if torch.is_tensor(t))


@torch.no_grad()
def worker(job: dict) -> dict:
    """One measurement in this (fresh) process; see the module docstring for what the memory figures hold."""
    torch.set_num_threads(job["threads"])
    dev, dtype = job["device"], getattr(torch, job["dtype"])
    model = build(job["model"], job["n_ctx"], job["dims"], dev, dtype)
    V = model.config.vocab_size
    B = job["batch"]
    ids = torch.randint(0, V, (B, job["n_ctx"]), generator=torch.Generator().manual_seed(SEED)).to(dev)  # [B, n_ctx]
    model(ids[:, :64])  # warm-up: thread pools, allocator
    sync(dev)
    base = reset_peak(dev)
    out = {}
    if job["mode"] == "context":  # prefill T tokens, then time decode steps at context T
        T, steps = job["T"], job["steps"]
        times = []
        for _ in range(job["reps"]):
            caches = [b.attn.new_cache(B, T + WARMUP + steps) for b in model.blocks]
            times.append(timed(lambda: model(ids[:, :T], 0, caches), dev))
        for t in range(T, T + WARMUP):
            model(ids[:, t:t + 1], t, caches)
        # medians of single steps: robust to the bursts of a machine shared with other jobs
        step = [timed(lambda: model(ids[:, t:t + 1], t, caches), dev) for t in range(T + WARMUP, T + WARMUP + steps)]
        x = torch.randn(B, 1, model.config.d_model, device=dev, dtype=dtype)  # [B, 1, D]
        head = [timed(lambda: model.ln_f(x) @ model.head.T, dev) for _ in range(steps)]  # [B, 1, V]
        out = {"prefill_s": min(times), "decode_ms": 1e3 * statistics.median(step),
               "head_ms": 1e3 * statistics.median(head), "cache_bytes": cache_bytes(caches)}
    else:  # one sequence (batch 1) of L tokens: a chunked/SDPA forward, and generating it from a 1-token prompt
        L = job["seq_len"]
        out = {"forward_s": min(timed(lambda: model(ids[:1, :L]), dev) for _ in range(job["reps"])),
               "generate_s": timed(lambda: generate(model, ids[:1, :1], L - 1), dev), "itemsize": dtype.itemsize}
    out["peak_bytes"] = peak_bytes(dev) - base
    return out


def run(job: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"worker {job} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    print("measured", job, lines[-1][7:], file=sys.stderr, flush=True)  # progress, and the raw numbers
    return json.loads(lines[-1][7:])


def standin_dof():
    """Layer DoF of the stand-in (Algorithm 1: J=1024, λ=2⁻⁴, G/J) on WikiText-2 valid, 256-token windows."""
    from dofmini.checkpoint import load_tokenizer
    from dofmini.dof import estimate_dof
    tokens = load_tokenizer(STANDIN).encode(WIKI.read_text(encoding="utf-8")[:200_000]).ids[:64 * 256]
    dof = estimate_dof(load(STANDIN), torch.tensor(tokens), 2**-4, J=1024, seed=SEED, ctx=256)  # [L, H]
    return dof.amax(-1).tolist()


def variant_dims(layer_dof, n_layer):
    """Fix / DoF / DoF+clip dims at mean BUDGET features per layer (Algorithm 1, steps 6-7)."""
    from dofmini.dof import allocate
    dof = [layer_dof[i * len(layer_dof) // n_layer] for i in range(n_layer)]  # stretch a 6-layer profile to 12
    return {"fix": [BUDGET] * n_layer, "dof": allocate(dof, BUDGET), "dof_clip": allocate(dof, BUDGET, cap=BUDGET)}


def mib(b):
    return f"{b / 2**20:9.1f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="contexts 512-2048, 8 decode steps, 256-token sequences")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--models", default="standin,gpt2-small")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--batch", type=int, default=1, help="sequences per prefill/decode call (the 1,000-token table: 1)")
    ap.add_argument("--contexts", help="comma-separated T to measure instead of the default list")
    ap.add_argument("--no-sequences", action="store_true", help="skip the Fix/DoF/DoF+clip table")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))))
        return
    Ts = [512, 1024, 2048] if args.quick else [512, 1024, 2048, 4096, 8192, 16384]
    Ts = [int(T) for T in args.contexts.split(",")] if args.contexts else Ts
    steps, seq_len = (8, 256) if args.quick else (32, 1000)
    common = {"device": args.device, "dtype": args.dtype, "threads": args.threads, "n_ctx": max(Ts[-1], seq_len) + 64,
              "batch": args.batch}
    print(f"torch {torch.__version__}, device {args.device}, {args.dtype}, {args.threads} threads, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, load average {os.getloadavg()[0]:.2f}; "
          f"seed {SEED}; batch {args.batch}")
    layer_dof = None
    if STANDIN.exists() and WIKI.exists() and not args.no_sequences:
        layer_dof = standin_dof()
        print("stand-in layer DoF (J=1024, lambda=2^-4, G/J, WikiText-2 valid):", [round(x, 1) for x in layer_dof])
    for name in args.models.split(","):
        if name == "standin" and not STANDIN.exists():
            print(f"\n{STANDIN} is absent: skipping the stand-in")
            continue
        n_layer, n_head = SHAPES[name]
        rows = {}
        for T in Ts:
            for kind, dims in (("teacher", None), ("student", [BUDGET] * n_layer)):
                rows[T, kind] = run({**common, "model": name, "dims": dims, "mode": "context", "T": T,
                                     "steps": steps, "reps": 3 if T <= 2048 else 1})
        print(f"\n## {name}: prefill of T tokens (one call; student M={BUDGET} per layer, chunk 64)")
        print("      T | teacher s | student s | teacher/student | peak MiB teacher | peak MiB student")
        for T in Ts:
            t, s = rows[T, "teacher"], rows[T, "student"]
            print(f"{T:7d} | {t['prefill_s']:9.3f} | {s['prefill_s']:9.3f} | {t['prefill_s'] / s['prefill_s']:15.2f} "
                  f"|        {mib(t['peak_bytes'])} |        {mib(s['peak_bytes'])}")
        faster = [T for T in Ts if rows[T, "student"]["prefill_s"] < rows[T, "teacher"]["prefill_s"]]
        cross = next((T for T in Ts if all(u in faster for u in Ts if u >= T)), None)
        print(f"crossover: the student prefills faster from T = {cross} on" if cross else
              "crossover: the student is not faster at any T measured (up to the last)")
        print(f"\n## {name}: decode time per token at context T (median of {steps} steps after {WARMUP} warm-up steps)")
        print("      T | teacher ms | student ms | speed-up | LM head ms | speed-up w/o head | KV cache MiB "
              "| student state MiB | peak MiB teacher | peak MiB student")
        for T in Ts:
            t, s = rows[T, "teacher"], rows[T, "student"]
            head = (t["head_ms"] + s["head_ms"]) / 2
            print(f"{T:7d} | {t['decode_ms']:10.2f} | {s['decode_ms']:10.2f} | {t['decode_ms'] / s['decode_ms']:8.2f} "
                  f"| {head:10.2f} | {(t['decode_ms'] - head) / (s['decode_ms'] - head):17.2f} "
                  f"|    {mib(t['cache_bytes'])} |         {mib(s['cache_bytes'])} "
                  f"|        {mib(t['peak_bytes'])} |        {mib(s['peak_bytes'])}")
        long = [T for T in Ts if T >= 1024] or Ts
        flat = [rows[T, "student"]["decode_ms"] for T in long]
        grow = rows[long[-1], "teacher"]["decode_ms"] / rows[long[0], "teacher"]["decode_ms"]
        print(f"from T = {long[0]} to {long[-1]}: student decode max/min = {max(flat) / min(flat):.2f}; "
              f"teacher {grow:.2f}x slower at {long[-1]} than at {long[0]}")
        if layer_dof is None or args.no_sequences:
            continue
        variants = {"teacher (softmax)": None, **variant_dims(layer_dof, n_layer)}
        print(f"\n## {name}: one {seq_len}-token sequence, equal budget (mean {BUDGET} features per layer)"
              + ("" if name == "standin" else "; dims: the stand-in's DoF profile, each layer twice (illustrative)"))
        print("variant            | total M | forward s | generate s | cache KiB at the end | dims")
        for label, dims in variants.items():
            r = run({**common, "model": name, "dims": dims, "mode": "sequence", "seq_len": seq_len, "reps": 3})
            # fp32 LinearState [H, M, d + 1] per layer, or the KV cache of seq_len positions (model dtype)
            cache = 4 * n_head * 65 * sum(dims) if dims else 2 * n_layer * n_head * 64 * seq_len * r["itemsize"]
            total = "-" if dims is None else sum(dims)
            print(f"{label:18s} | {total:>7} | {r['forward_s']:9.3f} | {r['generate_s']:10.3f} | {cache / 1024:20.1f} "
                  f"| {dims or 'softmax'}")
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
