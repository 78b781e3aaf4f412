"""Positive-random-feature (PRF) linear attention: features, three causal forms, and a drop-in attention module.

Vendorable: imports torch and the standard library only. SPEC §2 for the estimator. The three forms
(`causal_linear_attention` chunked, `recurrent_step`, `quadratic_causal_attention`) compute the same thing,
    y_t = Σ_{s≤t} γ^(t−s) (φ_q,t·φ_k,s) v_s / Σ_{s≤t} γ^(t−s) (φ_q,t·φ_k,s)   (γ = 1 unless `decay` is given),
always in fp32 (or fp64 for fp64 inputs), returning v's dtype. `normalize=False` drops the denominator.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn

SEGMENT = (
    1024  # tokens per vectorised pass on CPU: cache-sized temporaries, 1.3x faster at T = 32768
)


class PRFFeatures(nn.Module):
    """Φ(x)_m = sqrt(α_m/M) exp(z_mᵀx / d^¼ − |x|²/(2√d)) per head; trainable z [H, M, d] and a = log α [H, M].

    Stabilisation, exact by construction. z·k' − |k'|²/2 = |z|²/2 − |k'−z|²/2 with k' = k/d^¼, so keys drop the
    data-independent c_m = |z_m|²/2 (their log-features are then ≤ ½(a_m − log M): no overflow, no dependence on
    other tokens) and queries add the same c_m, which cancels exactly in every product Φ(q)·Φ(k). Each query then
    drops its own largest log-feature (detached) and the per-query constants; these factor out of a whole
    attention row, so the normalised output is unchanged, and `queries` returns them as `log_scale`:
    Φ(q)·Φ(k) = exp(log_scale) · (queries(q)[0] · keys(k)). No epsilon anywhere: it would bias the estimate.
    """

    def __init__(
        self, n_head: int, head_dim: int, n_features: int, seed: int, orthogonal: bool = True
    ):
        super().__init__()
        if min(n_head, head_dim, n_features) < 1:
            raise ValueError(
                f"PRFFeatures needs n_head, head_dim, n_features >= 1; got "
                f"{n_head}, {head_dim}, {n_features}"
            )
        self.seed, self.orthogonal = seed, orthogonal
        z = draw_gaussian(
            n_head, n_features, head_dim, torch.Generator().manual_seed(seed), orthogonal
        )
        self.z = nn.Parameter(z.float())  # [H, M, d]
        self.a = nn.Parameter(torch.zeros(n_head, n_features))  # [H, M]

    def extra_repr(self) -> str:
        H, M, d = self.z.shape
        return f"n_head={H}, n_features={M}, head_dim={d}, seed={self.seed}, orthogonal={self.orthogonal}"

    def _scaled(self, x: torch.Tensor, name: str):
        """x / d^¼ in the compute dtype, and z in the same dtype, after checking x's shape."""
        H, M, d = self.z.shape
        if x.dim() != 4 or x.shape[1] != H or x.shape[3] != d:
            raise ValueError(
                f"PRFFeatures: {name} has shape {tuple(x.shape)}; expected [B, {H}, T, {d}]"
            )
        f = torch.promote_types(torch.promote_types(x.dtype, self.z.dtype), torch.float32)
        return x.to(f) / d**0.25, self.z.to(f)  # [B, H, T, d], [H, M, d]

    def keys(self, k: torch.Tensor) -> torch.Tensor:
        """Φ(k)·exp(−c) [B, H, T, M]: each key's own features, never above sqrt(α/M)."""
        k, z = self._scaled(k, "k")
        dist2 = (
            (k * k).sum(-1, keepdim=True) - 2 * k @ z.mT + (z * z).sum(-1)[:, None]
        )  # [B, H, T, M] |k'−z|²
        return torch.exp(
            0.5 * (self.a.to(k.dtype)[:, None] - math.log(z.shape[1])) - 0.5 * dist2
        )  # [B, H, T, M]

    def queries(self, q: torch.Tensor):
        """(Φ(q)·exp(c − log_scale) [B, H, T, M] with max feature 1, log_scale [B, H, T, 1])."""
        q, z = self._scaled(q, "q")
        log_phi = (
            0.5 * self.a.to(q.dtype)[:, None] + q @ z.mT + 0.5 * (z * z).sum(-1)[:, None]
        )  # [B, H, T, M]
        top = log_phi.amax(-1, keepdim=True).detach()  # [B, H, T, 1]
        log_scale = (
            top - 0.5 * math.log(z.shape[1]) - 0.5 * (q * q).sum(-1, keepdim=True)
        )  # [B, H, T, 1]
        return torch.exp(log_phi - top), log_scale


def draw_gaussian(
    n_head: int, n_rows: int, dim: int, gen: torch.Generator, orthogonal: bool
) -> torch.Tensor:
    """[n_head, n_rows, dim] rows each marginally N(0, I). Orthogonal (FAVOR+): blocks of dim orthogonal
    directions (Haar, via QR with sign fix) with norms drawn independently from the chi distribution."""
    if not orthogonal:
        return torch.randn(n_head, n_rows, dim, generator=gen, dtype=torch.float64)
    blocks = -(-n_rows // dim)
    Q, R = torch.linalg.qr(
        torch.randn(n_head, blocks, dim, dim, generator=gen, dtype=torch.float64)
    )
    Q = (
        Q * torch.sign(torch.diagonal(R, dim1=-2, dim2=-1))[..., None, :]
    )  # [H, b, d, d] Haar columns
    rows = Q.mT.reshape(n_head, blocks * dim, dim)[:, :n_rows]  # [H, M, d] unit rows
    norms = torch.randn(n_head, n_rows, dim, generator=gen, dtype=torch.float64).norm(
        dim=-1, keepdim=True
    )
    return rows * norms  # [H, M, d]


@dataclass
class LinearState:
    """Running sums after n tokens, fp32 (fp64 for fp64 inputs): S = Σ_s γ^(n−1−s) φ_k,s [v_s, 1]ᵀ [B, H, M, dv+1]
    (the last column is the normaliser; no such column when normalize=False). Empty (S None) until the first
    token; it never grows with n."""

    S: torch.Tensor | None = None
    n: int = 0


def _prepare(phi_q, phi_k, v, decay, normalize: bool, state: LinearState | None):
    """Checked inputs in the compute dtype, log γ [H, 1, 1] or None, and the starting state [B, H, M, E]."""
    if (
        phi_q.dim() != 4
        or phi_q.shape != phi_k.shape
        or v.dim() != 4
        or v.shape[:3] != phi_q.shape[:3]
        or phi_q.shape[2] == 0
    ):
        raise ValueError(
            f"phi_q {tuple(phi_q.shape)}, phi_k {tuple(phi_k.shape)}, v {tuple(v.shape)}: expected "
            f"phi_q, phi_k [B, H, T, M] and v [B, H, T, dv] with T >= 1"
        )
    f = torch.promote_types(torch.promote_types(phi_q.dtype, v.dtype), torch.float32)
    q, k, v = phi_q.to(f), phi_k.to(f), v.to(f)
    (B, H, T, M), E = q.shape, v.shape[-1] + normalize
    log_g = None
    if decay is not None:
        if decay.shape != (H,) or not bool(((decay > 0) & (decay <= 1)).all()):
            raise ValueError(
                f"decay must be [H={H}] with values in (0, 1]; got shape {tuple(decay.shape)}, "
                f"range [{decay.min().item()}, {decay.max().item()}]"
            )
        log_g = decay.to(f).log()[:, None, None]  # [H, 1, 1]
    S = v.new_zeros(B, H, M, E) if state is None or state.S is None else state.S  # [B, H, M, E]
    if S.shape != (B, H, M, E):
        raise ValueError(
            f"state S {tuple(S.shape)} does not fit [B, H, M, E] = {(B, H, M, E)} "
            f"(E = dv + 1 when normalize=True)"
        )
    return q, k, v, log_g, S


def _with_ones(v, normalize: bool):
    """v [B, H, T, dv] -> [B, H, T, E], contiguous: the denominator rides along as a column of ones."""
    return torch.cat([v, v.new_ones(*v.shape[:3], 1)], -1) if normalize else v.contiguous()


def _decay_weights(L: int, log_g, device, dtype) -> torch.Tensor:
    """[H or 1, L, L] causal weights γ^(i−j) for j ≤ i, 0 above the diagonal."""
    i = torch.arange(L, device=device)
    lag = (i[:, None] - i[None, :]).to(dtype)  # [L, L]
    if log_g is None:
        return (lag >= 0).to(dtype)[None]
    return torch.exp((lag * log_g).masked_fill(lag < 0, -math.inf))  # [H, L, L]


def _chunks(q, k, v, L: int, log_g, S0):
    """Chunked pass over T = N·L tokens from state S0 [B, H, M, E]: outputs [B, H, T, E], final state."""
    B, H, T, M = q.shape
    N, E = T // L, v.shape[-1]
    q, k, v = q.view(B, H, N, L, M), k.view(B, H, N, L, M), v.view(B, H, N, L, E)
    weights = _decay_weights(L, log_g, q.device, q.dtype)[:, None]  # [H or 1, 1, L, L]
    scores = q @ k.mT  # [B, H, N, L, L]
    scores = (
        scores.mul_(weights) if log_g is None else scores * weights
    )  # in place when no γ may need them
    if (
        log_g is not None
    ):  # states are kept as of each chunk's last token: weigh keys by their lag to it
        lag = torch.arange(L, device=q.device, dtype=q.dtype)[:, None]  # [L, 1]
        q, k = (
            q * torch.exp((lag + 1) * log_g)[:, None],
            k * torch.exp((L - 1 - lag) * log_g)[:, None],
        )
    own = k.mT @ v  # [B, H, N, M, E] what each chunk adds to the state
    P = torch.cat(
        [S0[:, :, None], own[:, :, :-1]], 2
    )  # [B, H, N, M, E] becomes the state before each chunk
    if log_g is None:
        P = P.cumsum_(2)
    else:  # scan P_n += γ^L P_{n−1} (states carried one chunk on) in log2(N) doubling steps (Hillis–Steele)
        step = 1
        while step < N:
            carry = torch.exp(step * L * log_g)[:, None]  # [H, 1, 1, 1]
            P = torch.cat([P[:, :, :step], P[:, :, step:] + carry * P[:, :, :-step]], 2)
            step *= 2
    y = (scores @ v).view(-1, L, E).baddbmm_(q.reshape(-1, L, M), P.view(-1, M, E))  # [B·H·N, L, E]
    last = P[:, :, -1] if log_g is None else torch.exp(L * log_g) * P[:, :, -1]  # [B, H, M, E]
    return y.view(B, H, T, E), last + own[:, :, -1]


def _finish(y, dv: int, normalize: bool, dtype):
    if normalize:  # only the denominator is clamped, and only against 0/0
        y = y[..., :dv] / y[..., dv:].clamp_min(torch.finfo(y.dtype).tiny)
    return y.to(dtype)


def causal_linear_attention(
    phi_q,
    phi_k,
    v,
    chunk: int = 64,
    decay=None,
    normalize: bool = True,
    state: LinearState | None = None,
) -> torch.Tensor:
    """Chunked causal linear attention: [B, H, T, M] x2, [B, H, T, dv] -> [B, H, T, dv] in v's dtype.

    Exact masked products inside chunks of `chunk` tokens plus a prefix sum over per-chunk states, never a
    per-token state. On CPU, segments of about SEGMENT tokens go one after another (temporaries stay cache-sized);
    on GPU the whole sequence is one pass. `decay`: per-head γ [H]. `state`: start from it and leave the final
    state in it (prefill).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1; got {chunk}")
    dv, dtype = v.shape[-1], v.dtype
    q, k, v, log_g, S = _prepare(phi_q, phi_k, v, decay, normalize, state)
    T = q.shape[2]
    full = T - T % chunk
    step = max(full, chunk) if q.is_cuda else chunk * max(1, SEGMENT // chunk)
    parts = [(lo, min(lo + step, full), chunk) for lo in range(0, full, step)] + [
        (full, T, T - full)
    ] * (T > full)
    out = v.new_empty(*v.shape[:3], dv, dtype=dtype)  # [B, H, T, dv] filled segment by segment
    for lo, hi, L in parts:
        seg = (
            q[:, :, lo:hi].contiguous(),
            k[:, :, lo:hi].contiguous(),
            _with_ones(v[:, :, lo:hi], normalize),
        )
        y, S = _chunks(*seg, L, log_g, S)  # contiguous segments: one copy each, not one per matmul
        out[:, :, lo:hi] = _finish(y, dv, normalize, dtype)
    if state is not None:
        state.S, state.n = S, state.n + T
    return out


def recurrent_step(
    state: LinearState, phi_q, phi_k, v, decay=None, normalize: bool = True
) -> torch.Tensor:
    """Token-by-token form for decoding: O(M·dv) per token, the state updated in place. [B, H, T, dv] out."""
    dv, dtype = v.shape[-1], v.dtype
    q, k, v, log_g, S = _prepare(phi_q, phi_k, v, decay, normalize, state)
    v, g, ys = (
        _with_ones(v, normalize),
        (None if log_g is None else torch.exp(log_g)),
        [],
    )  # γ [H, 1, 1]
    for t in range(q.shape[2]):
        if g is not None:  # without decay S is only added to: no multiply by 1 on the decoding path
            S = g * S
        S = S + k[:, :, t, :, None] * v[:, :, t, None, :]  # [B, H, M, E]
        ys.append(q[:, :, t, None] @ S)  # [B, H, 1, E]
    state.S, state.n = S, state.n + q.shape[2]
    return _finish(torch.cat(ys, 2), dv, normalize, dtype)


def quadratic_causal_attention(phi_q, phi_k, v, decay=None, normalize: bool = True) -> torch.Tensor:
    """Ground truth: the T×T masked product. [B, H, T, dv] out in v's dtype."""
    dv, dtype = v.shape[-1], v.dtype
    q, k, v, log_g, _ = _prepare(phi_q, phi_k, v, decay, normalize, None)
    A = q @ k.mT * _decay_weights(q.shape[2], log_g, q.device, q.dtype)  # [B, H, T, T]
    return _finish(A @ _with_ones(v, normalize), dv, normalize, dtype)


class LinearAttention(nn.Module):
    """Drop-in for a teacher attention layer: the teacher's q, k, v and output projection (`base.project`,
    `base.output`, frozen), with PRF linear attention in place of the softmax. Trainable: features.z, features.a."""

    def __init__(
        self, base: nn.Module, n_features: int, seed: int, orthogonal: bool = True, chunk: int = 64
    ):
        super().__init__()
        self.base, self.chunk = base.requires_grad_(False), chunk
        self.features = PRFFeatures(base.n_head, base.head_dim, n_features, seed, orthogonal)

    def forward(self, x, start: int = 0, cache: LinearState | None = None, capture=None):
        q, k, v = self.base.project(x, start)  # [B, H, T, d] each
        if capture is not None:
            capture.append((q, k, v))
        phi_q, phi_k = self.features.queries(q)[0], self.features.keys(k)  # [B, H, T, M] each
        if cache is not None and cache.n != start:
            raise ValueError(f"LinearAttention: cache holds {cache.n} tokens but start={start}")
        if cache is not None and q.shape[2] == 1:
            return self.base.output(recurrent_step(cache, phi_q, phi_k, v))
        return self.base.output(causal_linear_attention(phi_q, phi_k, v, self.chunk, state=cache))

    def new_cache(self, batch: int, capacity: int) -> LinearState:
        """An empty state; `capacity` is accepted for the teacher's interface, but the state never grows."""
        return LinearState()


def replace_attention(model: nn.Module, dims, seed: int, orthogonal: bool = True) -> nn.Module:
    """Swap model.blocks[i].attn for LinearAttention with dims[i] features (seed + i), in place; returns model."""
    if len(dims) != len(model.blocks):
        raise ValueError(
            f"replace_attention: {len(dims)} feature dims for {len(model.blocks)} blocks"
        )
    for i, (block, M) in enumerate(zip(model.blocks, dims)):
        block.attn = LinearAttention(block.attn, int(M), seed + i, orthogonal)
    return model
