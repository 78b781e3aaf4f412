"""Positive-random-feature (PRF) linear attention: the chunked causal algorithm, features, a module.

Vendorable: torch and the standard library only. Causal linear attention computes
    y_t = Σ_{s≤t} (φ_q,t·φ_k,s) v_s / Σ_{s≤t} (φ_q,t·φ_k,s) = φ_q,t·S_t / φ_q,t·s_t,
    S_t = Σ_{s≤t} φ_k,s v_sᵀ [M, dv],   s_t = Σ_{s≤t} φ_k,s [M]
(normalize=False: no denominator). `chunked_attention` is the algorithm; causal_linear_attention
runs it on any T (one token from a state: a decoding step), in log space (`log_chunks`, as PRF
features need) or another `form` (dijiang.py's decay), in fp32 (fp64 for fp64 inputs)."""

import math
from dataclasses import dataclass

import torch
from torch import nn


def chunked_attention(q, k, v, S, c=None):
    """The algorithm on N chunks of L tokens, q, k [B, H, N, L, M], v [B, H, N, L, E], from the
    state S [B, H, M, E] before them (with a column of ones in v, S carries s_t and y_t ends in its
    denominator). Returns y [B, H, N, L, E], the state after, and c (a form's; unused here)."""
    kv = k.mT @ v  # [B, H, N, M, E] 1. each chunk's own sum Σ_s φ_k,s v_sᵀ, one matmul
    before, S = chunk_states(S, kv)  # [B, H, N, M, E] 2. the state before each chunk, O(N·M·E)
    inter = q @ before  # [B, H, N, L, E] 3. each token reads the state before its chunk
    intra = (q @ k.mT).tril_() @ v  # [B, H, N, L, E] 4. and its chunk's tokens up to itself, L×L
    return inter + intra, S, c


def chunk_states(S, kv, A=None):
    """Step 2: the states before each chunk [B, H, N, M, E], after the last [B, H, M, E]; A: scan"""
    if kv.shape[2] == 1:  # one chunk (a decoding step): its state before is S, no scan
        shrink = 1 if A is None else torch.exp(A.narrow(-3, 1, 1) - A.narrow(-3, 0, 1)).squeeze(-3)
        return S[:, :, None], shrink * S + kv[:, :, 0]
    X = torch.cat([S[:, :, None], kv], 2)  # [B, H, N+1, M, E]
    before, after = (X.cumsum(2) if A is None else scan_chunks(X, A)).split([kv.shape[2], 1], 2)
    return before, after[:, :, 0]


def scan_chunks(X, A):
    """P_n = Σ_{n'≤n} exp(A_n − A_n') X_n' along dim −3, A non-increasing there, each factor ≤ 1
    formed directly (exp(A_n)·exp(−A_n') would overflow). Pairs merge (x1 + exp(a1 − a0) x0, A at
    the second), the half-length scan gives every second P, one step the rest: O(N) work."""
    N = X.shape[-3]
    if N == 1:
        return X
    if N % 2:  # the first chunk on its own: it reaches each later one through exp(A − A_0)
        (x, X), (a, A) = X.split([1, N - 1], -3), A.split([1, N - 1], -3)  # [..., 1 | N − 1, ·]
        return torch.cat([x, scan_chunks(X, A) + torch.exp(A - a) * x], -3)
    (x0, x1), (a0, a1) = (t.unflatten(-3, (N // 2, 2)).unbind(-3) for t in (X, A))  # [..., N/2, ·]
    odd = scan_chunks(x1 + torch.exp(a1 - a0) * x0, a1)  # [..., N/2, M, E] P at chunks 1, 3, ...
    lead, prev = odd.split([N // 2 - 1, 1], -3)[0], a1.split([N // 2 - 1, 1], -3)[0]
    first, rest = x0.split([1, N // 2 - 1], -3)  # chunk 0, then chunks 2, 4, ...
    later = torch.exp(a0.split([1, N // 2 - 1], -3)[1] - prev) * lead  # [..., N/2 − 1, M, E]
    even = torch.cat([first, rest + later], -3)  # [..., N/2, M, E]
    return torch.stack([even, odd], -3).flatten(-4, -3)  # [..., N, M, E]


# Tokens per part on CPU: cache-sized temporaries, 1.7-2.7x faster than one part at T = 16K-32K.
SEGMENT = 1024
# How far a key's log-feature may rise above `start` in `log_chunks`: its factor stays ≤ e^40 (an
# L×L product ≤ L·M·e^40 < 3e38); a term ≥ e^−47 of its row's largest keeps a query factor ≥ e^−87.
RISE = 40.0


def log_chunks(q, k, v, S, c):
    """`chunked_attention` from log-features q, k, the state S held relative to c [B, H, M, 1]. PRF
    log-features exceed fp32's range (e^±87) once ‖k‖ ≳ 5√d, and no one shift per key rescues
    them (a query's and a key's largest features can sit at different m). So the same four steps
    run relative to per-feature maxima that only look back: 1-2 to the keys' running maximum
    (`refs`: the scan rescales by exp(c_old − c_new), as online softmax does); 3-4 to `start`, that
    raised to the chunk's first key, each query taking out its largest exponent t. Exact while no
    key rises over RISE above `start`; rows from such a key on take `_log_intra`'s exact product.
    Shifts cancel in the normalised output: detached. -> y [B, H, N, L, E] (rows scaled), S, c."""
    B, H, N, L, _ = q.shape
    top = k.detach().amax(3, keepdim=True)  # [B, H, N, 1, M] each chunk's largest key features
    refs = torch.cat([c.mT[:, :, None], top], 2).cummax(2).values  # [B, H, N+1, 1, M]
    kv = torch.exp(k - refs[:, :, 1:]).mT @ v  # [B, H, N, M, E] relative to the max after it
    before, S = chunk_states(S, kv, -refs.mT)  # each relative to its refs
    start = torch.maximum(refs[:, :, :-1], k.detach()[:, :, :, :1])  # [B, H, N, 1, M]
    a, t = _shifted(q, start)  # [B, H, N, L, M], [B, H, N, L, 1]
    inter = a @ (before * torch.exp(refs[:, :, :-1] - start).mT)  # [B, H, N, L, E]
    keys = torch.exp((k - start).clamp_max(RISE))  # [B, H, N, L, M] clamped only where unused
    y = inter + (a @ keys.mT).tril_() @ v  # [B, H, N, L, E]
    risen = (k.detach() - start).amax(-1, keepdim=True).cummax(3).values > RISE  # [B, H, N, L, 1]
    if L > 1 and (not q.is_cpu or risen.any()):  # a chunk's first key never rises
        # the chunks that need it, read back on CPU, where it is free; on a device, all of them
        need = risen.any(3).flatten()  # [B·H·N]
        i = need.nonzero()[:, 0] if q.is_cpu else torch.arange(len(need), device=need.device)
        q, k, v, inter, t, y, risen = (x.flatten(0, 2) for x in (q, k, v, inter, t, y, risen))
        exact, _ = _merge(*_log_intra(q[i], k[i], v[i]), inter[i], t[i])  # [n, L, E]
        y = y.index_copy(0, i, torch.where(risen[i], exact, y[i])).unflatten(0, (B, H, N))
    return y, S, refs[:, :, -1].mT


def _shifted(log_q, r):
    """exp(log_q + r − u), u = max_m (log_q + r) [..., 1] detached: factors ≤ 1 for keys minus r."""
    x = log_q + r  # [..., M]
    u = x.detach().amax(-1, keepdim=True)  # [..., 1]
    return torch.exp(x - u), u


def _merge(y1, t1, y2, t2):
    """y1·exp(t1) + y2·exp(t2) as (y, t), t = max(t1, t2): online softmax's merge of two parts."""
    t = torch.maximum(t1, t2)  # [..., 1]
    return y1 * torch.exp(t1 - t) + y2 * torch.exp(t2 - t), t


def _log_intra(log_q, log_k, v):
    """The exact causal product in chunks: log_q, log_k [..., L, M], v [..., L, E] -> y [..., L, E],
    t [..., L, 1], y_i = Σ_{j≤i} Σ_m exp(log_q,im + log_k,jm − t_i) v_j. Each half (an odd chunk
    gets a zero row last) on its own, recursively, plus the second half's queries against the
    first half's keys, shifted by those keys' per-feature maximum r: all factors ≤ 1, the largest
    exactly 1; parts merge as online softmax does."""
    L = log_q.shape[-2]
    if L == 1:
        a, t = _shifted(log_q, log_k)  # [..., 1, M], [..., 1, 1]
        return a.sum(-1, keepdim=True) * v, t
    if L % 2:
        pad = (torch.cat([x, torch.zeros_like(x[..., :1, :])], -2) for x in (log_q, log_k, v))
        return tuple(x.split([L, 1], -2)[0] for x in _log_intra(*pad))
    halves = [x.unflatten(-2, (2, L // 2)) for x in (log_q, log_k, v)]  # [..., 2, L/2, ·]
    y, t = _log_intra(*halves)  # [..., 2, L/2, E], [..., 2, L/2, 1]
    # unbind, not indexing: its backward is one stack, an index's a zero-filled copy of the whole
    (_, second_q), (first_k, _), (first_v, _) = (x.unbind(-3) for x in halves)  # [..., L/2, ·]
    r = first_k.detach().amax(-2, keepdim=True)  # [..., 1, M]
    a, u = _shifted(second_q, r)  # [..., L/2, M], [..., L/2, 1]
    cross = a @ torch.exp(first_k - r).mT @ first_v  # [..., L/2, E]
    (y1, y2), (t1, t2) = y.unbind(-3), t.unbind(-3)  # [..., L/2, E], [..., L/2, 1]
    y2, t2 = _merge(y2, t2, cross, u)
    return torch.cat([y1, y2], -2), torch.cat([t1, t2], -2)


@dataclass
class LinearState:
    """Running sums after n tokens (fp32, or fp64), S None before the first; never grows.
    S = Σ_s φ_k,s [v_s, 1]ᵀ [B, H, M, dv+1] (no 1 when normalize=False); in log space relative to
    c [B, H, M, 1], each feature's largest log φ_k so far: S = Σ_s exp(log φ_k,s − c) [v_s, 1]ᵀ."""

    S: torch.Tensor | None = None
    n: int = 0
    c: torch.Tensor | None = None


def causal_linear_attention(
    phi_q, phi_k, v, chunk=64, normalize=True, state=None, log_space=False, form=None
) -> torch.Tensor:
    """Chunked causal linear attention: [B, H, T, M] x2, [B, H, T, dv] -> [B, H, T, dv], v's dtype.
    `chunked_attention` (`log_chunks` with `log_space`, on log-features; or `form`, alike) on the
    whole chunks (on CPU in parts of SEGMENT tokens, each copied contiguous once, not per matmul),
    then the rest as one chunk, the state carried, the denominator in v as a column of ones."""
    shapes = f"phi_q {tuple(phi_q.shape)}, phi_k {tuple(phi_k.shape)}, v {tuple(v.shape)}"
    fits = phi_q.dim() == 4 == v.dim() and phi_q.shape == phi_k.shape and chunk >= 1
    if not fits or v.shape[:3] != phi_q.shape[:3] or phi_q.shape[2] == 0:
        raise ValueError(f"{shapes}, chunk {chunk}: expected [B, H, T, M] x2, [B, H, T, dv] with "
                         "T >= 1, chunk >= 1")  # fmt: skip
    if log_space and not normalize:
        raise ValueError("log_space=True needs normalize=True: its shifts cancel only there")
    f = torch.promote_types(torch.promote_types(phi_q.dtype, v.dtype), torch.float32)
    (B, H, T, M), (dv, dtype) = phi_q.shape, (v.shape[-1], v.dtype)
    E, (S, c) = dv + normalize, (None, None) if state is None else (state.S, state.c)
    if S is None:
        S = v.new_zeros(B, H, M, E, dtype=f)  # [B, H, M, E]
        # the lowest finite value, not −inf: an empty state then weighs exp(−huge) = 0, never NaN
        c = v.new_full((B, H, M, 1), torch.finfo(f).min, dtype=f) if log_space else None
    got = (tuple(S.shape), None if c is None else tuple(c.shape))
    if got != ((B, H, M, E), (B, H, M, 1) if log_space else None):
        space = "log space: c [B, H, M, 1]" if log_space else "linear space: c None"
        raise ValueError(f"state S {got[0]}, c {got[1]} does not fit S [B, H, M, E] = "
                         f"{(B, H, M, E)} (E = dv + 1 when normalize=True; {space})")  # fmt: skip
    q, k, v = phi_q.to(f), phi_k.to(f), v.to(f)
    form = form or (log_chunks if log_space else chunked_attention)
    v = torch.cat([v, v.new_ones(*v.shape[:3], 1)], -1) if normalize else v  # [B, H, T, E]
    ys = []
    step = max(SEGMENT // chunk, 1) * chunk if q.is_cpu else T  # whole chunks per part
    sizes = [min(step, T - T % chunk - lo) for lo in range(0, T - T % chunk, step)]
    sizes += [T % chunk] if T % chunk else []  # the rest, one shorter chunk
    for n, *x in zip(sizes, *(t.split(sizes, 2) for t in (q, k, v))):
        y, S, c = form(*(t.contiguous().unflatten(2, (-1, min(chunk, n))) for t in x), S, c)
        ys.append(y.flatten(2, 3))  # [B, H, n, E]
    if state is not None:
        state.S, state.c, state.n = S, c, state.n + T
    y = torch.cat(ys, 2)  # [B, H, T, E]
    if normalize:  # only the denominator is clamped, and only against 0/0; one split, one backward
        num, den = y.split([dv, 1], -1)  # [B, H, T, dv], [B, H, T, 1]
        y = num * (1 / den.clamp_min(torch.finfo(y.dtype).tiny))
    return y.to(dtype)


class PRFFeatures(nn.Module):
    """Φ(x)_m = sqrt(α_m/M) exp(z_mᵀx / d^¼ − |x|²/(2√d)) per head, trainable z [H, M, d], a = log α
    [H, M]. `log_features`: log Φ. `queries`/`keys`: Φ, to form Φ(q)·Φ(k) directly (distillation):
    as z·k' − |k'|²/2 = |z|²/2 − |k'−z|²/2 (k' = k/d^¼), keys drop c_m = |z_m|²/2 (≤ sqrt(α_m/M))
    and queries add it, then drop their largest log-feature, `log_scale`: Φ(q)·Φ(k) =
    exp(log_scale)·(queries(q)[0]·keys(k)). Keys far from every z_m (|k' − z_m| ≳ 13) still
    underflow in fp32 there, never in log space. No epsilon: it would bias the estimate."""

    def __init__(self, n_head: int, head_dim: int, n_features: int, seed: int, orthogonal=True):
        super().__init__()
        if min(n_head, head_dim, n_features) < 1:
            sizes = f"{n_head}, {head_dim}, {n_features}"
            raise ValueError(f"PRFFeatures needs n_head, head_dim, n_features >= 1; got {sizes}")
        self.seed, self.orthogonal = seed, orthogonal
        gen = torch.Generator().manual_seed(seed)
        z = draw_gaussian(n_head, n_features, head_dim, gen, orthogonal)  # [H, M, d] fp64
        self.z = nn.Parameter(z.float())  # [H, M, d]
        self.a = nn.Parameter(torch.zeros(n_head, n_features))  # [H, M]

    def extra_repr(self) -> str:
        (H, M, d), o = self.z.shape, self.orthogonal
        return f"n_head={H}, n_features={M}, head_dim={d}, seed={self.seed}, orthogonal={o}"

    def log_features(self, x: torch.Tensor, name: str = "x") -> torch.Tensor:
        """log Φ(x) [B, H, T, M] in fp32 or wider, for x [B, H, T, d]."""
        H, M, d = self.z.shape
        if x.dim() != 4 or x.shape[1] != H or x.shape[3] != d:
            shape = tuple(x.shape)
            raise ValueError(f"PRFFeatures: {name} has shape {shape}; expected [B, {H}, T, {d}]")
        f = torch.promote_types(torch.promote_types(x.dtype, self.z.dtype), torch.float32)
        x, z = x.to(f) / d**0.25, self.z.to(f)  # [B, H, T, d], [H, M, d]
        scale = 0.5 * (self.a.to(f)[:, None] - math.log(M))  # [H, 1, M] log sqrt(α/M)
        return scale + x @ z.mT - 0.5 * (x * x).sum(-1, keepdim=True)  # [B, H, T, M]

    def _c(self, dtype) -> torch.Tensor:
        return 0.5 * (self.z.to(dtype) ** 2).sum(-1)[:, None]  # [H, 1, M] c_m = |z_m|²/2

    def keys(self, k: torch.Tensor) -> torch.Tensor:
        """Φ(k)·exp(−c) [B, H, T, M]: each key's own features, never above sqrt(α/M)."""
        log_phi = self.log_features(k, "k")  # [B, H, T, M]
        return torch.exp(log_phi - self._c(log_phi.dtype))

    def queries(self, q: torch.Tensor):
        """(Φ(q)·exp(c − log_scale) [B, H, T, M] with max feature 1, log_scale [B, H, T, 1])."""
        log_phi = self.log_features(q, "q")  # [B, H, T, M]
        return _shifted(log_phi, self._c(log_phi.dtype))


def draw_gaussian(n_head: int, n_rows: int, dim: int, gen, orthogonal: bool) -> torch.Tensor:
    """[n_head, n_rows, dim] rows each marginally N(0, I). Orthogonal (FAVOR+): blocks of dim
    orthogonal directions (Haar: QR with sign fix), norms drawn independently (chi)."""
    if not orthogonal:
        return torch.randn(n_head, n_rows, dim, generator=gen, dtype=torch.float64)
    square = torch.randn(n_head, -(-n_rows // dim), dim, dim, generator=gen, dtype=torch.float64)
    Q, R = torch.linalg.qr(square)  # [H, b, d, d] each: b = ⌈M/d⌉ blocks
    signs = torch.sign(torch.diagonal(R, dim1=-2, dim2=-1))[..., None, :]  # [H, b, 1, d]
    rows = (Q * signs).mT.reshape(n_head, -1, dim)[:, :n_rows]  # [H, M, d] unit rows
    lengths = torch.randn(n_head, n_rows, dim, generator=gen, dtype=torch.float64)  # [H, M, d]
    return rows * lengths.norm(dim=-1, keepdim=True)  # [H, M, d]


class CausalMixer(nn.Module):
    """A stand-in for a teacher layer: the frozen teacher's q, k, v (`base.project`, to `capture`),
    mixed from and into the cache's state, out through `base.output`. Subclasses set `chunk`, new
    tensors, `_place(base)`, and `feature_maps(q, k)` -> (phi_q, phi_k, keyword options)."""

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

    def finish(self, x, o):  # the mixed values o [B, H, T, d] as the output projection takes them
        return o

    def new_cache(self, batch: int, capacity: int) -> LinearState:  # capacity unused: never grows
        return LinearState()

    def _place(self, base: nn.Module):
        """The new tensors to base's device, in fp32 or base's wider dtype; then base, frozen."""
        p = next(base.parameters())
        self.to(p.device, torch.promote_types(p.dtype, torch.float32))
        self.base = base.requires_grad_(False)


class LinearAttention(CausalMixer):
    """Drop-in for a teacher attention layer: PRF linear attention in place of the softmax, in log
    space (no feature underflows at any norm). Trainable: features.z, features.a."""

    def __init__(self, base: nn.Module, n_features: int, seed: int, orthogonal=True, chunk=64):
        super().__init__()
        self.chunk = chunk
        self.features = PRFFeatures(base.n_head, base.head_dim, n_features, seed, orthogonal)
        self._place(base)

    def feature_maps(self, q, k):
        log_q = self.features.log_features(q, "q")  # [B, H, T, M]
        return log_q, self.features.log_features(k, "k"), {"log_space": True}


def replace_attention(model: nn.Module, dims, seed: int, orthogonal: bool = True) -> nn.Module:
    """Swap model.blocks[i].attn for LinearAttention with dims[i] features (seed + i), in place, on
    each layer's device."""
    if len(dims) != len(model.blocks):
        raise ValueError(f"replace_attention: {len(dims)} dims for {len(model.blocks)} blocks")
    for i, (block, M) in enumerate(zip(model.blocks, dims)):
        block.attn = LinearAttention(block.attn, int(M), seed + i, orthogonal)
    return model
