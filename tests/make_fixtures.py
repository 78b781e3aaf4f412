"""Developer-only tool: rebuild tests/fixtures/ with Hugging Face transformers, the reference.

    pip install transformers && python tests/make_fixtures.py

Nothing else in dofmini imports transformers. Each fixture is a tiny random model saved with
`save_pretrained` plus `reference.json`: the ids fed in, the logits transformers computes for them,
and its greedy continuation.
"""

import json
import shutil
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM

OUT = Path(__file__).resolve().parent / "fixtures"
# A wide init keeps greedy argmaxes far from ties;
# no eos token, so greedy decoding never stops early.
SMALL = dict(vocab_size=96, initializer_range=0.2, bos_token_id=None, eos_token_id=None)
GPT2 = dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, **SMALL)
NEOX = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    **SMALL,
)
FIXTURES = {
    "gpt2-tiny": (GPT2LMHeadModel, GPT2Config(**GPT2), torch.float32),
    "gpt2-tiny-fp16": (GPT2LMHeadModel, GPT2Config(**GPT2), torch.float16),
    "neox-tiny": (
        GPTNeoXForCausalLM,
        GPTNeoXConfig(rotary_pct=0.25, use_parallel_residual=True, **NEOX),
        torch.float32,
    ),
    "neox-tiny-sequential": (
        GPTNeoXForCausalLM,
        GPTNeoXConfig(rotary_pct=0.25, use_parallel_residual=False, **NEOX),
        torch.float32,
    ),
    "neox-tiny-rotary-full": (
        GPTNeoXForCausalLM,
        GPTNeoXConfig(rotary_pct=1.0, **NEOX),
        torch.float32,
    ),
    "neox-tiny-bf16": (GPTNeoXForCausalLM, GPTNeoXConfig(rotary_pct=0.25, **NEOX), torch.bfloat16),
}


def main():
    for name, (cls, config, dtype) in FIXTURES.items():
        torch.manual_seed(0)
        model = cls(config).eval()
        folder = OUT / name
        shutil.rmtree(folder, ignore_errors=True)
        model.to(dtype).save_pretrained(folder)
        (folder / "generation_config.json").unlink(missing_ok=True)
        ids = torch.randint(
            0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1)
        )
        with torch.no_grad():
            logits32 = model.float()(ids).logits  # fp32 compute from the stored weights
            logits_low = model.to(dtype)(ids).logits.float()  # compute in the stored dtype
            prompt = ids[:1, :5]
            greedy = model.float().generate(
                prompt, max_new_tokens=20, do_sample=False, pad_token_id=0
            )
        ref = {
            "dtype": str(dtype).removeprefix("torch."),
            "ids": ids.tolist(),
            "logits_fp32": logits32.tolist(),
            "logits_stored_dtype": logits_low.tolist(),
            "greedy_prompt": prompt[0].tolist(),
            "greedy_ids": greedy[0].tolist(),
        }
        (folder / "reference.json").write_text(json.dumps(ref))
        print(name, sum(f.stat().st_size for f in folder.iterdir()), "bytes")


if __name__ == "__main__":
    main()
