"""GPT-2 and GPT-NeoX (Pythia) forward passes; torch only. Each projection is stored [in, out],
applied as `x @ W + b` (GPT-2's Conv1D layout; checkpoint.py brings NeoX's weights to it): one pass
serves both. A student swaps each layer's attention, keeping the teacher's projections."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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
    tied_head: bool = True  # the output head is the token embedding (GPT-2's default)
    name: str = ""
    bos_token_id: int | None = None  # hub.load_tokenizer checks both against the tokenizer
    eos_token_id: int | None = None

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


def _weight(*shape) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape), requires_grad=False)


class KVCache:
    """Keys and values of the tokens seen so far, in buffers sized once for the whole generation."""

    def __init__(self, like: torch.Tensor, shape: tuple):
        self.k = like.new_empty(shape)  # [B, H, capacity, d]
        self.v = like.new_empty(shape)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor):
        end = self.length + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache holds {self.k.shape[2]} positions; appending reaches {end}")
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
        """Rotate the first rotary_dim dims as NeoX does (halves turn as pairs), angles in fp32."""
        r = self.rotary_dim
        f32 = dict(device=x.device, dtype=torch.float32)
        pos = torch.arange(start, start + x.shape[2], **f32)  # [T]
        inv_freq = self.rotary_base ** (-torch.arange(0, r, 2, **f32) / r)  # [r/2]
        angles = torch.outer(pos, inv_freq).repeat(1, 2)  # [T, r]
        x_rot = x[..., :r]  # [B, H, T, r]
        half = torch.cat((-x_rot[..., r // 2 :], x_rot[..., : r // 2]), dim=-1)
        cos = angles.cos().to(x.dtype)
        sin = angles.sin().to(x.dtype)
        turned = x_rot * cos + half * sin  # [B, H, T, r]
        return torch.cat((turned, x[..., r:]), dim=-1)  # [B, H, T, d]

    def project(self, x: torch.Tensor, start: int = 0):
        """q, k, v [B, H, T, d] as the softmax sees them (after bias, and NeoX's rotary)."""
        qkv = x @ self.qkv_w + self.qkv_b  # [B, T, 3D]
        heads = qkv.unflatten(-1, (3, self.n_head, self.head_dim))  # [B, T, 3, H, d]
        q, k, v = heads.permute(2, 0, 3, 1, 4)  # [B, H, T, d] each
        if self.rotary_dim:
            q = self.rotate(q, start)  # [B, H, T, d]
            k = self.rotate(k, start)
        return q, k, v

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return o.transpose(1, 2).flatten(2) @ self.out_w + self.out_b  # [B, T, D]

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        return KVCache(self.qkv_w, (batch, self.n_head, capacity, self.head_dim))

    def forward(self, x, start=0, cache=None, capture=None):
        q, k, v = self.project(x, start)  # [B, H, T, d] each
        if capture is not None:
            capture.append((q, k, v))
        if cache is not None:
            k, v = cache.append(k, v)  # [B, H, L, d] each, L = past + T
        past = k.shape[2] - q.shape[2]
        mask = None
        if past:  # query i sees keys <= past + i
            mask = q.new_ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(past)  # [T, L]
        o = F.scaled_dot_product_attention(q, k, v, mask, is_causal=not past)  # [B, H, T, d]
        return self.output(o)  # [B, T, D]


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.parallel = cfg.parallel_residual
        self.gelu = "tanh" if cfg.tanh_gelu else "none"  # F.gelu's approximation
        self.ln1 = nn.LayerNorm(cfg.d_model, cfg.eps)
        self.ln2 = nn.LayerNorm(cfg.d_model, cfg.eps)
        self.attn = Attention(cfg)
        self.fc_w = _weight(cfg.d_model, cfg.d_ff)
        self.fc_b = _weight(cfg.d_ff)
        self.proj_w = _weight(cfg.d_ff, cfg.d_model)
        self.proj_b = _weight(cfg.d_model)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(x @ self.fc_w + self.fc_b, approximate=self.gelu)  # [B, T, F]
        return h @ self.proj_w + self.proj_b  # [B, T, D]

    def forward(self, x, start=0, cache=None, capture=None):
        mixed = x + self.attn(self.ln1(x), start, cache, capture)  # [B, T, D]
        # NeoX's MLP reads the block's input, as its attention does
        return mixed + self.mlp(self.ln2(x if self.parallel else mixed))  # [B, T, D]


class Model(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.config = cfg
        self.identity = cfg.name  # hub.load sets the checkpoint's fingerprint
        self.wte = _weight(cfg.vocab_size, cfg.d_model)
        self.wpe = _weight(cfg.n_ctx, cfg.d_model) if cfg.family == "gpt2" else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, cfg.eps)
        self.head = self.wte if cfg.tied_head else _weight(cfg.vocab_size, cfg.d_model)
        self.requires_grad_(False)  # a frozen teacher, its LayerNorms included

    def forward(self, ids, start=0, caches=None, capture=None, keep=None, upto=None):
        """Logits [B, T, V] of token ids [B, T] at positions start..start+T-1. caches: a KVCache per
        layer, of positions < start. capture: a list getting each layer's (q, k, v). keep: a bool
        mask [B, T]; only kept positions pass the final norm and head (most of a small model's
        cost): [N = keep.sum(), V], row-major. upto: the first `upto` blocks' output [B, T, D]."""
        integer = not (ids.dtype.is_floating_point or ids.dtype.is_complex)
        if ids.dim() != 2 or not integer or ids.dtype == torch.bool:
            got = f"{ids.dtype} {list(ids.shape)}"
            raise ValueError(f"Model.forward: ids is {got}; expected integer token ids [B, T]")
        T = ids.shape[1]
        cfg = self.config
        if start < 0 or start + T > cfg.n_ctx:
            asked = f"positions {start}..{start + T - 1} requested"
            raise ValueError(f"{asked}; {cfg.name} has 0..{cfg.n_ctx - 1}")
        if keep is not None and (keep.dtype != torch.bool or keep.shape != ids.shape):
            got = f"{keep.dtype} {list(keep.shape)}"
            want = list(ids.shape)
            raise ValueError(f"keep is {got}; expected a torch.bool mask shaped like ids {want}")
        x = self.wte[ids.long()]  # [B, T, D]: uint8 or bool indices would be masks
        if self.wpe is not None:
            x = x + self.wpe[start : start + T]  # [B, T, D]
        for i, block in enumerate(self.blocks[:upto]):
            cache = None if caches is None else caches[i]
            x = block(x, start, cache, capture)  # [B, T, D]
        if upto is not None:
            return x
        if keep is not None:
            x = x[keep]  # [N, D]
        return self.ln_f(x) @ self.head.T  # [B, T, V], or [N, V] with keep

    @torch.no_grad()
    def capture(self, ids, upto=None):
        """(q, k, v) [B, H, T, d] of ids [B, T] in the first `upto` layers (default all), alone."""
        layers = []
        self(ids, capture=layers, upto=upto or len(self.blocks))
        return layers

    def token_ids(self, token_ids, need: int, what: str) -> torch.Tensor:
        """token_ids as a 1-D CPU LongTensor of at least `need` ids in [0, vocab), or a named
        error (a float or negative id would index the embedding silently wrong)."""
        token_ids = torch.as_tensor(token_ids)
        vocab = self.config.vocab_size
        whole = token_ids.dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
        if token_ids.dim() != 1 or len(token_ids) < need or not whole:
            got = f"{token_ids.dtype} {tuple(token_ids.shape)}"
            raise ValueError(f"{what}: token_ids {got}; need 1-D integers, >= {need} tokens")
        if len(token_ids) and not 0 <= token_ids.min() <= token_ids.max() < vocab:
            span = f"{token_ids.min()}..{token_ids.max()}"
            raise ValueError(f"{what}: token ids span {span}; expected ids in [0, {vocab})")
        return token_ids.long().cpu().contiguous()
