"""Reading a Hugging Face checkpoint folder without transformers: config.json into a checked
`Config`, model.safetensors into checked tensors in our layout, and `load_folder`, which needs no
network. Weights are read with safetensors only: nothing is unpickled. Vendorable with model.py:
torch, safetensors and the standard library only. Named models, downloads, the teacher's
fingerprint and the tokenizer are dofmini.hub's.
"""

import json
import math
from pathlib import Path

import torch

from .model import Config, Model


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is: the message names the file, the field or tensor,
    and what was expected."""


# What a config.json field must hold: (what the error says was expected, test). JSON's true/false
# are Python bools, which are ints to isinstance, so types are compared exactly.
POSITIVE_INT = ("a positive integer", lambda v: type(v) is int and v > 0)
TOKEN_ID = ("a non-negative integer", lambda v: type(v) is int and v >= 0)
POSITIVE_NUMBER = ("a positive number", lambda v: type(v) in (int, float) and 0 < v < math.inf)
FRACTION = ("a number in (0, 1]", lambda v: type(v) in (int, float) and 0 < v <= 1)
BOOLEAN = ("true or false", lambda v: type(v) is bool)
OBJECT = ("a JSON object", lambda v: isinstance(v, dict))
ACTIVATIONS = ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh")  # all but "gelu" use tanh
ACTIVATION = (f"one of {', '.join(ACTIVATIONS)}", lambda v: v in ACTIVATIONS)
REQUIRED = object()
# config.json's keys for: layers, heads, width, MLP width, positions, norm epsilon, activation
HF_KEYS = {
    "gpt2": ("n_layer", "n_head", "n_embd", "n_inner", "n_positions", "layer_norm_epsilon")
    + ("activation_function",),
    "gpt_neox": ("num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size")
    + ("max_position_embeddings", "layer_norm_eps", "hidden_act"),
}
# NeoX's rotary settings under each spelling: "a|b" reads the first present, "a.b" key b of the
# object at a (newer transformers nests them in rope_parameters)
ROTARY_FRACTION = "rotary_pct|partial_rotary_factor|rope_parameters.partial_rotary_factor"
ROTARY_BASE = "rotary_emb_base|rope_theta|rope_parameters.rope_theta"


def read_field(hf: dict, file: Path, keys: str, kind, default=REQUIRED):
    """The value in config.json `hf` of the first of `keys` present and not null, checked against
    `kind`; else `default`. Errors name `file`, the key and what was expected."""
    expected, valid = kind
    for key in keys.split("|"):
        parent, _, leaf = key.rpartition(".")
        value = (read_field(hf, file, parent, OBJECT, {}) if parent else hf).get(leaf)
        if value is not None:
            if not valid(value):
                raise CheckpointError(f"{file}: {key!r} is {value!r}; expected {expected}")
            return value
    if default is REQUIRED:
        spellings = " or ".join(repr(key) for key in keys.split("|"))
        raise CheckpointError(f"{file}: missing {spellings}; expected {expected}")
    return default


def parse_config(hf: dict, file: Path) -> Config:
    """The settings of a Hugging Face config.json `hf`, read from `file` (named in errors, its
    folder names the model). Sizes must be positive integers and the width must split into the
    heads; NeoX's rotary fraction, under any of its three spellings, must lie in (0, 1] and
    rotate an even number of dims per head (they turn in pairs)."""
    if hf.get("model_type") not in HF_KEYS:
        raise CheckpointError(
            f"{file} has model_type {hf.get('model_type')!r}; dofmini supports 'gpt2' and "
            f"'gpt_neox'"
        )
    gpt2 = hf["model_type"] == "gpt2"
    layers, heads, width, inner, positions, eps, activation = HF_KEYS[hf["model_type"]]
    get = lambda keys, kind, default=REQUIRED: read_field(hf, file, keys, kind, default)
    n_head, d_model = get(heads, POSITIVE_INT), get(width, POSITIVE_INT)
    if d_model % n_head:
        raise CheckpointError(
            f"{file}: {width!r} = {d_model} is not divisible by {heads!r} = {n_head}; "
            f"expected a width that splits evenly into the heads"
        )
    rotary_fraction = 0 if gpt2 else get(ROTARY_FRACTION, FRACTION, 1.0)
    rotary_dim = int(d_model // n_head * rotary_fraction)
    if rotary_dim % 2:
        raise CheckpointError(
            f"{file}: rotary fraction {rotary_fraction} of {d_model // n_head} dims per "
            f"head rotates {rotary_dim}; expected an even number of dims"
        )
    return Config(
        family="gpt2" if gpt2 else "neox",
        n_layer=get(layers, POSITIVE_INT),
        n_head=n_head,
        d_model=d_model,
        d_ff=get(inner, POSITIVE_INT, 4 * d_model if gpt2 else REQUIRED),
        vocab_size=get("vocab_size", POSITIVE_INT),
        n_ctx=get(positions, POSITIVE_INT),
        eps=float(get(eps, POSITIVE_NUMBER, 1e-5)),
        tanh_gelu=get(activation, ACTIVATION, "gelu_new" if gpt2 else "gelu") != "gelu",
        rotary_dim=rotary_dim,
        rotary_base=10000.0 if gpt2 else float(get(ROTARY_BASE, POSITIVE_NUMBER, 10000.0)),
        parallel_residual=not gpt2 and get("use_parallel_residual", BOOLEAN, True),
        name=Path(file).resolve().parent.name,
        bos_token_id=get("bos_token_id", TOKEN_ID, None),
        eos_token_id=get("eos_token_id", TOKEN_ID, None),
    )


def read_config(folder: Path) -> Config:
    """The checked settings in `folder`/config.json."""
    file = Path(folder) / "config.json"
    try:
        hf = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {file}: {err}") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{file} holds a JSON {type(hf).__name__}; expected an object")
    return parse_config(hf, file)


# Our parameter name (a block's after "blocks.{i}.") -> its checkpoint name in (GPT-2, NeoX), whose
# blocks are "h.{i}." and "gpt_neox.layers.{i}.". GPT-2 ties the head to wte; NeoX has no wpe.
HF_NAMES = {
    "wte": ("wte.weight", "gpt_neox.embed_in.weight"),
    "wpe": ("wpe.weight", None),
    "head": (None, "embed_out.weight"),
    "ln_f.weight": ("ln_f.weight", "gpt_neox.final_layer_norm.weight"),
    "ln_f.bias": ("ln_f.bias", "gpt_neox.final_layer_norm.bias"),
    "ln1.weight": ("ln_1.weight", "input_layernorm.weight"),
    "ln1.bias": ("ln_1.bias", "input_layernorm.bias"),
    "ln2.weight": ("ln_2.weight", "post_attention_layernorm.weight"),
    "ln2.bias": ("ln_2.bias", "post_attention_layernorm.bias"),
    "attn.qkv_w": ("attn.c_attn.weight", "attention.query_key_value.weight"),
    "attn.qkv_b": ("attn.c_attn.bias", "attention.query_key_value.bias"),
    "attn.out_w": ("attn.c_proj.weight", "attention.dense.weight"),
    "attn.out_b": ("attn.c_proj.bias", "attention.dense.bias"),
    "fc_w": ("mlp.c_fc.weight", "mlp.dense_h_to_4h.weight"),
    "fc_b": ("mlp.c_fc.bias", "mlp.dense_h_to_4h.bias"),
    "proj_w": ("mlp.c_proj.weight", "mlp.dense_4h_to_h.weight"),
    "proj_b": ("mlp.c_proj.bias", "mlp.dense_4h_to_h.bias"),
}
# The suffixes of stored buffers that are not weights (masks, rotary tables, GPT-2's tied head).
BUFFERS = {
    "gpt2": (".attn.bias", ".masked_bias", "lm_head.weight"),
    "neox": (".attention.bias", ".masked_bias", ".rotary_emb.inv_freq"),
}


def hf_name(ours: str, family: str) -> str:
    """The checkpoint name of our parameter `ours`."""
    neox = family == "neox"
    if ours.startswith("blocks."):
        _, i, rest = ours.split(".", 2)
        return f"{'gpt_neox.layers' if neox else 'h'}.{i}.{HF_NAMES[rest][neox]}"
    return HF_NAMES[ours][neox]


def from_neox(ours: str, t: torch.Tensor, cfg: Config) -> torch.Tensor:
    """NeoX stores Linear weights (ours end in _w) [out, in] and interleaves q/k/v per head; we
    want [in, out], q|k|v blocks."""
    if ours.endswith(("qkv_w", "qkv_b")):
        per_head = t.reshape(cfg.n_head, 3, cfg.head_dim, -1)  # [H, 3, d, D or 1]
        t = per_head.transpose(0, 1).reshape(3 * cfg.d_model, -1).squeeze(-1)  # [3D, D] or [3D]
    return t.T if ours.endswith("_w") else t


def read_tensors(file: Path, expected: dict, aliases: dict, ignored: tuple, dtype) -> dict:
    """The tensors of safetensors `file` as {name: tensor in `dtype`}, checked against `expected`
    {name: shape}. `aliases` maps other spellings to an expected name; names ending in one of
    `ignored` are skipped. Names and shapes are checked from the header, before any tensor is
    read. Refused: two stored names for one tensor (neither may silently win) and a NaN or inf,
    stored or made by the conversion to `dtype` (it would spread through every forward pass).
    Nothing is unpickled."""
    from safetensors import SafetensorError, safe_open

    if not file.is_file():
        raise CheckpointError(f"missing {file}")
    try:
        with safe_open(str(file), "pt") as stored:
            sources = {}  # expected name -> stored name
            for name in stored.keys():
                key = aliases.get(name, name)
                if name.endswith(ignored):
                    continue
                if key not in expected:
                    raise CheckpointError(f"unexpected tensor {name!r} in {file}")
                if key in sources:
                    raise CheckpointError(
                        f"{file} holds both {sources[key]!r} and {name!r}: two names for one "
                        f"tensor; expected one"
                    )
                sources[key] = name
                shape = stored.get_slice(name).get_shape()
                if tuple(shape) != expected[key]:
                    raise CheckpointError(
                        f"tensor {name!r} in {file} has shape {shape}, expected "
                        f"{list(expected[key])}"
                    )
            missing = [name for name in expected if name not in sources]
            if missing:
                raise CheckpointError(
                    f"missing tensor {missing[0]!r} in {file} (expected shape "
                    f"{list(expected[missing[0]])})"
                    + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                )
            return {key: _converted(stored, name, dtype, file) for key, name in sources.items()}
    except (SafetensorError, OSError, RuntimeError) as err:
        raise CheckpointError(f"{file} is truncated or corrupt: {err}") from None


def _converted(stored, name: str, dtype: torch.dtype, file: Path) -> torch.Tensor:
    """Stored tensor `name` in `dtype`; refused if not a float or not finite, saying whether the
    file holds the NaN or inf or the conversion from the stored dtype made it."""
    tensor = stored.get_tensor(name)
    what = f"tensor {name!r} in {file}"
    if not tensor.is_floating_point():
        raise CheckpointError(f"{what} has dtype {tensor.dtype}, expected a float dtype")
    converted = tensor.to(dtype)
    if torch.isfinite(converted).all():
        return converted
    bad = tensor.isnan() | tensor.isinf()
    if bad.any():
        raise CheckpointError(
            f"{what} holds {int(bad.sum())} NaN or inf value(s), first at index "
            f"{bad.nonzero()[0].tolist()}; expected finite weights"
        )
    raise CheckpointError(
        f"{what} has values up to {tensor.abs().max().item():.4g}, beyond {dtype}'s range; "
        f"expected them to fit, or load in a wider dtype (e.g. float32)"
    )


def load_folder(folder, dtype: torch.dtype = torch.float32) -> Model:
    """A frozen teacher from a folder holding config.json and model.safetensors, without network.
    Its `identity` is the folder's name; hub.load sets the fingerprint of the content."""
    folder = Path(folder)
    cfg = read_config(folder)
    neox = cfg.family == "neox"
    with torch.device("meta"):  # our shapes, nothing allocated (GPT-2's tied head is wte)
        shapes = {ours: p.shape for ours, p in Model(cfg).named_parameters()}
    names = {ours: hf_name(ours, cfg.family) for ours in shapes}
    # NeoX stores its Linear weights transposed: [out, in]
    expected = {
        names[o]: tuple(s)[::-1] if neox and o.endswith("_w") else tuple(s)
        for o, s in shapes.items()
    }
    aliases = (
        {"lm_head.weight": "embed_out.weight"}
        if neox
        else {f"transformer.{n}": n for n in expected}
    )
    tensors = read_tensors(
        folder / "model.safetensors", expected, aliases, BUFFERS[cfg.family], dtype
    )
    model = Model(cfg).to(dtype)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for ours, hf in names.items():
            params[ours].copy_(from_neox(ours, tensors[hf], cfg) if neox else tensors[hf])
    return model.eval()
