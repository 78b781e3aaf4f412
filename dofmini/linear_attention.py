"""Positive-random-feature (PRF) linear attention: any T, part by part; features; the module."""

import math
from dataclasses import dataclass

import torch
from torch import nn

from .checks import need_integers
from .log_space import log_chunks, log_step
from .plain_forms import chunked_attention, recurrent_step

CPU_PART = 1024  # tokens per part on CPU (cache-sized); any other device takes T in one part
HINT = "PRF features overflow fp32 once ‖x‖ ≳ 5√d: pass log-features, log_space=True"


@dataclass
class LinearState:
    """Sums after n tokens (S None before the first): S = Σ_s φ_k,s [v_s, 1]ᵀ [B, H, M, dv+1];
    in log space over c [B, H, M, 1], each feature's largest log φ_k so far."""

    S: torch.Tensor | None = None
    n: int = 0
    c: torch.Tensor | None = None


def causal_linear_attention(
    phi_q, phi_k, v, chunk=64, normalize=True, state=None, log_space=False, form=None
) -> torch.Tensor:
    """[B, H, T, M] x2, [B, H, T, dv] -> [B, H, T, dv] in v's dtype: one token a
    `recurrent_step`, more `chunked_attention` (log_space: `log_step`, `log_chunks`; or
    `form`) on the whole chunks, part by part (`CPU_PART`), then on the rest as one chunk."""
    check_inputs(phi_q, phi_k, v, chunk, normalize, log_space)
    f = torch.promote_types(torch.promote_types(phi_q.dtype, v.dtype), torch.float32)
    B, H, T, M = phi_q.shape
    E = v.shape[-1] + normalize
    carried = start_state(state, v, (B, H, M, E), f, log_space)
    q, k, x = (t.to(f) for t in (phi_q, phi_k, v))
    if normalize:
        x = nn.functional.pad(x, (0, 1), value=1.0)  # [B, H, T, E]
    if T == 1 and form is None:
        step = log_step if log_space else recurrent_step
        y, *carried = step(q, k, x, *carried)
    else:
        form = form or (log_chunks if log_space else chunked_attention)
        y, carried = in_parts(form, q, k, x, carried, chunk)
    if normalize and not log_space and not bool(y[..., -1].isfinite().all()):  # inf/inf: NaN
        raise ValueError(f"causal_linear_attention: sums of φ_q·φ_k overflow {f} ({HINT})")
    if state is not None:
        state.S = carried[0]
        state.c = carried[1] if log_space else None
        state.n += T
    if normalize:  # only the denominator is clamped, only against 0/0
        num, den = y.split_with_sizes([v.shape[-1], 1], -1)  # one split, one backward
        y = num * den.clamp_min(torch.finfo(f).tiny).reciprocal()
    return y.to(v.dtype)


def in_parts(form, q, k, x, carried, chunk):
    """form on the whole chunks, CPU_PART tokens at a time on CPU, then on the rest."""
    T = q.shape[2]
    whole = T - T % chunk
    part = CPU_PART if q.device.type == "cpu" else T
    step = max(part // chunk, 1) * chunk
    sizes = [min(step, whole - lo) for lo in range(0, whole, step)]
    sizes += [T % chunk] if T % chunk else []
    ys = []
    for n, *tokens in zip(sizes, *(t.split(sizes, 2) for t in (q, k, x))):
        chunks = [t.contiguous().unflatten(2, (-1, min(chunk, n))) for t in tokens]
        y, *carried = form(*chunks, *carried)
        ys.append(y.flatten(2, 3))  # [B, H, n, E]
    y = ys[0] if len(ys) == 1 else torch.cat(ys, 2)  # [B, H, T, E]
    return y, carried


def check_inputs(phi_q, phi_k, v, chunk, normalize, log_space):
    """Each bad input refused by name, before any work."""
    need_integers("causal_linear_attention", chunk=chunk)
    named = {"phi_q": phi_q, "phi_k": phi_k, "v": v}
    fits = phi_q.dim() == 4 == v.dim() and phi_q.shape == phi_k.shape
    if not fits or v.shape[:3] != phi_q.shape[:3] or phi_q.shape[2] == 0:
        got = ", ".join(f"{n} {tuple(x.shape)}" for n, x in named.items())
        raise ValueError(f"{got}: expected [B, H, T, M] x2, [B, H, T, dv], T >= 1")
    for name, x in named.items():
        if not x.is_floating_point():
            raise TypeError(f"{name} is {x.dtype}; expected a floating dtype")
        if x.device != v.device:
            raise ValueError(f"{name} is on {x.device}, v on {v.device}; expected one")
    if log_space and not normalize:
        raise ValueError("log_space=True needs normalize=True: its shifts cancel only there")
    if log_space or not normalize:  # no denominator to keep ≥ 0: no read back
        return
    for name, phi in (("phi_q", phi_q), ("phi_k", phi_k)):
        low, high = torch.aminmax(phi)  # one pass; NaN fails both tests
        if not bool((low >= 0) & (high < math.inf)):
            got = f"{name} holds negative, infinite or NaN features"
            raise ValueError(f"{got}; expected finite features >= 0 ({HINT})")


def start_state(state, v, shape, f, log_space):
    """[S] or in log space [S, c]: state's, or empty ones; refused unless they fit."""
    S = None if state is None else state.S
    c = None if state is None else state.c
    c_shape = shape[:3] + (1,) if log_space else None
    if S is None:
        S = v.new_zeros(shape, dtype=f)
        # the lowest finite value, not −inf: an empty state weighs 0, not NaN
        c = v.new_full(c_shape, torch.finfo(f).min, dtype=f) if log_space else None
    got = (tuple(S.shape), None if c is None else tuple(c.shape))
    if got != (shape, c_shape):
        space = "log space: c [B, H, M, 1]" if log_space else "linear space: c None"
        want = f"S [B, H, M, E] = {shape} (E = dv + 1 when normalize=True; {space})"
        raise ValueError(f"state S {got[0]}, c {got[1]} does not fit {want}")
    return [S, c] if log_space else [S]


class PRFFeatures(nn.Module):
    """Φ(x)_m = sqrt(α_m/M) exp(z_mᵀx / d^¼ − |x|²/(2√d)) per head, trainable z [H, M, d] and
    a = log α [H, M]; no epsilon (it would bias the estimate)."""

    def __init__(self, n_head: int, head_dim: int, n_features: int, seed: int, orthogonal=True):
        super().__init__()
        need_integers("PRFFeatures", n_head=n_head, head_dim=head_dim, n_features=n_features)
        self.seed = seed
        gen = torch.Generator().manual_seed(seed)
        z = draw_gaussian(n_head, n_features, head_dim, gen, orthogonal)
        self.z = nn.Parameter(z.float())  # [H, M, d]
        self.a = nn.Parameter(torch.zeros(n_head, n_features))  # [H, M]

    def log_features(self, x: torch.Tensor, name: str = "x") -> torch.Tensor:
        """log Φ(x) [B, H, T, M] in fp32 or wider, for x [B, H, T, d]."""
        H, M, d = self.z.shape
        if x.dim() != 4 or x.shape[1] != H or x.shape[3] != d:
            got = f"{name} has shape {tuple(x.shape)}"
            raise ValueError(f"PRFFeatures: {got}; expected [B, {H}, T, {d}]")
        f = torch.promote_types(torch.promote_types(x.dtype, self.z.dtype), torch.float32)
        x = x.to(f) / d**0.25  # [B, H, T, d]
        scale = 0.5 * (self.a.to(f)[:, None] - math.log(M))  # [H, 1, M] log sqrt(α/M)
        return scale + x @ self.z.to(f).mT - 0.5 * (x * x).sum(-1, keepdim=True)


def draw_gaussian(n_head: int, n_rows: int, dim: int, gen, orthogonal: bool):
    """[n_head, n_rows, dim] rows each marginally N(0, I). Orthogonal (FAVOR+): blocks of dim
    orthogonal directions (Haar: QR with sign fix), norms drawn independently (chi)."""
    f64 = dict(generator=gen, dtype=torch.float64)
    if not orthogonal:
        return torch.randn(n_head, n_rows, dim, **f64)
    blocks = -(-n_rows // dim)  # ⌈M/d⌉
    square = torch.randn(n_head, blocks, dim, dim, **f64)
    Q, R = torch.linalg.qr(square)  # [H, b, d, d] each
    signs = torch.sign(torch.diagonal(R, dim1=-2, dim2=-1))[..., None, :]
    rows = (Q * signs).mT.reshape(n_head, -1, dim)[:, :n_rows]  # unit rows
    lengths = torch.randn(n_head, n_rows, dim, **f64).norm(dim=-1, keepdim=True)
    return rows * lengths  # [H, M, d]


class CausalMixer(nn.Module):
    """A teacher layer's stand-in: its frozen q, k, v mixed with the cache's state. Subclasses
    set `chunk`, new tensors, `_place(base)` and `feature_maps(q, k)` -> (phi_q, phi_k, options)."""

    def forward(self, x, start: int = 0, cache: LinearState | None = None, capture=None):
        if cache is not None and cache.n != start:
            name = type(self).__name__
            raise ValueError(f"{name}: cache holds {cache.n} tokens but start={start}")
        q, k, v = self.base.project(x, start)  # [B, H, T, d] each
        if capture is not None:
            capture.append((q, k, v))
        phi_q, phi_k, options = self.feature_maps(q, k)  # [B, H, T, M] each
        o = causal_linear_attention(phi_q, phi_k, v, self.chunk, state=cache, **options)
        return self.base.output(self.finish(x, o))  # o [B, H, T, d]

    def finish(self, x, o):  # o [B, H, T, d] as the output projection takes it
        return o

    def new_cache(self, batch: int, capacity: int) -> LinearState:  # never grows
        return LinearState()

    def _place(self, base: nn.Module):
        """The new tensors to base's device, in fp32 or base's wider dtype; then base, frozen."""
        p = next(base.parameters())
        self.to(p.device, torch.promote_types(p.dtype, torch.float32))
        self.base = base.requires_grad_(False)


class LinearAttention(CausalMixer):
    """Drop-in for a teacher's attention: PRF linear attention in log space; trains z, a."""

    def __init__(self, base: nn.Module, n_features: int, seed: int, orthogonal=True, chunk=64):
        super().__init__()
        self.chunk = chunk
        self.features = PRFFeatures(base.n_head, base.head_dim, n_features, seed, orthogonal)
        self._place(base)

    def feature_maps(self, q, k):
        log_q = self.features.log_features(q, "q")  # [B, H, T, M]
        log_k = self.features.log_features(k, "k")
        return log_q, log_k, {"log_space": True}
