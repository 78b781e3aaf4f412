"""GPT-2 and GPT-NeoX (Pythia) forward passes, reimplemented from their Hugging Face checkpoints.

`load(path_or_name)` returns a frozen `Model`; `model(ids)` gives logits [B, T, V]. Every
projection is stored [in, out] and applied as `x @ W + b` (GPT-2's Conv1D layout; NeoX's Linear
weights are transposed at load). Each layer's attention is its own module so a student can swap
it while keeping the teacher's projections.
"""

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import CheckpointError, fingerprint, read_config, read_tensors, resolve

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


def _weight(*shape) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape), requires_grad=False)


class KVCache:
    """Keys and values of the tokens seen so far, in buffers sized once for the whole generation."""

    def __init__(self, like: torch.Tensor, batch: int, n_head: int, head_dim: int, capacity: int):
        self.k = like.new_empty(batch, n_head, capacity, head_dim)  # [B, H, capacity, d]
        self.v = like.new_empty(batch, n_head, capacity, head_dim)  # [B, H, capacity, d]
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor):
        end = self.length + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(
                f"KV cache holds {self.k.shape[2]} positions; appending would reach {end}"
            )
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]  # [B, H, end, d] each


class Attention(nn.Module):
    """Causal softmax attention with the checkpoint's fused q/k/v projection."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.head_dim
        self.rotary_dim = cfg.rotary_dim
        self.rotary_base = cfg.rotary_base
        self.qkv_w = _weight(cfg.d_model, 3 * cfg.d_model)
        self.qkv_b = _weight(3 * cfg.d_model)
        self.out_w = _weight(cfg.d_model, cfg.d_model)
        self.out_b = _weight(cfg.d_model)

    def rotate(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Rotary embedding on the first rotary_dim dims, rotating halves (NeoX), with angles in
        fp32."""
        r = self.rotary_dim
        pos = torch.arange(start, start + x.shape[2], device=x.device, dtype=torch.float32)  # [T]
        inv_freq = self.rotary_base ** (
            -torch.arange(0, r, 2, device=x.device, dtype=torch.float32) / r
        )  # [r/2]
        angles = torch.outer(pos, inv_freq).repeat(1, 2)  # [T, r]
        cos = angles.cos().to(x.dtype)  # [T, r]
        sin = angles.sin().to(x.dtype)  # [T, r]
        x_rot = x[..., :r]  # [B, H, T, r]
        x_pass = x[..., r:]  # [B, H, T, d - r]
        half = torch.cat((-x_rot[..., r // 2 :], x_rot[..., : r // 2]), dim=-1)  # [B, H, T, r]
        return torch.cat((x_rot * cos + half * sin, x_pass), dim=-1)  # [B, H, T, d]

    def project(self, x: torch.Tensor, start: int = 0):
        """q, k, v [B, H, T, d] exactly as the softmax sees them (after bias, and rotary for
        NeoX)."""
        B, T, _ = x.shape
        qkv = x @ self.qkv_w + self.qkv_b  # [B, T, 3D]
        heads = qkv.view(B, T, 3, self.n_head, self.head_dim)  # [B, T, 3, H, d]
        q, k, v = heads.permute(2, 0, 3, 1, 4)  # [B, H, T, d] each
        if self.rotary_dim:
            q = self.rotate(q, start)  # [B, H, T, d]
            k = self.rotate(k, start)  # [B, H, T, d]
        return q, k, v

    def output(self, o: torch.Tensor) -> torch.Tensor:
        B, H, T, d = o.shape
        return o.transpose(1, 2).reshape(B, T, H * d) @ self.out_w + self.out_b  # [B, T, D]

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        return KVCache(self.qkv_w, batch, self.n_head, self.head_dim, capacity)

    def forward(self, x, start=0, cache=None, capture=None):
        q, k, v = self.project(x, start)  # [B, H, T, d] each
        if capture is not None:
            capture.append((q, k, v))
        if cache is None or cache.length == 0:
            if cache is not None:
                cache.append(k, v)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, d]
        else:
            k, v = cache.append(k, v)  # [B, H, past + T, d] each
            T = q.shape[2]
            L = k.shape[2]
            # query i sees keys <= past + i
            mask = torch.ones(T, L, dtype=torch.bool, device=q.device).tril(L - T)  # [T, L]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, T, d]
        return self.output(o)


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.parallel = cfg.parallel_residual
        self.tanh_gelu = cfg.tanh_gelu
        self.ln1 = nn.LayerNorm(cfg.d_model, cfg.eps)
        self.ln2 = nn.LayerNorm(cfg.d_model, cfg.eps)
        self.attn = Attention(cfg)
        self.fc_w = _weight(cfg.d_model, cfg.d_ff)
        self.fc_b = _weight(cfg.d_ff)
        self.proj_w = _weight(cfg.d_ff, cfg.d_model)
        self.proj_b = _weight(cfg.d_model)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        approximate = "tanh" if self.tanh_gelu else "none"
        h = F.gelu(x @ self.fc_w + self.fc_b, approximate=approximate)  # [B, T, F]
        return h @ self.proj_w + self.proj_b  # [B, T, D]

    def forward(self, x, start=0, cache=None, capture=None):
        a = self.attn(self.ln1(x), start, cache, capture)  # [B, T, D]
        if self.parallel:  # NeoX: attention and MLP both read the block's input
            return x + a + self.mlp(self.ln2(x))
        x = x + a
        return x + self.mlp(self.ln2(x))


class Model(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.config = cfg
        self.identity = cfg.name  # load() replaces it with the checkpoint's fingerprint
        self.wte = _weight(cfg.vocab_size, cfg.d_model)
        self.wpe = _weight(cfg.n_ctx, cfg.d_model) if cfg.family == "gpt2" else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, cfg.eps)
        # GPT-2 ties the output head to the token embedding
        self.head = self.wte if cfg.family == "gpt2" else _weight(cfg.vocab_size, cfg.d_model)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, ids, start=0, caches=None, capture=None, keep=None):
        """Logits [B, T, V] of token ids [B, T] at positions start..start+T-1.

        caches: one KVCache per layer holding positions < start. capture: a list that receives
        every layer's (q, k, v) [B, H, T, d]. keep: a bool mask [B, T]; only the kept positions
        pass the final norm and the output head (most of a small model's cost), and their logits
        come back as [N, V] in row-major order, N = keep.sum(); an all-False mask asks for no
        logits at all ([0, V])."""
        T = ids.shape[1]
        if start + T > self.config.n_ctx:
            raise ValueError(
                f"positions up to {start + T} requested; {self.config.name} has {self.config.n_ctx}"
            )
        if keep is not None and (keep.dtype != torch.bool or keep.shape != ids.shape):
            raise ValueError(
                f"keep is {keep.dtype} {list(keep.shape)}; expected a torch.bool mask shaped like "
                f"ids {list(ids.shape)}"
            )
        x = self.wte[ids]  # [B, T, D]
        if self.wpe is not None:
            x = x + self.wpe[start : start + T]  # [B, T, D]
        for i, block in enumerate(self.blocks):
            x = block(x, start, None if caches is None else caches[i], capture)  # [B, T, D]
        if keep is not None:
            x = x[keep]  # [N, D]
        return self.ln_f(x) @ self.head.T  # [B, T, V], or [N, V] with keep


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


def _from_neox(ours: str, t: torch.Tensor, cfg: Config) -> torch.Tensor:
    """NeoX stores Linear weights [out, in] and interleaves q/k/v per head; we want [in, out],
    q|k|v blocks."""
    if ours.endswith(("qkv_w", "qkv_b")):
        per_head = t.reshape(cfg.n_head, 3, cfg.head_dim, -1)  # [H, 3, d, D or 1]
        t = per_head.transpose(0, 1).reshape(3 * cfg.d_model, -1).squeeze(-1)  # [3D, D] or [3D]
    return t.T if t.dim() == 2 and ours not in ("wte", "head") else t


def load(path_or_name, dtype: torch.dtype = torch.float32) -> Model:
    """A frozen teacher from a checkpoint folder or a known name (`gpt2`, `pythia-70m`, ...)."""
    folder = resolve(path_or_name)
    cfg = Config.from_hf(read_config(folder), folder / "config.json")
    names, expected, aliases, ignored = hf_layout(cfg)
    tensors = read_tensors(folder / "model.safetensors", expected, aliases, ignored, dtype)
    model = Model(cfg).to(dtype)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for ours, hf in names.items():
            t = tensors[hf] if cfg.family == "gpt2" else _from_neox(ours, tensors[hf], cfg)
            params[ours].copy_(t)
    model.identity = fingerprint(folder)
    return model.eval()
