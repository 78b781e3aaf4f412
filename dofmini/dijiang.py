"""DiJiang baseline (Chen et al. 2024, arXiv 2403.19928) as its public Pythia code trains it:
features φ(x) = softmax(x P), P = C·diag(F⁻¹(u)) frozen (C the orthonormal DCT-II, F⁻¹ the normal
inverse CDF: weighted quasi-Monte-Carlo), scores decaying as γ_h^(t−s) with no normaliser, each
head's output GroupNorm-ed and gated by SiLU(x W_G); γ, the norm and W_G train on the LM loss."""

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from .linear_attention import CausalMixer
from .plain_forms import chunk_states


def decayed_chunks(q, k, v, S, log_g):
    """chunked_attention with each term weighed by γ^(t−s) (log_g = log γ [H, 1, 1]; the released
    code is quadratic). Keys weigh γ^(L−1−j) (their age at the chunk's end), states shrink by γ^L
    per chunk (a scan), token i reads the state before its chunk with γ^(i+1), the L×L product
    takes γ^(i−j): each a power of γ ≤ 1 computed directly, never a ratio."""
    _, H, N, L, _ = q.shape
    log_g = log_g.to(q.dtype)
    if log_g.shape != (H, 1, 1):
        raise ValueError(f"decay must be [H={H}]; got shape {tuple(log_g.shape[:1])}")
    i = torch.arange(L, device=q.device, dtype=q.dtype)[:, None]  # [L, 1]
    kv = (k * torch.exp((L - 1 - i) * log_g)[:, None]).mT @ v  # [B, H, N, M, E]
    n = torch.arange(N + 1, device=q.device, dtype=q.dtype)[:, None, None]  # [N+1, 1, 1]
    before, S = chunk_states(S, kv, n * L * log_g[:, None])  # [B, H, N, M, E], [B, H, M, E]
    inter = (q * torch.exp((i + 1) * log_g)[:, None]) @ before  # [B, H, N, L, E]
    lag = i - i.mT  # [L, L]
    weights = torch.exp((lag * log_g).masked_fill(lag < 0, -math.inf))[:, None]  # [H, 1, L, L]
    return inter + (q @ k.mT * weights) @ v, S


def decay_form(decay: torch.Tensor):
    """causal_linear_attention's `form` for decay γ [H] in (0, 1], checked once (a host read)."""
    if decay.dim() != 1 or not bool(((decay > 0) & (decay <= 1)).all()):
        got = f"shape {tuple(decay.shape)}, range [{decay.min().item()}, {decay.max().item()}]"
        raise ValueError(f"decay must be [H] with values in (0, 1]; got {got}")
    return partial(decayed_chunks, log_g=decay.log()[:, None, None])


def dct_matrix(d: int) -> torch.Tensor:
    """Orthonormal DCT-II [d, d] (fp64): C[k, n] = sqrt((2 − [k=0]) / d) · cos(π (2n+1) k / 2d)."""
    k = torch.arange(d, dtype=torch.float64)[:, None]
    n = torch.arange(d, dtype=torch.float64)[None]
    scale = torch.where(k == 0, 1.0, 2.0).div(d).sqrt()  # [d, 1]
    return torch.cos(math.pi * (2 * n + 1) * k / (2 * d)) * scale  # [d, d]


def dijiang_projection(d: int, gen: torch.Generator) -> torch.Tensor:
    """P = C·diag(F⁻¹(u)) [d, d] fp64, u ~ U(0,1) per dim, kept off 0 and 1 so F⁻¹ stays finite."""
    eps = torch.finfo(torch.float64).eps
    u = torch.rand(d, generator=gen, dtype=torch.float64).clamp(eps, 1 - eps)  # [d]
    return dct_matrix(d) * torch.special.ndtri(u)  # [d, d]: column j scaled by F⁻¹(u_j)


class DiJiangAttention(CausalMixer):
    """Drop-in for a teacher attention layer, as LinearAttention; trains decay_logit [H] (γ =
    sigmoid), norm and gate. No PRF `features`, so no per-layer error: the gate reads x too."""

    def __init__(self, base: nn.Module, seed: int, chunk: int = 64):
        super().__init__()
        self.chunk = chunk
        H, d = base.n_head, base.head_dim
        gen = torch.Generator().manual_seed(seed)
        self.register_buffer("proj", dijiang_projection(d, gen).float())  # [d, d]
        ends = math.log(1 / 32), math.log(1 / 512)
        log_1mg = torch.linspace(*ends, H, dtype=torch.float64)  # [H] log(1 − γ)
        self.decay_logit = nn.Parameter((torch.log1p(-log_1mg.exp()) - log_1mg).float())  # logit γ
        self.norm = nn.GroupNorm(H, H * d)
        # W_G = gate / √D: an Adam step of ~lr per entry moves x W_G by ~lr·√D, not lr·D. Init: the
        # released code's Xavier-uniform W_G with gain 2^−2.5, i.e. bound 2^−2.5·√(6/2D)·√D on gate.
        u = torch.rand(H * d, H * d, generator=gen, dtype=torch.float64)  # [D, D]
        self.gate = nn.Parameter(((2 * u - 1) * 2**-2.5 * math.sqrt(3)).float())  # [D, D]
        self._place(base)

    def phi(self, x: torch.Tensor) -> torch.Tensor:
        """φ(x) = softmax over the features of x P: [B, H, T, d] -> [B, H, T, d], fp32 or wider."""
        f = torch.promote_types(x.dtype, torch.float32)
        return torch.softmax(x.to(f) @ self.proj.to(f), -1)  # [B, H, T, d]

    def feature_maps(self, q, k):
        """Softmax features (bounded: no shift), no normaliser; γ in (0, 1): no check, no sync."""
        form = partial(decayed_chunks, log_g=F.logsigmoid(self.decay_logit)[:, None, None])
        return self.phi(q), self.phi(k), {"normalize": False, "form": form}  # log γ [H, 1, 1]

    def finish(self, x, o):
        """Each head's mixed values o [B, H, T, d] GroupNorm-ed and gated by SiLU(x W_G)."""
        B, H, T, d = o.shape
        f = torch.promote_types(x.dtype, torch.float32)
        flat = o.to(f).transpose(1, 2).reshape(B * T, H * d)  # [B*T, D]
        norm = self.norm
        o = F.group_norm(flat, H, norm.weight.to(f), norm.bias.to(f), norm.eps)  # each head alone
        o = F.silu(x.to(f) @ self.gate.to(f) / math.sqrt(H * d)) * o.view(B, T, H * d)  # [B, T, D]
        return o.view(B, T, H, d).transpose(1, 2).to(x.dtype)  # [B, H, T, d]
