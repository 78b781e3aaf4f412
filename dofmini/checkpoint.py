"""A Hugging Face checkpoint folder read without transformers or network: config.json into a checked
`Config`, model.safetensors (never unpickled) into checked tensors in our layout. Vendorable with
model.py (torch, safetensors, the standard library); named models and downloads are hub.py's."""

import json
import math
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .model import Config, Model


class CheckpointError(ValueError):
    """An unusable checkpoint; the message names the file, field or tensor, and what it expected."""


# A config.json field's kind: (what an error says was expected, test, conversion). JSON's true and
# false are Python bools, which are ints to isinstance, so types are compared exactly.
NUMBER = (int, float)
POSITIVE_INT = ("a positive integer", lambda v: type(v) is int and v > 0, int)
TOKEN_ID = ("a non-negative integer", lambda v: type(v) is int and v >= 0, int)
POSITIVE_NUMBER = ("a positive number", lambda v: type(v) in NUMBER and 0 < v < math.inf, float)
FRACTION = ("a number in (0, 1]", lambda v: type(v) in NUMBER and 0 < v <= 1, float)
BOOLEAN = ("true or false", lambda v: type(v) is bool, bool)
OBJECT = ("a JSON object", lambda v: isinstance(v, dict), dict)
ACTIVATIONS = ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh")  # all but "gelu" use tanh
ACTIVATION = (f"one of {', '.join(ACTIVATIONS)}", lambda v: v in ACTIVATIONS, lambda v: v != "gelu")
FAMILIES = {"gpt2": "gpt2", "gpt_neox": "neox"}  # model_type -> Config.family
FAMILY = ("'gpt2' or 'gpt_neox'", lambda v: type(v) is str and v in FAMILIES, FAMILIES.get)
REQUIRED = object()
# Our field: (kind, GPT-2's key, its default, NeoX's key, its default); a family without a key
# always takes the default. "a|b" reads the first of a, b present; "a.b" is key b of the object at
# a (newer transformers nests NeoX's rotary settings in rope_parameters).
ROTARY_FRACTION = "rotary_pct|partial_rotary_factor|rope_parameters.partial_rotary_factor"
ROTARY_BASE = "rotary_emb_base|rope_theta|rope_parameters.rope_theta"
FIELDS = {
    "n_layer": (POSITIVE_INT, "n_layer", REQUIRED, "num_hidden_layers", REQUIRED),
    "n_head": (POSITIVE_INT, "n_head", REQUIRED, "num_attention_heads", REQUIRED),
    "d_model": (POSITIVE_INT, "n_embd", REQUIRED, "hidden_size", REQUIRED),
    "d_ff": (POSITIVE_INT, "n_inner", None, "intermediate_size", REQUIRED),  # None: 4 * d_model
    "vocab_size": (POSITIVE_INT, "vocab_size", REQUIRED, "vocab_size", REQUIRED),
    "n_ctx": (POSITIVE_INT, "n_positions", REQUIRED, "max_position_embeddings", REQUIRED),
    "eps": (POSITIVE_NUMBER, "layer_norm_epsilon", 1e-5, "layer_norm_eps", 1e-5),
    "tanh_gelu": (ACTIVATION, "activation_function", True, "hidden_act", False),
    "rotary_fraction": (FRACTION, None, 0.0, ROTARY_FRACTION, 1.0),
    "rotary_base": (POSITIVE_NUMBER, None, 1e4, ROTARY_BASE, 1e4),
    "parallel_residual": (BOOLEAN, None, False, "use_parallel_residual", True),
    "tied_head": (BOOLEAN, "tie_word_embeddings", True, "tie_word_embeddings", False),
    "bos_token_id": (TOKEN_ID, "bos_token_id", None, "bos_token_id", None),
    "eos_token_id": (TOKEN_ID, "eos_token_id", None, "eos_token_id", None),
}
# Settings that would change the computation in ways not implemented here: key -> the one value
# accepted (absent or null means that value); any other is refused rather than silently ignored.
ONLY = {
    "gpt2": {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False},
    "neox": {"rope_scaling": None, "rope_parameters.rope_type": "default", "attention_bias": True},
}


def read_field(hf: dict, file: Path, keys: str | None, kind, default=REQUIRED):
    """The value in config.json `hf` (read from `file`) of the first of `keys` present and not
    null, checked against `kind` and converted; else `default`. Two spellings present must agree."""
    expected, valid, convert = kind
    found = {}
    for key in keys.split("|") if keys else []:
        parent, _, leaf = key.rpartition(".")
        value = (read_field(hf, file, parent, OBJECT, {}) if parent else hf).get(leaf)
        if value is not None and not valid(value):
            raise CheckpointError(f"{file}: {key!r} is {value!r}; expected {expected}")
        found |= {} if value is None else {key: convert(value)}
    if len({repr(value) for value in found.values()}) > 1:
        both = " but ".join(f"{key!r} is {value!r}" for key, value in found.items())
        raise CheckpointError(f"{file}: {both}; expected one value")
    if found:
        return next(iter(found.values()))
    if default is REQUIRED:
        spellings = " or ".join(repr(key) for key in keys.split("|"))
        raise CheckpointError(f"{file}: missing {spellings}; expected {expected}")
    return default


def read_config(folder) -> Config:
    """The checked settings in `folder`/config.json, the folder's name as the model's."""
    file = Path(folder) / "config.json"
    try:
        hf = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {file}: {err}") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{file} holds a JSON {type(hf).__name__}; expected an object")
    family = read_field(hf, file, "model_type", FAMILY)
    for key, only in ONLY[family].items():
        implemented = f"{json.dumps(only)}, the only setting implemented"
        read_field(hf, file, key, (implemented, lambda v, only=only: v == only, repr), None)
    column = 1 if family == "gpt2" else 3  # of FIELDS' rows: this family's key; next, its default
    keys = {field: row[column] for field, row in FIELDS.items()}
    defaults = {field: row[column + 1] for field, row in FIELDS.items()}
    values = {f: read_field(hf, file, keys[f], row[0], defaults[f]) for f, row in FIELDS.items()}
    n_head, d_model = values["n_head"], values["d_model"]
    if d_model % n_head:
        split = f"{keys['d_model']!r} = {d_model} is not divisible by {keys['n_head']!r} = {n_head}"
        raise CheckpointError(f"{file}: {split}; expected a width that splits into the heads")
    fraction, head_dim = values.pop("rotary_fraction"), d_model // n_head
    rotary_dim = int(head_dim * fraction)
    if rotary_dim % 2:  # rotated dims turn in pairs
        turned = f"rotary fraction {fraction} of {head_dim} dims per head rotates {rotary_dim}"
        raise CheckpointError(f"{file}: {turned}; expected an even number of dims")
    values["d_ff"] = values["d_ff"] or 4 * d_model
    return Config(family=family, rotary_dim=rotary_dim, name=file.resolve().parent.name, **values)


# Our parameters -> their checkpoint names in (GPT-2, NeoX). A block's are ours after "blocks.{i}."
# and theirs after "h.{i}." or "gpt_neox.layers.{i}."; our "_w"/"_b" ending (or none) and
# ".weight"/".bias" are theirs ".weight"/".bias". A tied head is wte; NeoX has no wpe.
HF_NAMES = {
    "wte": ("wte", "gpt_neox.embed_in"),
    "wpe": ("wpe", None),
    "head": ("lm_head", "embed_out"),
    "ln_f": ("ln_f", "gpt_neox.final_layer_norm"),
    "ln1": ("ln_1", "input_layernorm"),
    "ln2": ("ln_2", "post_attention_layernorm"),
    "attn.qkv": ("attn.c_attn", "attention.query_key_value"),
    "attn.out": ("attn.c_proj", "attention.dense"),
    "fc": ("mlp.c_fc", "mlp.dense_h_to_4h"),
    "proj": ("mlp.c_proj", "mlp.dense_4h_to_h"),
}
# The endings of stored names that are not weights (masks, rotary tables), and of a tied head's.
BUFFERS = {
    "gpt2": (".attn.bias", ".masked_bias"),
    "neox": (".attention.bias", ".masked_bias", ".rotary_emb.inv_freq"),
}
LAYER = re.compile(r"(?:transformer\.)?(?:h|gpt_neox\.layers)\.(\d+)\.")


def hf_name(ours: str, neox: bool) -> str:
    """The checkpoint name of our parameter `ours`."""
    layer = ""
    if ours.startswith("blocks."):
        _, i, ours = ours.split(".", 2)
        layer = f"{'gpt_neox.layers' if neox else 'h'}.{i}."
    module, end = re.fullmatch(r"(.+?)(_w|_b|\.weight|\.bias)?", ours).groups()
    return f"{layer}{HF_NAMES[module][neox]}{'.bias' if end in ('_b', '.bias') else '.weight'}"


def from_neox(ours: str, t: torch.Tensor, cfg: Config) -> torch.Tensor:
    """NeoX stores Linear weights (ours end in _w) [out, in] and interleaves q/k/v per head; we
    want [in, out], q|k|v blocks."""
    if ours.endswith(("qkv_w", "qkv_b")):
        per_head = t.reshape(cfg.n_head, 3, cfg.head_dim, -1)  # [H, 3, d, D or 1]
        t = per_head.transpose(0, 1).reshape(3 * cfg.d_model, -1).squeeze(-1)  # [3D, D] or [3D]
    return t.T if ours.endswith("_w") else t


def stored_names(stored, file: Path, cfg: Config) -> dict:
    """{our parameter: its name in safetensors `stored`}, checked from the header alone: every
    stored tensor (but buffers) one of ours, in the checkpoint's layout, and each of ours stored
    once (two names for one tensor: neither may silently win). The layer count is checked first,
    so a config claiming a million layers fails before a million modules are built."""
    neox = cfg.family == "neox"
    layers = 1 + max((int(m[1]) for n in stored.keys() if (m := LAYER.match(n))), default=-1)
    if layers != cfg.n_layer:
        says = f"config.json's {FIELDS['n_layer'][3 if neox else 1]!r} says {cfg.n_layer}"
        raise CheckpointError(f"{file} holds {layers} layers; {says}")
    with torch.device("meta"):  # nothing allocated; a tied head is wte, listed once
        params = dict(Model(cfg).named_parameters())
    theirs = {o: list((p.T if neox and o.endswith("_w") else p).shape) for o, p in params.items()}
    ours_of = {hf_name(ours, neox): ours for ours in params}
    # other spellings: transformers saves GPT-2 under "transformer." (the hub's gpt2 has none)
    prefixed = {f"transformer.{name}": ours for name, ours in ours_of.items()}
    ours_of |= {"lm_head.weight": "head"} if neox else prefixed
    sources = {}
    ignored = BUFFERS[cfg.family] + (("lm_head.weight", "embed_out.weight") * cfg.tied_head)
    for name in stored.keys():
        if name.endswith(ignored):
            continue
        ours = ours_of.get(name)
        if ours is None:
            raise CheckpointError(f"unexpected tensor {name!r} in {file}")
        if ours in sources:
            both = f"{sources[ours]!r} and {name!r}"
            raise CheckpointError(f"{file} holds both {both}: two names for one tensor")
        sources[ours] = name
        shape, want = stored.get_slice(name).get_shape(), theirs[ours]
        if shape != want:
            raise CheckpointError(f"tensor {name!r} in {file} has shape {shape}, expected {want}")
    if missing := [ours for ours in params if ours not in sources]:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        name, want = hf_name(missing[0], neox), theirs[missing[0]]
        raise CheckpointError(f"missing tensor {name!r} in {file} (expected shape {want}){more}")
    return sources


def converted(stored, name: str, dtype: torch.dtype, file: Path) -> torch.Tensor:
    """Stored float tensor `name` in `dtype`. A NaN or inf would spread through every forward pass:
    refused, saying whether the file holds it or the conversion to `dtype` made it."""
    tensor, what = stored.get_tensor(name), f"tensor {name!r} in {file}"
    if not tensor.is_floating_point():
        raise CheckpointError(f"{what} has dtype {tensor.dtype}, expected a float dtype")
    cast = tensor.to(dtype)
    if torch.isfinite(cast).all():
        return cast
    bad = ~tensor.isfinite()
    if bad.any():
        found = f"{int(bad.sum())} NaN or inf value(s), first at index {bad.nonzero()[0].tolist()}"
        raise CheckpointError(f"{what} holds {found}; expected finite weights")
    wider = ", or load in float32" if torch.finfo(dtype).max < 3.4e38 else ""  # e.g. float16
    beyond = f"values up to {tensor.abs().max().item():.4g}, beyond {dtype}'s range"
    raise CheckpointError(f"{what} has {beyond}; expected them to fit{wider}")


def check_dtype(dtype) -> None:
    """load's and load_folder's dtype, checked before any file is read or downloaded."""
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"load: dtype={dtype!r}; expected a floating torch.dtype")


def load_folder(folder, dtype: torch.dtype = torch.float32) -> Model:
    """A frozen teacher from a folder holding config.json and model.safetensors. Its `identity` is
    the folder's name; hub.load sets the fingerprint of the content."""
    check_dtype(dtype)
    cfg = read_config(folder)
    file = Path(folder) / "model.safetensors"
    if not file.is_file():
        raise CheckpointError(f"missing {file}")
    try:
        with safe_open(str(file), "pt") as stored:
            sources = stored_names(stored, file, cfg)
            model = Model(cfg)  # its parameters tied as built: GPT-2's head is its embedding
            with torch.no_grad():
                for ours, param in model.named_parameters():
                    tensor = converted(stored, sources[ours], dtype, file)
                    param.copy_(from_neox(ours, tensor, cfg) if cfg.family == "neox" else tensor)
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{file} is truncated or corrupt: {err}") from None
    return model.to(dtype).eval()
