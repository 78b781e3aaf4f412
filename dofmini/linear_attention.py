"""Positive-random-feature (PRF) linear attention, in the order it is derived.

Vendorable: torch and the standard library only. Causal linear attention (the paper's Eq. 2) is
    y_t = Σ_{s≤t} (φ_q,t·φ_k,s) v_s / Σ_{s≤t} (φ_q,t·φ_k,s) = φ_q,t·S_t / φ_q,t·s_t,
    S_t = Σ_{s≤t} φ_k,s v_sᵀ [M, dv],   s_t = Σ_{s≤t} φ_k,s [M]
(normalize=False: no denominator; with a column of ones in v, S carries s_t). Read in order:
`recurrent_step`, Eq. 2 one token at a time (a decoding step); `chunked_attention`, the same sums
chunk by chunk in four steps; `log_chunks`, the same four steps relative to running maxima, as
PRF log-features need; `causal_linear_attention`, which runs one of them on any T in fp32 (fp64
for fp64 inputs); then the features and the attention module."""

import math
from dataclasses import dataclass

import torch
from torch import nn


def recurrent_step(q, k, v, S, c=None):
    """Eq. 2 for one token: q, k [B, H, 1, M], v [B, H, 1, E], the state S [B, H, M, E] before it
    -> y [B, H, 1, E], S, c; O(M·E). In log space (c [B, H, M, 1]: S held relative to it, as in
    `log_chunks`), c rises to the key where the key exceeds it, S shrinks by exp(c_old − c_new)
    ≤ 1 and the query is read over its largest term. Without autograd, S is updated in place: a
    decoding step allocates only y and M-sized shifts."""
    in_place = not torch.is_grad_enabled()
    key = k.mT  # [B, H, M, 1]
    if c is not None:
        new_c = torch.maximum(c, key.detach())  # [B, H, M, 1]
        shrink = torch.exp(c - new_c)  # [B, H, M, 1] each ≤ 1
        S = S.mul_(shrink) if in_place else S * shrink
        key = torch.exp(key - new_c)  # [B, H, M, 1] each ≤ 1
        q = unit_features(q + new_c.mT)[0]  # [B, H, 1, M]
        c = new_c
    S = S.addcmul_(key, v) if in_place else S.addcmul(key, v)
    return q @ S, S, c  # y [B, H, 1, E]


def chunked_attention(q, k, v, S, c=None):
    """Eq. 2 on N chunks of L tokens, q, k [B, H, N, L, M], v [B, H, N, L, E], from the state S
    [B, H, M, E] before them. Returns y [B, H, N, L, E], the state after, c (a form's)."""
    # 1. each chunk's own sum Σ_s φ_k,s v_sᵀ, one matmul
    kv = k.mT @ v  # [B, H, N, M, E]
    # 2. the state before each chunk: a running sum, O(N·M·E)
    before, S = chunk_states(S, kv)  # [B, H, N, M, E]
    # 3. each token reads the state before its chunk
    inter = q @ before  # [B, H, N, L, E]
    # 4. and its own chunk's tokens up to itself, L×L
    return ((q @ k.mT).tril_() @ v).add_(inter), S, c


def chunk_states(S, kv, A=None):
    """Step 2: the states before each chunk [B, H, N, M, E] and after the last [B, H, M, E];
    with A [B, H, N+1, M, 1], a scan that decays chunk n' by exp(A_n − A_n')."""
    if kv.shape[2] == 1:  # one chunk: its state before is S
        before = S[:, :, None]
        if A is not None:
            S = torch.exp(A.select(-3, 1) - A.select(-3, 0)) * S
        return before, S + kv[:, :, 0]
    X = torch.cat([S[:, :, None], kv], 2)  # [B, H, N+1, M, E]
    P = X.cumsum(2) if A is None else scan_chunks(X, A)
    before, after = P.split([kv.shape[2], 1], 2)
    return before, after[:, :, 0]


def scan_chunks(X, A):
    """P_n = Σ_{n'≤n} exp(A_n − A_n') X_n' along dim −3, A non-increasing there, each factor
    ≤ 1 formed directly (exp(A_n)·exp(−A_n') would overflow). Pairs merge (x1 + exp(a1 − a0)
    x0, A at the second), the half-length scan gives every second P, one step the rest: O(N)."""
    N = X.shape[-3]
    if N == 1:
        return X
    if N % 2:  # the first chunk reaches each later one through exp(A − A_0)
        x, X = X.split([1, N - 1], -3)  # [..., 1 | N − 1, M, E]
        a, A = A.split([1, N - 1], -3)
        return torch.cat([x, scan_chunks(X, A) + torch.exp(A - a) * x], -3)
    x0, x1 = X.unflatten(-3, (N // 2, 2)).unbind(-3)  # [..., N/2, M, E]
    a0, a1 = A.unflatten(-3, (N // 2, 2)).unbind(-3)
    odd = scan_chunks(x1 + torch.exp(a1 - a0) * x0, a1)  # P at chunks 1, 3, ...
    lead = odd[..., :-1, :, :]  # [..., N/2 − 1, M, E]
    decay = torch.exp(a0[..., 1:, :, :] - a1[..., :-1, :, :])
    later = x0[..., 1:, :, :] + decay * lead  # P at chunks 2, 4, ...
    even = torch.cat([x0[..., :1, :, :], later], -3)
    return torch.stack([even, odd], -3).flatten(-4, -3)


# How far a key's log-feature may rise above `start` in `log_chunks`: its factor stays ≤ e^40
# (an L×L product ≤ L·M·e^40 < 3e38); a term ≥ e^−47 of its row's largest keeps a query
# factor ≥ e^−87.
RISE = 40.0


def log_chunks(q, k, v, S, c):
    """`chunked_attention` on log-features q, k, the state S held relative to c [B, H, M, 1].
    PRF log-features leave fp32's range (e^±87) once ‖k‖ ≳ 5√d, and no one shift per key
    rescues them (a query's and a key's largest features can sit at different m). So the same
    four steps run relative to running maxima. Guarantee: no feature underflows at any norm;
    every row's largest term is exactly 1; the shifts only look back (bit-exact causality) and
    cancel in the normalised output, so they are detached. Mechanics: steps 1-2 relative to
    the keys' running maximum per feature (`refs`; the scan rescales by exp(c_old − c_new), as
    online softmax does); steps 3-4 relative to `start`, that maximum raised to the chunk's
    first key, each query over its largest term. Exact while no key rises over RISE above
    `start`; rows from such a key on take `_log_intra`'s exact product, in the chunks that
    `_reads_back` lets it pick. -> y [B, H, N, L, E] (rows scaled), S, c."""
    key = k.detach()
    top = key.amax(3, keepdim=True)  # [B, H, N, 1, M] each chunk's largest
    firsts = torch.cat([c.mT[:, :, None], top], 2)  # [B, H, N+1, 1, M]
    refs = firsts.cummax(2).values
    ref_before = refs[:, :, :-1]  # [B, H, N, 1, M]
    # 1. relative to the running maximum after the chunk
    kv = torch.exp(k - refs[:, :, 1:]).mT @ v  # [B, H, N, M, E]
    # 2. each state relative to its own maximum: the scan
    before, S = chunk_states(S, kv, -refs.mT)
    # 3. queries over their largest term against `start`
    start = torch.maximum(ref_before, key[:, :, :, :1])
    a, t = unit_features(q + start)  # [B, H, N, L, M]
    rescale = torch.exp(ref_before - start).mT  # [.., M, 1]
    inter = a @ (before * rescale)  # [B, H, N, L, E]
    # 4. keys against `start`, clamped only where unused
    keys = (k - start).clamp_max_(RISE).exp_()  # [.., L, M]
    y = ((a @ keys.mT).tril_() @ v).add_(inter)
    # the keys past RISE: their chunks' rows, exactly
    risen = (top - start).amax(-1) > RISE  # [B, H, N, 1]
    if q.shape[3] > 1 and (not _reads_back(q) or risen.any()):
        y = _exact_rows(q, k, v, inter, t, y, start, risen)
    return y, S, refs[:, :, -1].mT


def _exact_rows(q, k, v, inter, t, y, start, risen):
    """y with each row from a risen key on replaced by `_log_intra`'s exact product merged with
    `inter`: on the host only in the chunks that have one; on a device in every chunk."""
    B, H, N = q.shape[:3]
    need = risen.flatten()  # [B·H·N]
    if _reads_back(q):
        i = need.nonzero()[:, 0]
    else:
        i = torch.arange(len(need), device=need.device)
    flat = [x.flatten(0, 2)[i] for x in (q, k, v, inter, t, y, start)]
    q, k, v, inter, t, fast, start = flat  # [n, L, ·]
    rows = (k.detach() - start).amax(-1, keepdim=True)  # [n, L, 1]
    rows = rows.cummax(1).values > RISE  # from a risen key on
    exact, _ = _merge(*_log_intra(q, k, v), inter, t)
    y = y.flatten(0, 2).index_copy(0, i, torch.where(rows, exact, fast))
    return y.unflatten(0, (B, H, N))


def unit_features(log_phi):
    """The one shift of features: (exp(log_phi − u) [..., M], u [..., 1]), u = max_m log_phi
    detached. Every entry ≤ 1, the largest exactly 1, so that Φ·Φ' = exp(u + u')·(unit·unit')
    forms no overflow in fp32 and no row loses all its features (a fixed shift per feature,
    |z_m|²/2, loses every feature of a key with |k/d^¼ − z_m| ≳ 14 for all m). The attention
    reads queries (against their keys' maxima) and the distillation losses both sides with it.
    A product is 0 only where unit·unit' underflows (features e^87 apart)."""
    u = log_phi.detach().amax(-1, keepdim=True)  # [..., 1]
    return (log_phi - u).exp_(), u


def _merge(y1, t1, y2, t2):
    """y1·exp(t1) + y2·exp(t2) as (y, t), t = max(t1, t2): online softmax's merge."""
    t = torch.maximum(t1, t2)  # [..., 1]
    return y1 * torch.exp(t1 - t) + y2 * torch.exp(t2 - t), t


def _log_intra(log_q, log_k, v):
    """The exact causal product in chunks: log_q, log_k [..., L, M], v [..., L, E] -> y [..., L,
    E], t [..., L, 1], y_i = Σ_{j≤i} Σ_m exp(log_q,im + log_k,jm − t_i) v_j. Each half (an odd
    chunk gets a zero row last) on its own, recursively, plus the second half's queries against
    the first half's keys, shifted by those keys' per-feature maximum r: all factors ≤ 1, the
    largest exactly 1; parts merge as online softmax does."""
    L = log_q.shape[-2]
    if L == 1:
        a, t = unit_features(log_q + log_k)  # [..., 1, M], [..., 1, 1]
        return a.sum(-1, keepdim=True) * v, t
    if L % 2:
        pad = [torch.cat([x, torch.zeros_like(x[..., :1, :])], -2) for x in (log_q, log_k, v)]
        return tuple(x[..., :L, :] for x in _log_intra(*pad))
    halves = [x.unflatten(-2, (2, L // 2)) for x in (log_q, log_k, v)]  # [..., 2, L/2, ·]
    y, t = _log_intra(*halves)  # [..., 2, L/2, E], [..., 2, L/2, 1]
    # unbind, not indexing: its backward is one stack, an index's a zero-filled copy
    (_, second_q), (first_k, _), (first_v, _) = (x.unbind(-3) for x in halves)
    r = first_k.detach().amax(-2, keepdim=True)  # [..., 1, M]
    a, u = unit_features(second_q + r)  # [..., L/2, M], [..., L/2, 1]
    cross = a @ torch.exp(first_k - r).mT @ first_v  # [..., L/2, E]
    y1, y2 = y.unbind(-3)  # [..., L/2, E]
    t1, t2 = t.unbind(-3)  # [..., L/2, 1]
    y2, t2 = _merge(y2, t2, cross, u)
    return torch.cat([y1, y2], -2), torch.cat([t1, t2], -2)


# Tokens per part on the host: cache-sized temporaries (see `_reads_back`).
SEGMENT = 1024


def _reads_back(x) -> bool:
    """The one device choice. On CPU a value read back to the host is free, so the chunked form
    runs in parts of SEGMENT tokens (whole-sequence temporaries outgrow the cache) and the exact
    path takes only the chunks that need it. On a device a read-back stalls its queue: the
    whole sequence in one call, and every chunk through both paths (torch.where)."""
    return x.is_cpu


@dataclass
class LinearState:
    """Running sums after n tokens (fp32, or fp64), S None before the first; never grows.
    S = Σ_s φ_k,s [v_s, 1]ᵀ [B, H, M, dv+1] (no 1 when normalize=False); in log space
    relative to c [B, H, M, 1], each feature's largest log φ_k so far:
    S = Σ_s exp(log φ_k,s − c) [v_s, 1]ᵀ."""

    S: torch.Tensor | None = None
    n: int = 0
    c: torch.Tensor | None = None


def causal_linear_attention(
    phi_q, phi_k, v, chunk=64, normalize=True, state=None, log_space=False, form=None
) -> torch.Tensor:
    """Causal linear attention: [B, H, T, M] x2, [B, H, T, dv] -> [B, H, T, dv], v's dtype. One
    token is a `recurrent_step`; more run `chunked_attention` (`log_chunks` with `log_space`,
    on log-features; or `form`, alike) on the whole chunks (in parts on the host, each copied
    contiguous once), then the rest as one chunk, the state carried."""
    fits = phi_q.dim() == 4 == v.dim() and phi_q.shape == phi_k.shape
    if not fits or v.shape[:3] != phi_q.shape[:3] or phi_q.shape[2] == 0 or chunk < 1:
        shapes = [tuple(x.shape) for x in (phi_q, phi_k, v)]
        raise ValueError("phi_q {}, phi_k {}, v {}".format(*shapes) + f", chunk {chunk}: expected "
                         "[B, H, T, M] x2, [B, H, T, dv] with T >= 1, chunk >= 1")  # fmt: skip
    if log_space and not normalize:
        raise ValueError("log_space=True needs normalize=True: its shifts cancel only there")
    f = torch.promote_types(torch.promote_types(phi_q.dtype, v.dtype), torch.float32)
    S, c = _initial_state(state, phi_q, v.shape[-1] + normalize, f, log_space)
    q, k, x = phi_q.to(f), phi_k.to(f), v.to(f)
    if normalize:
        x = torch.cat([x, x.new_ones(*x.shape[:3], 1)], -1)  # [B, H, T, E]
    T = q.shape[2]
    if T == 1 and form is None:
        y, S, c = recurrent_step(q, k, x, S, c)
    else:
        form = form or (log_chunks if log_space else chunked_attention)
        y, S, c = _in_parts(q, k, x, S, c, chunk, form)
    if state is not None:
        state.S, state.c, state.n = S, c, state.n + T
    if normalize:  # only the denominator is clamped, only against 0/0; one split, one backward
        num, den = y.split_with_sizes([v.shape[-1], 1], -1)  # [B, H, T, dv | 1]
        y = num * (1 / den.clamp_min(torch.finfo(f).tiny))
    return y.to(v.dtype)


def _initial_state(state, q, E, f, log_space):
    """(S [B, H, M, E], c [B, H, M, 1] in log space, else None) from state, checked, or empty."""
    B, H, _, M = q.shape
    if state is None or state.S is None:
        S = q.new_zeros(B, H, M, E, dtype=f)
        # the lowest finite value, not −inf: an empty state weighs exp(−huge) = 0, never NaN
        low = torch.finfo(f).min
        return S, q.new_full((B, H, M, 1), low, dtype=f) if log_space else None
    want_c = (B, H, M, 1) if log_space else None
    got_c = None if state.c is None else tuple(state.c.shape)
    if tuple(state.S.shape) != (B, H, M, E) or got_c != want_c:
        space = "log space: c [B, H, M, 1]" if log_space else "linear space: c None"
        raise ValueError(f"state S {tuple(state.S.shape)}, c {got_c} does not fit S [B, H, M, E] = "
                         f"{(B, H, M, E)} (E = dv + 1 when normalize=True; {space})")  # fmt: skip
    return state.S, state.c


def _in_parts(q, k, v, S, c, chunk, form):
    """The chunked form over [B, H, T, ·] part by part (`_reads_back`), each a whole number of
    chunks, then the T % chunk tokens left as one shorter chunk; the state carried."""
    T = q.shape[2]
    whole = T - T % chunk
    step = max(SEGMENT // chunk, 1) * chunk if _reads_back(q) else max(whole, 1)
    sizes = [min(step, whole - lo) for lo in range(0, whole, step)]
    sizes += [T % chunk] if T % chunk else []
    ys = []
    for n, *x in zip(sizes, *(t.split(sizes, 2) for t in (q, k, v))):
        x = [t.contiguous().unflatten(2, (-1, min(chunk, n))) for t in x]
        y, S, c = form(*x, S, c)
        ys.append(y.flatten(2, 3))  # [B, H, n, E]
    return torch.cat(ys, 2), S, c


class PRFFeatures(nn.Module):
    """Φ(x)_m = sqrt(α_m/M) exp(z_mᵀx / d^¼ − |x|²/(2√d)) per head, trainable z [H, M, d], a = log
    α [H, M]. `log_features`: log Φ, which `log_chunks` and `unit_features` shift so that no
    feature underflows at any norm. No epsilon: it would bias the estimate."""

    def __init__(self, n_head: int, head_dim: int, n_features: int, seed: int, orthogonal=True):
        super().__init__()
        if min(n_head, head_dim, n_features) < 1:
            sizes = f"{n_head}, {head_dim}, {n_features}"
            raise ValueError(f"PRFFeatures needs n_head, head_dim, n_features >= 1; got {sizes}")
        self.seed = seed
        self.orthogonal = orthogonal
        gen = torch.Generator().manual_seed(seed)
        z = draw_gaussian(n_head, n_features, head_dim, gen, orthogonal)  # [H, M, d] fp64
        self.z = nn.Parameter(z.float())  # [H, M, d]
        self.a = nn.Parameter(torch.zeros(n_head, n_features))  # [H, M]

    def extra_repr(self) -> str:
        H, M, d = self.z.shape
        o = self.orthogonal
        return f"n_head={H}, n_features={M}, head_dim={d}, seed={self.seed}, orthogonal={o}"

    def log_features(self, x: torch.Tensor, name: str = "x") -> torch.Tensor:
        """log Φ(x) [B, H, T, M] in fp32 or wider, for x [B, H, T, d]."""
        H, M, d = self.z.shape
        if x.dim() != 4 or x.shape[1] != H or x.shape[3] != d:
            shape = tuple(x.shape)
            raise ValueError(f"PRFFeatures: {name} has shape {shape}; expected [B, {H}, T, {d}]")
        f = torch.promote_types(torch.promote_types(x.dtype, self.z.dtype), torch.float32)
        x = x.to(f) / d**0.25  # [B, H, T, d]
        scale = 0.5 * (self.a.to(f)[:, None] - math.log(M))  # [H, 1, M] log sqrt(α/M)
        return scale + x @ self.z.to(f).mT - 0.5 * (x * x).sum(-1, keepdim=True)


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
