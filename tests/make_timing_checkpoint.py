"""A checkpoint of GPT-2 small's shape (12 layers of 12 heads of 64, width 768, context 1024, the
real vocabulary) with random weights, for timing runs where the real weights cannot be had: a
forward pass costs what the real one does. Its numbers mean nothing.

    python tests/make_timing_checkpoint.py OUT_FOLDER GPT2_TOKENIZER_JSON [--seed 0]
"""

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

SHAPE = dict(n_layer=12, n_head=12, n_embd=768, n_ctx=1024, vocab_size=50257)


def tensors(seed: int) -> dict:
    """GPT-2's checkpoint layout (Conv1D weights [in, out]); normal(0, 0.02) weights, layer
    norms at 1 and biases at 0, as GPT-2's initialisation."""
    gen = torch.Generator().manual_seed(seed)
    width = SHAPE["n_embd"]
    normal = lambda *shape: torch.randn(*shape, generator=gen) * 0.02  # noqa: E731
    found = {"wte.weight": normal(SHAPE["vocab_size"], width)}
    found["wpe.weight"] = normal(SHAPE["n_ctx"], width)
    for i in range(SHAPE["n_layer"]):
        layer = {
            "ln_1.weight": torch.ones(width),
            "ln_1.bias": torch.zeros(width),
            "attn.c_attn.weight": normal(width, 3 * width),
            "attn.c_attn.bias": torch.zeros(3 * width),
            "attn.c_proj.weight": normal(width, width),
            "attn.c_proj.bias": torch.zeros(width),
            "ln_2.weight": torch.ones(width),
            "ln_2.bias": torch.zeros(width),
            "mlp.c_fc.weight": normal(width, 4 * width),
            "mlp.c_fc.bias": torch.zeros(4 * width),
            "mlp.c_proj.weight": normal(4 * width, width),
            "mlp.c_proj.bias": torch.zeros(width),
        }
        found |= {f"h.{i}.{name}": t for name, t in layer.items()}
    found["ln_f.weight"] = torch.ones(width)
    found["ln_f.bias"] = torch.zeros(width)
    return found


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("out", type=Path)
    p.add_argument("tokenizer", type=Path, help="GPT-2's tokenizer.json")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    config = dict(model_type="gpt2", n_positions=SHAPE["n_ctx"], layer_norm_epsilon=1e-5)
    config |= dict(SHAPE, activation_function="gelu_new", seed=args.seed)
    (args.out / "config.json").write_text(json.dumps(config, indent=1))
    save_file(tensors(args.seed), args.out / "model.safetensors", {"format": "pt"})
    shutil.copyfile(args.tokenizer, args.out / "tokenizer.json")
    print(f"{args.out}: GPT-2 small's shape, random weights (seed {args.seed})")


if __name__ == "__main__":
    main()
