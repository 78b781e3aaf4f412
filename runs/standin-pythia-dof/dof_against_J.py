"""Layer DoF of the Pythia stand-in against J and λ (G/J), on WikiText-2 valid (the study's
calibration file, all of it, in windows of 256 tokens; one seeded draw, its first J rows per J).

python runs/standin-pythia-dof/dof_against_J.py runs/standin-pythia-dof/dof_against_J.json
"""

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dofmini import dof, hub
from dofmini.study.run import CALIBRATION

model = "../shared/weights/standin-pythia"
teacher, tok = hub.load(model), hub.load_tokenizer(model)
text = Path("../shared/data", CALIBRATION).read_text(encoding="utf-8")
ids = torch.tensor(tok.encode(text).ids)
t0 = time.time()
x = dof.sample_queries_keys(teacher, ids, 8192, 0, 256)  # [L, H, J, d]
rows = []
for lam in (2.0**-8, 2.0**-4, 1.0):
    for J in (1024, 2048, 4096) + ((8192,) if lam == 2.0**-8 else ()):
        per_head = torch.stack([dof.degrees_of_freedom(layer[:, :J], lam, True) for layer in x])
        row = dict(
            lam=lam,
            J=J,
            per_head=per_head.tolist(),
            layer_dof=per_head.amax(-1).tolist(),
            share_above_half_J=float((per_head > J / 2).float().mean()),
            dims_b64=dof.allocate(per_head, 64),
        )
        rows.append(row)
        print(
            f"λ=2^{np.log2(lam):.0f} J={J}: layer DoF {[round(v) for v in row['layer_dof']]}, "
            f"heads above J/2 {row['share_above_half_J']:.0%}, dims b64 {row['dims_b64']} "
            f"({time.time() - t0:.0f} s)",
            flush=True,
        )
out = {
    "model": teacher.identity,
    "calibration": f"{CALIBRATION}, ctx 256, draw seed 0",
    "G/J": True,
    "rows": rows,
}
Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
