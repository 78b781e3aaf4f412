"""Wall time of degrees_of_freedom at model sizes (run: python tests/bench_dof.py).

GPT-2 small has 12 layers of 12 heads of 64; the paper's estimate took 105 s for GPT-2 on GPUs.
Inputs are Gaussian with a spread of norms like the stand-ins' queries and keys (‖x‖²/√d from about
0.3 to 50).
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dofmini.dof import degrees_of_freedom  # noqa: E402

print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
print(
    f"{'heads':>6} {'J':>5} {'wall s':>7} {'CPU s':>7} {'wall/head':>9}"
    "  DoF range (lam = 2^-4, G/J)"
)
for heads, J in ((24, 1024), (144, 1024), (24, 2048)):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(heads, J, 64, generator=gen) * torch.empty(heads, J, 1).uniform_(
        0.1, 2.5, generator=gen
    )
    wall0 = time.perf_counter()
    cpu0 = time.process_time()  # CPU time: all threads, robust to a shared machine
    dof = degrees_of_freedom(x, 2**-4)
    wall = time.perf_counter() - wall0
    cpu = time.process_time() - cpu0
    print(
        f"{heads:>6} {J:>5} {wall:>7.1f} {cpu:>7.1f} {wall / heads:>9.3f}  "
        f"{dof.min():.0f}-{dof.max():.0f}"
    )
