"""A model's settings, read from its Hugging Face config.json with every field checked, and the
layout of its checkpoint: which stored tensor becomes which of ours, in which shape.

GPT-2 stores its projections [in, out] (Conv1D); NeoX stores Linear weights [out, in] and
interleaves q, k, v per head. Both are brought to GPT-2's layout here, so the forward pass in
model.py has one form.
"""

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import CheckpointError

TANH_GELUS = ("gelu_new", "gelu_fast", "gelu_pytorch_tanh")
ACTIVATIONS = ("gelu",) + TANH_GELUS

# What a config.json field must hold: (what the error message says was expected, test). JSON's
# true/false are Python bools, which are ints to isinstance, so types are compared exactly.
POSITIVE_INT = ("a positive integer", lambda v: type(v) is int and v > 0)
POSITIVE_NUMBER = ("a positive number", lambda v: type(v) in (int, float) and 0 < v < math.inf)
FRACTION = ("a number in (0, 1]", lambda v: type(v) in (int, float) and 0 < v <= 1)
BOOLEAN = ("true or false", lambda v: type(v) is bool)
OBJECT = ("a JSON object", lambda v: isinstance(v, dict))
ACTIVATION = (f"one of {', '.join(ACTIVATIONS)}", lambda v: v in ACTIVATIONS)
REQUIRED = object()


class ConfigFields:
    """Typed reads of a parsed config.json; each problem raises a CheckpointError naming the file,
    the field and what was expected."""

    def __init__(self, hf: dict, file: Path):
        self.hf = hf
        self.file = file

    def get(self, keys, kind, default=REQUIRED):
        """The value of the first of `keys` (one key or a tuple of spellings) that is present and
        not null, checked against `kind`; else `default`. "a.b" reads key b of the object at a."""
        expected, valid = kind
        spellings = (keys,) if isinstance(keys, str) else keys
        for key in spellings:
            parent, _, leaf = key.rpartition(".")
            container = self.get(parent, OBJECT, {}) if parent else self.hf
            value = container.get(leaf)
            if value is None:
                continue
            if not valid(value):
                raise CheckpointError(f"{self.file}: {key!r} is {value!r}; expected {expected}")
            return value
        if default is REQUIRED:
            raise CheckpointError(
                f"{self.file}: missing {' or '.join(map(repr, spellings))}; expected {expected}"
            )
        return default

    def width(self, width_key: str, heads_key: str) -> int:
        """The model width, checked to split evenly into the heads."""
        width = self.get(width_key, POSITIVE_INT)
        heads = self.get(heads_key, POSITIVE_INT)
        if width % heads:
            raise CheckpointError(
                f"{self.file}: {width_key!r} = {width} is not divisible by {heads_key!r} = "
                f"{heads}; expected a width that splits evenly into the heads"
            )
        return width


@dataclass
class Config:
    family: str  # "gpt2" | "neox"
    n_layer: int
    n_head: int
    d_model: int
    d_ff: int
    vocab_size: int
    n_ctx: int  # maximum positions
    eps: float = 1e-5
    tanh_gelu: bool = True
    rotary_dim: int = 0  # NeoX: rotated dims per head (the first ones)
    rotary_base: float = 10000.0
    parallel_residual: bool = False
    name: str = ""

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @classmethod
    def from_hf(cls, hf: dict, file: Path) -> "Config":
        """The settings of a Hugging Face config.json `hf`, read from `file` (named in errors, its
        folder names the model). Sizes must be positive integers and the width must split into the
        heads; NeoX's rotary fraction, under any of its three spellings, must lie in (0, 1] and
        rotate an even number of dims per head (they turn in pairs)."""
        fields = ConfigFields(hf, file)
        name = Path(file).resolve().parent.name
        kind = hf.get("model_type")
        if kind == "gpt2":
            d_model = fields.width("n_embd", "n_head")
            activation = fields.get("activation_function", ACTIVATION, "gelu_new")
            return cls(
                family="gpt2",
                n_layer=fields.get("n_layer", POSITIVE_INT),
                n_head=fields.get("n_head", POSITIVE_INT),
                d_model=d_model,
                d_ff=fields.get("n_inner", POSITIVE_INT, 4 * d_model),
                vocab_size=fields.get("vocab_size", POSITIVE_INT),
                n_ctx=fields.get("n_positions", POSITIVE_INT),
                eps=float(fields.get("layer_norm_epsilon", POSITIVE_NUMBER, 1e-5)),
                tanh_gelu=activation != "gelu",
                name=name,
            )
        if kind == "gpt_neox":
            d_model = fields.width("hidden_size", "num_attention_heads")
            n_head = fields.get("num_attention_heads", POSITIVE_INT)
            # newer transformers nests the rotary settings in rope_parameters
            rotary_keys = (
                "rotary_pct",
                "partial_rotary_factor",
                "rope_parameters.partial_rotary_factor",
            )
            base_keys = ("rotary_emb_base", "rope_theta", "rope_parameters.rope_theta")
            rotary_fraction = fields.get(rotary_keys, FRACTION, 1.0)
            rotary_dim = int(d_model // n_head * rotary_fraction)
            if rotary_dim % 2:
                raise CheckpointError(
                    f"{file}: rotary fraction {rotary_fraction} of {d_model // n_head} dims per "
                    f"head rotates {rotary_dim}; expected an even number of dims"
                )
            activation = fields.get("hidden_act", ACTIVATION, "gelu")
            return cls(
                family="neox",
                n_layer=fields.get("num_hidden_layers", POSITIVE_INT),
                n_head=n_head,
                d_model=d_model,
                d_ff=fields.get("intermediate_size", POSITIVE_INT),
                vocab_size=fields.get("vocab_size", POSITIVE_INT),
                n_ctx=fields.get("max_position_embeddings", POSITIVE_INT),
                eps=float(fields.get("layer_norm_eps", POSITIVE_NUMBER, 1e-5)),
                tanh_gelu=activation != "gelu",
                rotary_dim=rotary_dim,
                rotary_base=float(fields.get(base_keys, POSITIVE_NUMBER, 10000.0)),
                parallel_residual=fields.get("use_parallel_residual", BOOLEAN, True),
                name=name,
            )
        raise CheckpointError(
            f"{file} has model_type {kind!r}; dofmini supports 'gpt2' and 'gpt_neox'"
        )


# (our name, GPT-2 name, NeoX name, shape in our [in, out] layout) for one block.
BLOCK_TENSORS = (
    ("ln1.weight", "ln_1.weight", "input_layernorm.weight", "D"),
    ("ln1.bias", "ln_1.bias", "input_layernorm.bias", "D"),
    ("ln2.weight", "ln_2.weight", "post_attention_layernorm.weight", "D"),
    ("ln2.bias", "ln_2.bias", "post_attention_layernorm.bias", "D"),
    ("attn.qkv_w", "attn.c_attn.weight", "attention.query_key_value.weight", "D,3D"),
    ("attn.qkv_b", "attn.c_attn.bias", "attention.query_key_value.bias", "3D"),
    ("attn.out_w", "attn.c_proj.weight", "attention.dense.weight", "D,D"),
    ("attn.out_b", "attn.c_proj.bias", "attention.dense.bias", "D"),
    ("fc_w", "mlp.c_fc.weight", "mlp.dense_h_to_4h.weight", "D,F"),
    ("fc_b", "mlp.c_fc.bias", "mlp.dense_h_to_4h.bias", "F"),
    ("proj_w", "mlp.c_proj.weight", "mlp.dense_4h_to_h.weight", "F,D"),
    ("proj_b", "mlp.c_proj.bias", "mlp.dense_4h_to_h.bias", "D"),
)


def hf_layout(cfg: Config):
    """{our name: checkpoint name}, {checkpoint name: stored shape}, aliases, and ignored buffer
    suffixes."""
    gpt2 = cfg.family == "gpt2"
    sizes = {
        "D": cfg.d_model,
        "3D": 3 * cfg.d_model,
        "F": cfg.d_ff,
        "V": cfg.vocab_size,
        "P": cfg.n_ctx,
    }
    top = [
        ("wte", "wte.weight", "gpt_neox.embed_in.weight", "V,D"),
        ("ln_f.weight", "ln_f.weight", "gpt_neox.final_layer_norm.weight", "D"),
        ("ln_f.bias", "ln_f.bias", "gpt_neox.final_layer_norm.bias", "D"),
        ("wpe", "wpe.weight", None, "P,D") if gpt2 else ("head", None, "embed_out.weight", "V,D"),
    ]
    prefix = "h" if gpt2 else "gpt_neox.layers"
    rows = top + [
        (f"blocks.{i}.{ours}", f"{prefix}.{i}.{g}", f"{prefix}.{i}.{n}", shape)
        for i in range(cfg.n_layer)
        for ours, g, n, shape in BLOCK_TENSORS
    ]
    names = {}
    expected = {}
    for ours, gpt2_name, neox_name, shape in rows:
        names[ours] = gpt2_name if gpt2 else neox_name
        dims = tuple(sizes[s] for s in shape.split(","))
        # NeoX's Linear layers store [out, in]; the embeddings are [V, D] in both families.
        expected[names[ours]] = (
            dims[::-1] if not gpt2 and len(dims) == 2 and ours not in ("wte", "head") else dims
        )
    aliases = (
        {f"transformer.{hf}": hf for hf in expected}
        if gpt2
        else {"lm_head.weight": "embed_out.weight"}
    )
    ignored = (
        (".attn.bias", ".masked_bias", "lm_head.weight")
        if gpt2
        else (".attention.bias", ".masked_bias", ".rotary_emb.inv_freq")
    )
    return names, expected, aliases, ignored


def from_neox(ours: str, t: torch.Tensor, cfg: Config) -> torch.Tensor:
    """NeoX stores Linear weights [out, in] and interleaves q/k/v per head; we want [in, out],
    q|k|v blocks."""
    if ours.endswith(("qkv_w", "qkv_b")):
        per_head = t.reshape(cfg.n_head, 3, cfg.head_dim, -1)  # [H, 3, d, D or 1]
        t = per_head.transpose(0, 1).reshape(3 * cfg.d_model, -1).squeeze(-1)  # [3D, D] or [3D]
    return t.T if t.dim() == 2 and ours not in ("wte", "head") else t
