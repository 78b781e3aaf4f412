"""What a run costs on this machine: reproduce.py's own plan for a model of GPT-2 small's shape.

    python tests/bench_plan.py [--profiles default,paper] [--threads N] [--device cuda]

Builds a checkpoint of GPT-2 small's shape (12 layers, 12 heads of 64, width 768, 1024 positions,
vocabulary 50,257) with random N(0, 0.02) weights in a temporary folder, with the real GPT-2
tokenizer from ../shared, and prints `reproduce.py --plan-only` for each profile: the timing probe
(seconds per window for a forward pass and a training step of each loss) and the estimated time of
every stage. Random weights cost what real ones do.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO.parent / "shared" / "weights" / "tokenizers" / "gpt2" / "tokenizer.json"


def gpt2_small(folder: Path):
    L, D, V, P = 12, 768, 50257, 1024
    config = {"model_type": "gpt2", "n_layer": L, "n_head": 12, "n_embd": D, "vocab_size": V,
              "n_positions": P, "activation_function": "gelu_new"}  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    shapes = {"wte.weight": (V, D), "wpe.weight": (P, D), "ln_f.weight": (D,), "ln_f.bias": (D,)}
    block = {
        "ln_1.weight": (D,),
        "ln_1.bias": (D,),
        "ln_2.weight": (D,),
        "ln_2.bias": (D,),
        "attn.c_attn.weight": (D, 3 * D),
        "attn.c_attn.bias": (3 * D,),
        "attn.c_proj.weight": (D, D),
        "attn.c_proj.bias": (D,),
        "mlp.c_fc.weight": (D, 4 * D),
        "mlp.c_fc.bias": (4 * D,),
        "mlp.c_proj.weight": (4 * D, D),
        "mlp.c_proj.bias": (D,),
    }
    for i in range(L):
        shapes.update({f"h.{i}.{name}": shape for name, shape in block.items()})
    tensors = {}
    for name, shape in shapes.items():
        ones = name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight"))
        tensors[name] = torch.ones(shape) if ones else torch.randn(shape, generator=gen) * 0.02
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    shutil.copy(TOKENIZER, folder / "tokenizer.json")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profiles", default="default,paper")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "gpt2-small-random"
        gpt2_small(model)
        env = dict(os.environ)  # the data store ($DOFMINI_DATA) and PYTHONPATH pass through
        if args.threads:
            env["OMP_NUM_THREADS"] = str(args.threads)
        for profile in args.profiles.split(","):
            print(f"\n## profile {profile}", flush=True)
            command = [sys.executable, str(REPO / "reproduce.py"), str(model)]
            command += ["--profile", profile, "--plan-only", "--device", args.device]
            command += ["--out", str(Path(tmp) / profile)]
            subprocess.run(command, check=True, cwd=REPO, env=env)


if __name__ == "__main__":
    main()
