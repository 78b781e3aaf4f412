"""Positive-random-feature (PRF) linear attention: features, three causal forms, a drop-in module.

Vendorable: imports torch and the standard library only. The three forms
(`causal_linear_attention` chunked, `recurrent_step`, `quadratic_causal_attention`) compute
    y_t = Σ_{s≤t} γ^(t−s) (φ_q,t·φ_k,s) v_s / Σ_{s≤t} γ^(t−s) (φ_q,t·φ_k,s)   (γ = 1 without decay)
in fp32 (or fp64 for fp64 inputs), returning v's dtype; `normalize=False` drops the denominator.
`chunked_attention` is the chunked algorithm itself, plain; the rest wraps it. With
`log_space=True` the forms take log φ instead of φ (PRF features need it: `_log_chunks` says why).
"""

import math
from dataclasses import dataclass

import torch
from torch import nn

# tokens per vectorised pass on CPU: cache-sized temporaries, 1.3x faster at T = 32768
SEGMENT = 1024
# How far a key's log-feature may rise above its chunk's reference on the fast path of
# `_log_chunks`: its factor stays ≤ e^40 (an L×L product ≤ L·M·e^40, far from fp32's 3e38), and a
# term that matters (≥ e^−47 of its row's largest, 1) keeps a normal query factor ≥ e^−87.
RISE = 40.0


class PRFFeatures(nn.Module):
    """Φ(x)_m = sqrt(α_m/M) exp(z_mᵀx / d^¼ − |x|²/(2√d)) per head; trainable z [H, M, d] and
    a = log α [H, M].

    `log_features` gives log Φ exactly, for the forms' log space; no shift is needed here, the forms
    shift by running maxima over the keys seen so far, which cancel exactly (`_log_chunks`).
    `queries`/`keys` give Φ itself, for whoever forms Φ(q)·Φ(k) directly (distillation, in
    float64): z·k' − |k'|²/2 = |z|²/2 − |k'−z|²/2 with k' = k/d^¼, so keys drop the data-independent
    c_m = |z_m|²/2 (their features are then ≤ sqrt(α_m/M): no overflow, no dependence on other
    tokens) and queries add the same c_m, which cancels in every product Φ(q)·Φ(k). Each query then
    drops its own largest log-feature (detached), a per-query constant that factors out of a whole
    attention row, returned as `log_scale`: Φ(q)·Φ(k) = exp(log_scale) · (queries(q)[0] · keys(k)).
    Such a fixed shift cannot keep a key far from every z_m (|k' − z_m| ≳ 13) from underflowing in
    fp32; the log space can. No epsilon anywhere: it would bias the estimate.
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
        return (
            f"n_head={H}, n_features={M}, head_dim={d}, seed={self.seed}, "
            f"orthogonal={self.orthogonal}"
        )

    def log_features(self, x: torch.Tensor, name: str = "x") -> torch.Tensor:
        """log Φ(x) [B, H, T, M] in fp32 or wider, for x [B, H, T, d]."""
        H, M, d = self.z.shape
        if x.dim() != 4 or x.shape[1] != H or x.shape[3] != d:
            raise ValueError(
                f"PRFFeatures: {name} has shape {tuple(x.shape)}; expected [B, {H}, T, {d}]"
            )
        f = torch.promote_types(torch.promote_types(x.dtype, self.z.dtype), torch.float32)
        x, z = x.to(f) / d**0.25, self.z.to(f)  # [B, H, T, d], [H, M, d]
        return (
            0.5 * (self.a.to(f)[:, None] - math.log(M))
            + x @ z.mT
            - 0.5 * (x * x).sum(-1, keepdim=True)
        )  # [B, H, T, M]

    def _c(self, dtype) -> torch.Tensor:
        return 0.5 * (self.z.to(dtype) ** 2).sum(-1)[:, None]  # [H, 1, M] c_m = |z_m|²/2

    def keys(self, k: torch.Tensor) -> torch.Tensor:
        """Φ(k)·exp(−c) [B, H, T, M]: each key's own features, never above sqrt(α/M)."""
        log_phi = self.log_features(k, "k")  # [B, H, T, M]
        return torch.exp(log_phi - self._c(log_phi.dtype))

    def queries(self, q: torch.Tensor):
        """(Φ(q)·exp(c − log_scale) [B, H, T, M] with max feature 1, log_scale [B, H, T, 1])."""
        log_phi = self.log_features(q, "q")
        shifted = log_phi + self._c(log_phi.dtype)  # [B, H, T, M]
        log_scale = shifted.amax(-1, keepdim=True).detach()  # [B, H, T, 1]
        return torch.exp(shifted - log_scale), log_scale


def draw_gaussian(
    n_head: int, n_rows: int, dim: int, gen: torch.Generator, orthogonal: bool
) -> torch.Tensor:
    """[n_head, n_rows, dim] rows each marginally N(0, I). Orthogonal (FAVOR+): blocks of dim
    orthogonal directions (Haar, via QR with sign fix) with norms drawn independently from the chi
    distribution."""
    if not orthogonal:
        return torch.randn(n_head, n_rows, dim, generator=gen, dtype=torch.float64)
    blocks = -(-n_rows // dim)
    Q, R = torch.linalg.qr(
        torch.randn(n_head, blocks, dim, dim, generator=gen, dtype=torch.float64)
    )
    signs = torch.sign(torch.diagonal(R, dim1=-2, dim2=-1))[..., None, :]  # [H, b, 1, d]
    rows = (Q * signs).mT.reshape(n_head, blocks * dim, dim)[:, :n_rows]  # [H, M, d] unit rows
    norms = torch.randn(n_head, n_rows, dim, generator=gen, dtype=torch.float64).norm(
        dim=-1, keepdim=True
    )  # [H, M, 1]
    return rows * norms  # [H, M, d]


@dataclass
class LinearState:
    """Running sums after n tokens, fp32 (fp64 for fp64 inputs); empty (S None) until the first
    token, and it never grows with n. S = Σ_s γ^(n−1−s) φ_k,s [v_s, 1]ᵀ [B, H, M, dv+1] (the last
    column is the normaliser; none when normalize=False). With log-space features S is held
    relative to c [B, H, M, 1], each feature's largest log φ_k over the keys so far:
    S = Σ_s exp(log φ_k,s − c) [v_s, 1]ᵀ, rescaled by exp(c_old − c_new) whenever c grows, as online
    softmax does."""

    S: torch.Tensor | None = None
    n: int = 0
    c: torch.Tensor | None = None


def chunked_attention(phi_q, phi_k, v, L: int, S):
    """The chunked algorithm, plain: T = N·L tokens from the state S [B, H, M, E], no decay.

        y_t = φ_q,t · S_t,    S_t = S + Σ_{s≤t} φ_k,s v_sᵀ

    With a column of ones appended to v (causal_linear_attention does so when normalize=True) S_t
    carries s_t = s + Σ_{s≤t} φ_k,s in its last column, and y_t's last entry is the denominator
    φ_q,t·s_t. No per-token state is ever formed; per chunk of L tokens:
      1. its own sum kv = Σ_{s in chunk} φ_k,s v_sᵀ, one matmul;
      2. the state before every chunk, a prefix sum of the kvs over chunks (the one step along T);
      3. inter: each token reads the state before its chunk, φ_q,t · S_before;
      4. intra: the tokens of its own chunk up to itself, (φ_q φ_kᵀ masked causally) v, L×L.
    phi_q, phi_k [B, H, T, M], v [B, H, T, E] -> y [B, H, T, E], and the state after the last token.
    """
    B, H, T, M = phi_q.shape
    q, k, v = (x.unflatten(2, (T // L, L)) for x in (phi_q, phi_k, v))  # [B, H, N, L, ·]
    kv = k.mT @ v  # [B, H, N, M, E]
    # prefix sums over chunks as one product with a causal mask of ones: backward faster than cumsum
    N = T // L
    causal = torch.ones(N + 1, N + 1, dtype=q.dtype, device=q.device).tril_()  # [N+1, N+1]
    states = causal @ torch.cat([S[:, :, None], kv], 2).flatten(3)  # [B, H, N+1, M·E]
    before, after = states.unflatten(3, kv.shape[3:]).split([N, 1], 2)  # S before each, after last
    inter = q @ before  # [B, H, N, L, E]
    intra = (q @ k.mT).tril_() @ v  # [B, H, N, L, E]
    return (inter + intra).flatten(2, 3), after[:, :, 0]


def _decay_weights(L: int, log_g, device, dtype) -> torch.Tensor:
    """[H or 1, L, L] causal weights γ^(i−j) for j ≤ i, 0 above the diagonal."""
    i = torch.arange(L, device=device)
    lag = (i[:, None] - i[None, :]).to(dtype)  # [L, L]
    if log_g is None:
        return (lag >= 0).to(dtype)[None]
    return torch.exp((lag * log_g).masked_fill(lag < 0, -math.inf))  # [H, L, L]


def _scan(X, carry):
    """Prefix sums over chunks (dim 2) of states that shrink from one chunk to the next:
    P_n = Σ_{n'≤n} F(n', n) X_n', in log2(N) doubling steps (Hillis–Steele). carry(s) gives
    F(n − s, n) for every n ≥ s, broadcastable against X[:, :, s:]; F must telescope,
    F(n'', n') F(n', n) = F(n'', n)."""
    N, s = X.shape[2], 1
    while s < N:  # splits, not slices: a slice's backward is a zero-filled copy of all of X
        (head, later), earlier = X.split([s, N - s], 2), X.split([N - s, s], 2)[0]
        X = torch.cat([head, later + carry(s) * earlier], 2)  # [B, H, N, M, E]
        s *= 2
    return X


def _decayed_chunks(phi_q, phi_k, v, L: int, S, log_g):
    """chunked_attention with every term weighed by γ^(t−s), γ per head (log_g [H, 1, 1]), i.e. the
    state decays by γ per token. Each step changes: a chunk's own sum weighs its keys by γ^(L−1−j)
    (their age at the chunk's end); the prefix sum becomes the scan S_n = γ^L S_{n−1} + kv_{n−1}; a
    token reads the state before its chunk with γ^(i+1) (i its place in the chunk); the L×L product
    gets the weights γ^(i−j). Every weight is a power of γ ≤ 1, computed directly, never a ratio."""
    B, H, T, M = phi_q.shape
    q, k, v = (x.unflatten(2, (T // L, L)) for x in (phi_q, phi_k, v))  # [B, H, N, L, ·]
    lag = torch.arange(L, device=q.device, dtype=q.dtype)[:, None]  # [L, 1]
    kv = (k * torch.exp((L - 1 - lag) * log_g)[:, None]).mT @ v  # [B, H, N, M, E]
    states = _scan(
        torch.cat([S[:, :, None], kv], 2), lambda s: torch.exp(s * L * log_g)[:, None]
    )  # [B, H, N+1, M, E]
    before, after = states.split([T // L, 1], 2)  # [B, H, N, M, E], [B, H, 1, M, E]
    inter = (q * torch.exp((lag + 1) * log_g)[:, None]) @ before  # [B, H, N, L, E]
    weights = _decay_weights(L, log_g, q.device, q.dtype)[:, None]  # [H, 1, L, L]
    intra = (q @ k.mT * weights) @ v  # [B, H, N, L, E]
    return (inter + intra).flatten(2, 3), after[:, :, 0]


def _shifted(log_q, r):
    """exp(log_q + r − u) and u = max over features of log_q + r [..., 1] (detached): a query's
    factors against keys whose log-features were shifted by −r, largest factor 1."""
    x = log_q + r  # [..., M]
    u = x.detach().amax(-1, keepdim=True)  # [..., 1]
    return torch.exp(x - u), u


def _merge(y1, t1, y2, t2):
    """y1·exp(t1) + y2·exp(t2) as (y, t), t = max(t1, t2): online softmax's merge of two parts."""
    t = torch.maximum(t1, t2)  # [..., 1]
    return y1 * torch.exp(t1 - t) + y2 * torch.exp(t2 - t), t


def _log_intra(log_q, log_k, v):
    """The causal product inside chunks of L = 2^p tokens from log-features, never out of range:
    log_q, log_k [..., L, M], v [..., L, E] -> y [..., L, E] and t [..., L, 1] with
    y_i = Σ_{j≤i} Σ_m exp(log_q,im + log_k,jm − t_i) v_j and t_i the largest exponent of row i.

    Halve the chunk: each half on its own (recursively, both halves in one batch), plus the second
    half's queries against the first half's keys. Those keys all precede those queries, so the keys'
    own per-feature maximum r shifts both sides, keys to exp(log_k − r) ≤ 1 and queries to
    exp(log_q + r − u) ≤ 1 (u each query's largest exponent): the largest term of the pair of halves
    is exactly exp(0) = 1 and a term that underflows is below e^−87 times another one of its row.
    Parts merge as online softmax does. A single token (L = 1) is its own product, in log space.
    Cost: log2 L levels, each two exps over half the tokens and two small matmuls."""
    L = log_q.shape[-2]
    if L == 1:
        a, t = _shifted(log_q, log_k)  # [..., 1, M], [..., 1, 1]
        return a.sum(-1, keepdim=True) * v, t
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


def _log_chunks(log_q, log_k, v, L: int, S, c):
    """chunked_attention from log-features (L a power of 2), the state S relative to c [B, H, M, 1].

    PRF log-features span far more than fp32's range (e^±87) once ‖k‖ ≳ 5√d, and no one shift per
    key rescues them: a query's and a key's largest features can sit at different m, so their
    product can underflow even when each is shifted to a maximum of 1. So every product is formed
    relative to per-feature maxima that only look back:
    - the state, as in LinearState, relative to the running maximum of the keys (`refs`, before
      each chunk and after the last; the scan rescales by exp(c_old − c_new), a decay by the rise);
    - inside a chunk, `start`: that maximum before the chunk, raised to its first key. Queries take
      out their own largest exponent t against it (`_shifted`), so each row's largest term is
      exactly 1 and its denominator ≥ 1, and the chunk is chunked_attention on exp-shifted
      features, exact while no key of the chunk rises more than RISE above `start` (RISE says why).
      A row from such a key on is computed anew, exactly, by `_log_intra`. Which way a row goes
      depends on the keys up to it only, like everything else here: the output stays causal.
    Every shift cancels exactly in the normalised output (hence log space needs normalize=True),
    so the shifts are detached: the output does not depend on them, nor does its gradient.
    Returns y [B, H, T, E] with each row scaled by its own factor, the state and its c after."""
    B, H, T, M = log_q.shape
    q, k, v = (x.unflatten(2, (T // L, L)) for x in (log_q, log_k, v))  # [B, H, N, L, ·]
    top = k.detach().amax(3, keepdim=True)  # [B, H, N, 1, M] each chunk's largest key features
    refs = torch.cat([c.mT[:, :, None], top], 2).cummax(2).values  # [B, H, N+1, 1, M]
    kv = torch.exp(k - refs[:, :, 1:]).mT @ v  # [B, H, N, M, E] relative to the max after it
    states = _scan(
        torch.cat([S[:, :, None], kv], 2),
        lambda s: torch.exp(refs[:, :, :-s] - refs[:, :, s:]).mT,
    )  # [B, H, N+1, M, E] each relative to its refs
    before, after = states.split([T // L, 1], 2)  # [B, H, N, M, E], [B, H, 1, M, E]
    start = torch.maximum(refs[:, :, :-1], k.detach()[:, :, :, :1])  # [B, H, N, 1, M]
    a, t = _shifted(q, start)  # [B, H, N, L, M], [B, H, N, L, 1]
    inter = a @ (before * torch.exp(refs[:, :, :-1] - start).mT)  # [B, H, N, L, E]
    keys = torch.exp((k - start).clamp_max(RISE))  # [B, H, N, L, M] clamped only where unused
    y = inter + (a @ keys.mT).tril_() @ v  # [B, H, N, L, E]
    risen = (k.detach() - start).amax(-1, keepdim=True).cummax(3).values > RISE  # [B, H, N, L, 1]
    if risen.any():  # the exact path, for the chunks that need it
        i = risen.any(3).flatten().nonzero()[:, 0]  # chunks of B·H·N
        q, k, v, inter, t, y, risen = (x.flatten(0, 2) for x in (q, k, v, inter, t, y, risen))
        exact, _ = _merge(*_log_intra(q[i], k[i], v[i]), inter[i], t[i])  # [n, L, E]
        y = y.index_copy(0, i, torch.where(risen[i], exact, y[i])).unflatten(0, (B, H, -1))
    return y.flatten(2, 3), after[:, :, 0], refs[:, :, -1].mT


def _checked(phi_q, phi_k, v, decay, normalize: bool, state, log_space: bool):
    """Checked inputs in the compute dtype, log γ [H, 1, 1] or None, and the starting state:
    S [B, H, M, E] and, for log-space features, c [B, H, M, 1] (else None)."""
    if (
        phi_q.dim() != 4
        or phi_q.shape != phi_k.shape
        or v.dim() != 4
        or v.shape[:3] != phi_q.shape[:3]
        or phi_q.shape[2] == 0
    ):
        raise ValueError(
            f"phi_q {tuple(phi_q.shape)}, phi_k {tuple(phi_k.shape)}, v {tuple(v.shape)}: "
            f"expected phi_q, phi_k [B, H, T, M] and v [B, H, T, dv] with T >= 1"
        )
    if log_space and (decay is not None or not normalize):
        raise ValueError(
            "log_space=True needs decay=None and normalize=True: its shifts cancel only in the "
            f"normalised output; got decay={'given' if decay is not None else None}, "
            f"normalize={normalize}"
        )
    f = torch.promote_types(torch.promote_types(phi_q.dtype, v.dtype), torch.float32)
    (B, H, _, M), E = phi_q.shape, v.shape[-1] + normalize
    log_g = None
    if decay is not None:
        if decay.shape != (H,) or not bool(((decay > 0) & (decay <= 1)).all()):
            raise ValueError(
                f"decay must be [H={H}] with values in (0, 1]; got shape {tuple(decay.shape)}, "
                f"range [{decay.min().item()}, {decay.max().item()}]"
            )
        log_g = decay.to(f).log()[:, None, None]  # [H, 1, 1]
    S, c = (None, None) if state is None else (state.S, state.c)
    if S is None:
        S = v.new_zeros(B, H, M, E, dtype=f)  # [B, H, M, E]
        # the lowest finite value, not −inf: an empty state then weighs exp(−huge) = 0, never NaN
        c = v.new_full((B, H, M, 1), torch.finfo(f).min, dtype=f) if log_space else None
    c_shape = None if c is None else tuple(c.shape)
    if S.shape != (B, H, M, E) or c_shape != ((B, H, M, 1) if log_space else None):
        raise ValueError(
            f"state S {tuple(S.shape)}, c {c_shape} does not fit S [B, H, M, E] = {(B, H, M, E)} "
            f"(E = dv + 1 when normalize=True) and c {(B, H, M, 1) if log_space else None} "
            f"({'log' if log_space else 'linear'} space)"
        )
    return phi_q.to(f), phi_k.to(f), v.to(f), log_g, S, c


def _with_ones(v, normalize: bool):
    """v [B, H, T, dv] -> [B, H, T, E]: the denominator rides along as a column of ones."""
    return torch.cat([v, v.new_ones(*v.shape[:3], 1)], -1) if normalize else v


def _finish(y, dv: int, normalize: bool, dtype):
    if normalize:  # only the denominator is clamped, and only against 0/0
        num, den = y.split([dv, 1], -1)  # one split: its backward is one pass, two slices' are four
        y = num * (1 / den.clamp_min(torch.finfo(y.dtype).tiny))
    return y.to(dtype)


def _parts(T: int, L: int, whole: bool, binary: bool):
    """(tokens, chunk length) of consecutive parts of T: chunks of L in parts of about SEGMENT
    tokens (all in one part when `whole`), then the T mod L tokens left as one chunk, or with
    `binary` as chunks of its binary digits (37 = 32 + 4 + 1), for _log_intra's halving."""
    full = T - T % L
    step = max(full, L) if whole else L * max(1, SEGMENT // L)
    rest = T - full
    tails = [1 << b for b in reversed(range(rest.bit_length())) if rest >> b & 1]
    return [(min(step, full - lo), L) for lo in range(0, full, step)] + [
        (n, n) for n in (tails if binary else [rest] * (rest > 0))
    ]


def causal_linear_attention(
    phi_q,
    phi_k,
    v,
    chunk: int = 64,
    decay=None,
    normalize: bool = True,
    state: LinearState | None = None,
    log_space: bool = False,
) -> torch.Tensor:
    """Chunked causal linear attention: [B, H, T, M] x2, [B, H, T, dv] -> [B, H, T, dv], v's dtype.

    `chunked_attention` (or `_decayed_chunks` with `decay`, per-head γ [H]; or `_log_chunks` with
    `log_space`: phi_q, phi_k are then finite log-features, and the chunk is rounded down to a
    power of 2) over consecutive parts: on CPU of about SEGMENT tokens each (temporaries stay
    cache-sized), on GPU the whole sequence at once, the state carried from part to part. The parts
    are split off once: a slice per part would cost its backward a full-length zero gradient,
    quadratic in T. `state`: start from it and leave the final state in it (prefill).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1; got {chunk}")
    dv, dtype = v.shape[-1], v.dtype
    q, k, v, log_g, S, c = _checked(phi_q, phi_k, v, decay, normalize, state, log_space)
    L = 1 << (chunk.bit_length() - 1) if log_space else chunk
    parts = _parts(q.shape[2], L, q.is_cuda, log_space)
    sizes = [n for n, _ in parts]
    # Without autograd each part is written into the output as it comes (peak memory: one output);
    # under autograd such a write would cost its backward a full-length gradient (quadratic in T),
    # so there the parts are joined once at the end.
    out = None if torch.is_grad_enabled() else v.new_empty(*v.shape[:3], dv, dtype=dtype)
    ys, lo = [], 0
    for q_part, k_part, v_part, (n, L) in zip(
        q.split(sizes, 2), k.split(sizes, 2), v.split(sizes, 2), parts
    ):  # contiguous parts: one copy each, not one per matmul
        x = (q_part.contiguous(), k_part.contiguous(), _with_ones(v_part, normalize).contiguous())
        if log_space:
            y, S, c = _log_chunks(*x, L, S, c)
        elif log_g is None:
            y, S = chunked_attention(*x, L, S)
        else:
            y, S = _decayed_chunks(*x, L, S, log_g)
        y = _finish(y, dv, normalize, dtype)  # [B, H, n, dv]
        if out is None:
            ys.append(y)
        else:
            out[:, :, lo : lo + n] = y
        lo += n
    if state is not None:
        state.S, state.c, state.n = S, c, state.n + q.shape[2]
    return torch.cat(ys, 2) if out is None else out


def recurrent_step(
    state: LinearState,
    phi_q,
    phi_k,
    v,
    decay=None,
    normalize: bool = True,
    log_space: bool = False,
) -> torch.Tensor:
    """Token-by-token form for decoding: O(M·dv) per token, the state updated in place.
    [B, H, T, dv] out. In log space the state stays relative to c, each feature's running maximum,
    and each query takes out its own largest exponent, as in `_log_chunks`."""
    dv, dtype = v.shape[-1], v.dtype
    q, k, v, log_g, S, c = _checked(phi_q, phi_k, v, decay, normalize, state, log_space)
    v, ys = _with_ones(v, normalize), []
    for t in range(q.shape[2]):
        q_t, k_t, v_t = q[:, :, t, None], k[:, :, t, :, None], v[:, :, t, None]  # [B, H, ·, ·]
        if log_space:
            c_t = torch.maximum(c, k_t.detach())  # [B, H, M, 1]
            S, k_t, c = S * torch.exp(c - c_t), torch.exp(k_t - c_t), c_t
            q_t = _shifted(q_t, c.mT)[0]  # [B, H, 1, M]
        elif log_g is not None:  # without decay S is only added to: no multiply by 1 per token
            S = torch.exp(log_g) * S
        S = S + k_t * v_t  # [B, H, M, E]
        ys.append(q_t @ S)  # [B, H, 1, E]
    state.S, state.c, state.n = S, c, state.n + q.shape[2]
    return _finish(torch.cat(ys, 2), dv, normalize, dtype)


def quadratic_causal_attention(
    phi_q, phi_k, v, decay=None, normalize: bool = True, log_space: bool = False
) -> torch.Tensor:
    """Ground truth: the T×T masked product. [B, H, T, dv] out in v's dtype. In log space each
    kernel value is log(φ_q,t·φ_k,s) = logsumexp_m (log φ_q,tm + log φ_k,sm) and each row is shifted
    by its largest one: exact at any norm, at O(T²M) memory."""
    dv, dtype = v.shape[-1], v.dtype
    q, k, v, log_g, _, _ = _checked(phi_q, phi_k, v, decay, normalize, None, log_space)
    weights = _decay_weights(q.shape[2], log_g, q.device, q.dtype)  # [H or 1, T, T]
    if log_space:
        logits = torch.logsumexp(q[..., :, None, :] + k[..., None, :, :], -1)  # [B, H, T, T]
        logits = logits.masked_fill(weights == 0, -math.inf)
        A = torch.exp(logits - logits.detach().amax(-1, keepdim=True))  # [B, H, T, T]
    else:
        A = q @ k.mT * weights  # [B, H, T, T]
    return _finish(A @ _with_ones(v, normalize), dv, normalize, dtype)


class CausalMixer(nn.Module):
    """What every linear-attention stand-in for a teacher layer shares: q, k, v from the frozen
    teacher (`self.base.project`), reported to `capture`; mixed causally, by one recurrent step when
    a single token is decoded with a cache, else by the chunked form (a prefill starts from and
    leaves its state in the cache); sent out through the teacher's projection (`self.base.output`).
    Subclasses set `self.base` (frozen) and `self.chunk`, and define `feature_maps(q, k)` ->
    (phi_q, phi_k, the forms' keyword options) and, when the mixed values need more before the
    output projection, `finish(x, o)`."""

    def forward(self, x, start: int = 0, cache: LinearState | None = None, capture=None):
        if cache is not None and cache.n != start:
            raise ValueError(
                f"{type(self).__name__}: cache holds {cache.n} tokens but start={start}"
            )
        q, k, v = self.base.project(x, start)  # [B, H, T, d] each
        if capture is not None:
            capture.append((q, k, v))
        phi_q, phi_k, options = self.feature_maps(q, k)
        if cache is not None and q.shape[2] == 1:
            o = recurrent_step(cache, phi_q, phi_k, v, **options)  # [B, H, 1, d]
        else:
            o = causal_linear_attention(phi_q, phi_k, v, self.chunk, state=cache, **options)
        return self.base.output(self.finish(x, o))

    def finish(self, x, o):
        """The mixed values o [B, H, T, d] as the output projection takes them: unchanged here."""
        return o

    def new_cache(self, batch: int, capacity: int) -> LinearState:
        """An empty state; `capacity` is accepted for the teacher's interface, but the state never
        grows."""
        return LinearState()


class LinearAttention(CausalMixer):
    """Drop-in for a teacher attention layer: the teacher's q, k, v and output projection (frozen),
    with PRF linear attention in place of the softmax, in log space so that no feature underflows at
    any norm. Trainable: features.z, features.a."""

    def __init__(
        self, base: nn.Module, n_features: int, seed: int, orthogonal: bool = True, chunk: int = 64
    ):
        super().__init__()
        self.base, self.chunk = base.requires_grad_(False), chunk
        self.features = PRFFeatures(base.n_head, base.head_dim, n_features, seed, orthogonal)

    def feature_maps(self, q, k):
        log_q = self.features.log_features(q, "q")  # [B, H, T, M]
        return log_q, self.features.log_features(k, "k"), {"log_space": True}


def replace_attention(model: nn.Module, dims, seed: int, orthogonal: bool = True) -> nn.Module:
    """Swap model.blocks[i].attn for LinearAttention with dims[i] features (seed + i), in place;
    returns model."""
    if len(dims) != len(model.blocks):
        raise ValueError(
            f"replace_attention: {len(dims)} feature dims for {len(model.blocks)} blocks"
        )
    for i, (block, M) in enumerate(zip(model.blocks, dims)):
        block.attn = LinearAttention(block.attn, int(M), seed + i, orthogonal)
    return model
