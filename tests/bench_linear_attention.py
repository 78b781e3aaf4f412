"""Speed and memory of causal PRF linear attention (issues 13, 14, 33): tables, not pass/fail.

    python tests/bench_linear_attention.py [--quick] [--lengths 1024,4096] [--rounds R]
        [--device cpu|cuda] [--threads N] [--cpu-time] [--old REV] [--default-heap]

B = 1, 12 heads, d = M = 64, fp32, chunk 64, T = 1K to 32K (--quick: 1K to 4K, fewer rounds and
decoding steps). One run prints:
- log/plain: causal_linear_attention in log space (log-features N(0, 1), as LinearAttention runs
  it) against the plain form on features Φ = exp of the same draws, forward and forward+backward
  (gradients for the three inputs against a fixed random cotangent), each run two ways: whole (the
  sequence in one part, as on a GPU) and in parts (CPU_PART tokens at a time, as on CPU; a GPU
  takes one part either way). Every (T, pass, form, way) is timed once per round, all
  interleaved, one untimed call first; a timing spans at least 8K tokens of calls (8 calls at
  T = 1K), so one interruption weighs less; best of rounds (other processes on a shared machine only
  add time). Also ms per 1K tokens (flat: linear in T), whole/parts, and --old REV's module (e.g.
  cd447bd, its dofmini/ extracted from git into a temp folder; or a tree's folder) timed in the
  same rounds, new/old.
- decoding: one token at a time from a prefilled state (T = 1, no autograd), µs per token, log
  and plain interleaved, best of rounds.
- peak memory of one forward call above what its inputs hold, per (T, form, way): on CUDA
  torch.cuda.max_memory_allocated; on CPU the kernel's peak RSS (VmHWM, reset through
  /proc/self/clear_refs) in a fresh subprocess with glibc told to map every allocation over 64 KiB
  on its own (MALLOC_MMAP_THRESHOLD_), so freed tensors go back at once and a reused heap cannot
  hide a peak (not for timing: every allocation then faults in fresh pages).
- acceptance (issue 33): the largest log/plain over T per pass on the device's default way (CPU
  parts, a GPU whole), best of rounds and the median of each round's own ratio, time per token at
  the longest T over the shortest per way, log decoding.
--cpu-time times by process CPU time, which on a busy shared machine leaves out the time other
processes hold the cores (fair with --threads 1, the default).

On CPU the script runs itself again with glibc told to keep freed memory (HEAP below) unless
--default-heap: by default glibc hands a call's freed temporaries back to the kernel and the next
call faults them in again, page by page, at a cost set by the heap's history rather than by the
form (a caching allocator, as torch has on CUDA, never pays it). The page faults per call are
printed either way, so the two settings can be told apart.
"""

import argparse
import importlib
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
H, D, CHUNK = 12, 64, 64
FORMS = ("plain", "log")
HEAP = {"MALLOC_MMAP_THRESHOLD_": str(2**25), "MALLOC_TRIM_THRESHOLD_": str(2**30)}  # 32 MiB, 1 GiB


def load(package, name, way=None):
    """linear_attention.py of the dofmini folder `package` as a fresh module (its siblings with
    it, the package's __init__ not run), set to run `way`: whole (one part on any device), parts
    (CPU_PART tokens at a time; a GPU always takes one part) or None (its own device rule)."""
    root = types.ModuleType(f"{name}_{way}")
    root.__path__ = [str(package)]
    sys.modules[root.__name__] = root
    module = importlib.import_module(f"{root.__name__}.linear_attention")
    if way == "whole":
        module.CPU_PART = sys.maxsize
    return module


def old_path(rev):
    """The dofmini folder as of git revision rev, extracted to a temp folder (or rev itself, when
    it names a folder: a tree without git, e.g. on a remote machine; its dofmini/ if it has one)."""
    if Path(rev).is_dir():
        return Path(rev) / "dofmini" if (Path(rev) / "dofmini").is_dir() else Path(rev)
    tree = Path(tempfile.mkdtemp())
    archive = subprocess.run(["git", "archive", rev, "dofmini"], cwd=REPO, capture_output=True,
                             check=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree / "dofmini"


def draws(T, device, form):
    """q, k, v [1, H, T, D] and a cotangent, seeded by T: log-features or features Φ = exp."""
    gen = torch.Generator().manual_seed(T)
    a, b, v, cot = (torch.randn(1, H, T, D, generator=gen).to(device) for _ in range(4))
    return (a, b, v, cot) if form == "log" else (a.exp(), b.exp(), v, cot)


class Clock:
    def __init__(self, device, cpu_time):
        self.cuda = device.startswith("cuda")
        self.now = time.process_time if cpu_time else time.perf_counter

    def __call__(self, fn):
        """fn's time in ms, the device's queue drained before and after."""
        self.sync()
        t0 = self.now()
        fn()
        self.sync()
        return 1e3 * (self.now() - t0)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def call(module, form, x, cot=None):
    """One forward (cot None) or forward+backward of module's attention on x = [q, k, v]."""
    with torch.set_grad_enabled(cot is not None):
        x = [t.detach().requires_grad_(cot is not None) for t in x]  # fresh leaves, no .grad
        out = module.causal_linear_attention(*x, CHUNK, log_space=form == "log")
        if cot is not None:
            out.backward(cot)


def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def training(modules, lengths, rounds, device, clock):
    """ms per call per (T, pass, module name, form), a list with one time per round, all
    interleaved; and page faults per call, summed over rounds."""
    times, faulted = {}, {}
    for r in range(rounds):
        for T in lengths:
            calls = max(1, 8192 // T)
            for form in FORMS:
                q, k, v, cot = draws(T, device, form)
                for name, module in modules.items():
                    if r == 0:
                        call(module, form, [q, k, v])  # untimed
                    for what in ("fwd", "fwd+bwd"):
                        grad = cot if what != "fwd" else None
                        x, before = [q, k, v], faults()
                        ms = clock(lambda: [call(module, form, x, grad) for _ in range(calls)])  # noqa: B023
                        key = (T, what, name, form)
                        times.setdefault(key, []).append(ms / calls)
                        faulted[key] = faulted.get(key, 0) + (faults() - before) / calls / rounds
        print(f"# round {r + 1} of {rounds} done", flush=True)
    return times, faulted


def training_tables(best, lengths, names, default):
    for what in ("fwd", "fwd+bwd"):
        print(f"\n## {what}: ms, best of rounds; log/plain on the device's default way ({default})")
        head = ["T"] + [f"{f} {n}" for n in names for f in FORMS]
        head += [f"log/plain {n}" for n in names] + ["per 1K whole plain / log"]
        head += ["whole/parts plain / log"] + [f"new/old {f}" for f in FORMS if "old" in names]
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for T in lengths:
            ms = {(n, f): best[T, what, n, f] for n in names for f in FORMS}
            cells = [str(T)] + [f"{ms[n, f]:.1f}" for n in names for f in FORMS]
            cells += [f"{ms[n, 'log'] / ms[n, 'plain']:.2f}" for n in names]
            cells += [" / ".join(f"{1024 * ms['whole', f] / T:.1f}" for f in FORMS)]
            cells += [" / ".join(f"{ms['whole', f] / ms['parts', f]:.2f}" for f in FORMS)]
            if "old" in names:
                cells += [f"{ms[default, f] / ms['old', f]:.2f}" for f in FORMS]
            print("| " + " | ".join(cells) + " |", flush=True)


def decoding(module, rounds, steps, device, clock, prefill=256):
    """µs per token of steps single-token calls from a state after `prefill` tokens, per form."""
    best = {}
    with torch.no_grad():
        for _ in range(rounds):
            for form in FORMS:
                q, k, v, _ = draws(prefill + steps, device, form)
                state = module.LinearState()
                part = [t[:, :, :prefill] for t in (q, k, v)]
                module.causal_linear_attention(*part, CHUNK, state=state, log_space=form == "log")
                tokens = list(zip(*(t[:, :, prefill:].split(1, 2) for t in (q, k, v))))

                def run(tokens=tokens, state=state, log=form == "log"):
                    for x in tokens:
                        module.causal_linear_attention(*x, 1, state=state, log_space=log)

                us = 1e3 * clock(run) / steps
                best[form] = min(best.get(form, math.inf), us)
    print(f"\n## decoding (T = 1 from a state of {prefill} tokens, H = {H}, M = {D}): µs/token "
          f"plain {best['plain']:.0f}, log {best['log']:.0f}, "
          f"log/plain {best['log'] / best['plain']:.2f}")  # fmt: skip
    return best


def acceptance(best, lengths, default, decode, times, faulted):
    """Issue 33's figures in one place: the largest log/plain over T per pass (default way), best
    of rounds and the median over rounds of each round's own ratio (a slow round on a shared
    machine moves it less), the growth of time per token from the shortest T to the longest per
    way, log decoding."""
    print(f"\n## acceptance (log/plain on the {default} way; growth: ms per 1K tokens at "
          f"T = {lengths[-1]} over T = {lengths[0]})")  # fmt: skip
    short, long = lengths[0], lengths[-1]
    for what in ("fwd", "fwd+bwd"):
        ms = {(T, f): best[T, what, default, f] for T in lengths for f in FORMS}
        ratio = {T: ms[T, "log"] / ms[T, "plain"] for T in lengths}
        worst = max(ratio, key=ratio.get)
        rounds = {T: zip(*(times[T, what, default, f] for f in ("log", "plain"))) for T in lengths}
        median = {T: statistics.median(a / b for a, b in rounds[T]) for T in lengths}
        spread = ", ".join(f"{median[T]:.2f}" for T in lengths)
        print(f"- log/plain {what}: at most {ratio[worst]:.2f} (T = {worst}); median of per-round "
              f"ratios by T: {spread}")  # fmt: skip
    for what in ("fwd", "fwd+bwd"):
        for way in ("whole", "parts"):
            growth = [best[long, what, way, f] / best[short, what, way, f] for f in FORMS]
            growth = " / ".join(f"{g * short / long:.2f}" for g in growth)
            print(f"- growth {what} {way}, plain / log: {growth}")
    ratio = decode["log"] / decode["plain"]
    print(f"- decoding, log: {decode['log']:.0f} µs per token, {ratio:.2f} x the plain step")
    for what in ("fwd", "fwd+bwd"):
        cells = [" / ".join(f"{faulted[T, what, default, f]:.0f}" for f in FORMS) for T in lengths]
        print(f"- page faults per call {what}, plain / log by T: {', '.join(cells)}")


def rss_kb(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_mb(module, form, T, device):
    """Extra MB at peak during one forward call after a warm-up, over what the inputs hold."""
    x = list(draws(T, device, form)[:3])
    call(module, form, x)  # warm-up: pages in the code the call runs
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        call(module, form, x)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    Path("/proc/self/clear_refs").write_text("5")  # the peak RSS restarts at the current RSS
    before = rss_kb("VmRSS")
    call(module, form, x)
    return (rss_kb("VmHWM") - before) / 1024


def memory_table(lengths, a):
    """Peak MB per (T, form, way), each from a fresh subprocess on CPU."""
    print("\n## peak memory of one forward, MB above the inputs")
    cells = [f"{f} {w}" for w in ("whole", "parts") for f in FORMS]
    print("| T | " + " | ".join(cells) + " |\n|" + "---|" * (len(cells) + 1))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    for T in lengths:
        row = []
        for way in ("whole", "parts"):
            for form in FORMS:
                cmd = [sys.executable, __file__, "--memory", way, form, str(T)]
                cmd += ["--device", a.device, "--threads", str(a.threads)]
                out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                failed = out.returncode or not out.stdout.strip()
                row.append("failed" if failed else f"{float(out.stdout):.0f}")
        print(f"| {T} | " + " | ".join(row) + " |", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="T = 1K-4K, 2 rounds, 50 decoding steps")
    p.add_argument("--lengths", help="comma-separated T instead of 1K-32K")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 3, --quick 2)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cpu-time", action="store_true", help="process CPU time, not wall time")
    p.add_argument("--old", help="git revision whose module is timed alongside (its default way)")
    p.add_argument("--default-heap", action="store_true", help="glibc's own trimming (see above)")
    p.add_argument("--memory", nargs=3, metavar=("WAY", "FORM", "T"), help=argparse.SUPPRESS)
    a = p.parse_args()
    kept = all(os.environ.get(name) == value for name, value in HEAP.items())
    if a.device == "cpu" and not a.default_heap and not a.memory and not kept:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **HEAP})
    torch.set_num_threads(a.threads)
    path = REPO / "dofmini"
    if a.memory:
        way, form, T = a.memory
        return print(peak_mb(load(path, "new", way), form, int(T), a.device))
    top = 4096 if a.quick else 32768
    lengths = [int(T) for T in a.lengths.split(",")] if a.lengths else []
    lengths = lengths or [1024 * 2**i for i in range(int(math.log2(top // 1024)) + 1)]
    rounds = a.rounds or (2 if a.quick else 3)
    load_avg = os.getloadavg()[0]
    heap = " ".join(f"{name}={value}" for name, value in HEAP.items()) if kept else "default"
    print(f"# torch {torch.__version__}, device {a.device}, {a.threads} threads, "
          f"{'CPU' if a.cpu_time else 'wall'} time, load average at start {load_avg:.1f}; "
          f"B=1 H={H} d=M={D} fp32, chunk {CHUNK}; glibc heap: {heap}")  # fmt: skip
    modules = {way: load(path, "new", way) for way in ("whole", "parts")}
    if a.old:
        modules["old"] = load(old_path(a.old), "old")
    default = "parts" if a.device == "cpu" else "whole"
    clock = Clock(a.device, a.cpu_time)
    times, faulted = training(modules, lengths, rounds, a.device, clock)
    best = {key: min(ms) for key, ms in times.items()}
    training_tables(best, lengths, list(modules), default)
    decode = decoding(modules[default], rounds, 50 if a.quick else 200, a.device, clock)
    memory_table(lengths, a)
    acceptance(best, lengths, default, decode, times, faulted)


if __name__ == "__main__":
    main()
