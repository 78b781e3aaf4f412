"""Positive-random-feature (PRF) linear attention: the chunked causal algorithm, features, a module.

Vendorable: imports torch and the standard library only. Causal linear attention computes
    y_t = Σ_{s≤t} (φ_q,t·φ_k,s) v_s / Σ_{s≤t} (φ_q,t·φ_k,s) = φ_q,t·S_t / φ_q,t·s_t,
    S_t = Σ_{s≤t} φ_k,s v_sᵀ [M, dv],   s_t = Σ_{s≤t} φ_k,s [M]
(`normalize=False` drops the denominator). `chunked_attention` below is the algorithm itself;
`causal_linear_attention` runs it on any T (and `recurrent_step`, one token at a time, for
decoding); `quadratic_causal_attention` is the T×T ground truth. With `log_space=True` the
forms take log φ instead of φ, as PRF features need (`log_chunks` says why). Other chunk forms
plug in through `form` (dijiang.py's decay). All compute in fp32 (fp64 for fp64 inputs) and
return v's dtype.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn


def chunked_attention(q, k, v, S, c=None):
    """The chunked algorithm: N chunks of L tokens, q, k [B, H, N, L, M], v [B, H, N, L, E], from
    the state S [B, H, M, E] of the tokens before. With a column of ones appended to v, S carries
    s_t in its last column and y_t's last entry is the denominator φ_q,t·s_t. Per chunk:
      1. its own sum kv = Σ_{s in chunk} φ_k,s v_sᵀ, one matmul;
      2. the state before every chunk: a cumulative sum of the kvs over chunks, O(N·M·E);
      3. inter: each token reads the state before its chunk, φ_q,t · S_before;
      4. intra: the tokens of its own chunk up to itself, (φ_q φ_kᵀ masked causally) v, L×L.
    Returns y [B, H, N, L, E], the state after the last chunk, and c (unused here: a form's
    signature, see `log_chunks`)."""
    kv = k.mT @ v  # [B, H, N, M, E]
    before, S = chunk_states(S, kv)  # [B, H, N, M, E], [B, H, M, E]
    return q @ before + (q @ k.mT).tril_() @ v, S, c


def chunk_states(S, kv, A=None):
    """Step 2: the state before each chunk [B, H, N, M, E] and after the last [B, H, M, E], from S
    and the chunks' own sums kv [B, H, N, M, E]; with A (see `scan_chunks`) the states shrink from
    chunk to chunk."""
    X = torch.cat([S[:, :, None], kv], 2)  # [B, H, N+1, M, E]
    before, after = (X.cumsum(2) if A is None else scan_chunks(X, A)).split([kv.shape[2], 1], 2)
    return before, after[:, :, 0]


def scan_chunks(X, A):
    """P_n = Σ_{n'≤n} exp(A_n − A_n') X_n' along dim −3 (N chunks), A non-increasing along it and
    broadcastable against X: a cumulative sum whose terms shrink as they age, every factor ≤ 1 and
    formed directly, never as a ratio exp(A_n)·exp(−A_n') that would overflow. Pairs of chunks merge
    into one (x1 + exp(a1 − a0) x0, A at the second), the half-length scan gives P at every second
    chunk, and one step fills in the others: O(N) work, log2 N levels."""
    N = X.shape[-3]
    if N == 1:
        return X
    if N % 2:  # one chunk of zeros after the last, at the last's A: it changes no earlier P
        P = scan_chunks(torch.cat([X, torch.zeros_like(X.narrow(-3, 0, 1))], -3),
                        torch.cat([A, A.narrow(-3, N - 1, 1)], -3))  # fmt: skip
        return P.split([N, 1], -3)[0]
    (x0, x1), (a0, a1) = (t.unflatten(-3, (N // 2, 2)).unbind(-3) for t in (X, A))  # [..., N/2, ·]
    odd = scan_chunks(x1 + torch.exp(a1 - a0) * x0, a1)  # [..., N/2, M, E] P at chunks 1, 3, ...
    lead, prev = odd.split([N // 2 - 1, 1], -3)[0], a1.split([N // 2 - 1, 1], -3)[0]
    first, rest = x0.split([1, N // 2 - 1], -3)  # chunk 0, then chunks 2, 4, ...
    later = torch.exp(a0.split([1, N // 2 - 1], -3)[1] - prev) * lead  # [..., N/2 − 1, M, E]
    even = torch.cat([first, rest + later], -3)  # [..., N/2, M, E]
    return torch.stack([even, odd], -3).flatten(-4, -3)  # [..., N, M, E]


# How far a key's log-feature may rise above its chunk's reference on the fast path of
# `log_chunks`: its factor stays ≤ e^40 (an L×L product ≤ L·M·e^40, far from fp32's 3e38), and a
# term that matters (≥ e^−47 of its row's largest, 1) keeps a normal query factor ≥ e^−87.
RISE = 40.0


def log_chunks(q, k, v, S, c):
    """`chunked_attention` from log-features q, k, the state S held relative to c [B, H, M, 1].

    PRF log-features span far more than fp32's range (e^±87) once ‖k‖ ≳ 5√d, and no one shift per
    key rescues them: a query's and a key's largest features can sit at different m, so their
    product can underflow even when each is shifted to a maximum of 1. So the same four steps run
    relative to per-feature maxima that only look back:
    1-2. each chunk's sum and the states, relative to the running maximum of the keys (`refs`,
      before each chunk and after the last): the scan rescales by exp(c_old − c_new), as online
      softmax does, a decay by the rise;
    3-4. relative to `start`: that maximum before the chunk, raised to its first key. Queries take
      out their own largest exponent t against it (`_shifted`), so each row's largest term is
      exactly 1 and its denominator ≥ 1; exact while no key of the chunk rises more than RISE above
      `start`. A row from such a key on takes `_log_intra`'s exact product instead, chosen on the
      device (both computed) except on CPU, where reading back whether any row needs it is free.
    Which way a row goes depends on the keys up to it only: the output stays causal. Every shift
    cancels in the normalised output (log space needs normalize=True), so the shifts are detached.
    Returns y [B, H, N, L, E] with each row scaled by its own factor, the state and its c after."""
    N, L = q.shape[2:4]
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
    if L > 1 and (q.device.type != "cpu" or risen.any()):  # a chunk's first key never rises
        exact, _ = _merge(*_log_intra(q, k, v), inter, t)  # [B, H, N, L, E]
        y = torch.where(risen, exact, y)
    return y, S, refs[:, :, -1].mT


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
    """The causal product inside chunks of L tokens from log-features, never out of range:
    log_q, log_k [..., L, M], v [..., L, E] -> y [..., L, E] and t [..., L, 1] with
    y_i = Σ_{j≤i} Σ_m exp(log_q,im + log_k,jm − t_i) v_j and t_i the largest exponent of row i.

    Halve the chunk (an odd one first gets a zero row after its last, which no real row sees): each
    half on its own (recursively, both halves in one batch), plus the second half's queries against
    the first half's keys. Those keys all precede those queries, so the keys' own per-feature
    maximum r shifts both sides, keys to exp(log_k − r) ≤ 1 and queries to exp(log_q + r − u) ≤ 1:
    the largest term of the pair is exactly 1, and a term that underflows is below e^−87 times
    another one of its row. Parts merge as online softmax does. Cost: log2 L levels."""
    L = log_q.shape[-2]
    if L == 1:
        a, t = _shifted(log_q, log_k)  # [..., 1, M], [..., 1, 1]
        return a.sum(-1, keepdim=True) * v, t
    if L % 2:
        pad = (torch.cat([x, torch.zeros_like(x[..., :1, :])], -2) for x in (log_q, log_k, v))
        return (x.split([L, 1], -2)[0] for x in _log_intra(*pad))
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
    """Running sums after n tokens, fp32 (fp64 for fp64 inputs); empty (S None) until the first
    token, and it never grows with n. S = Σ_s φ_k,s [v_s, 1]ᵀ [B, H, M, dv+1] (the last column is
    the normaliser; none when normalize=False). With log-space features S is held relative to
    c [B, H, M, 1], each feature's largest log φ_k over the keys so far:
    S = Σ_s exp(log φ_k,s − c) [v_s, 1]ᵀ. A decaying form (dijiang.py) decays S as it goes."""

    S: torch.Tensor | None = None
    n: int = 0
    c: torch.Tensor | None = None


def _checked(phi_q, phi_k, v, normalize: bool, state, log_space: bool):
    """Checked inputs in the compute dtype and the starting state: S [B, H, M, E] and, for
    log-space features, c [B, H, M, 1] (else None)."""
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
    if log_space and not normalize:
        raise ValueError("log_space=True needs normalize=True: its shifts cancel only there")
    f = torch.promote_types(torch.promote_types(phi_q.dtype, v.dtype), torch.float32)
    (B, H, _, M), E = phi_q.shape, v.shape[-1] + normalize
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
    return phi_q.to(f), phi_k.to(f), v.to(f), S, c


def _with_ones(v, normalize: bool):
    """v [B, H, T, dv] -> [B, H, T, E]: the denominator rides along as a column of ones."""
    return torch.cat([v, v.new_ones(*v.shape[:3], 1)], -1) if normalize else v


def _finish(y, dv: int, normalize: bool, dtype):
    if normalize:  # only the denominator is clamped, and only against 0/0
        num, den = y.split([dv, 1], -1)  # one split: its backward is one pass, two slices' are four
        y = num * (1 / den.clamp_min(torch.finfo(y.dtype).tiny))
    return y.to(dtype)


def causal_linear_attention(
    phi_q,
    phi_k,
    v,
    chunk: int = 64,
    normalize: bool = True,
    state: LinearState | None = None,
    log_space: bool = False,
    form=None,
) -> torch.Tensor:
    """Chunked causal linear attention: [B, H, T, M] x2, [B, H, T, dv] -> [B, H, T, dv], v's dtype.

    The whole sequence at once: `chunked_attention` (`log_chunks` with `log_space`: phi_q, phi_k
    are then finite log-features; or `form`, a function of the same signature) on the T − T mod
    chunk tokens that fill whole chunks, then on the rest as one shorter chunk, the state carried.
    `state`: start from it and leave the final state in it (prefill, decoding)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1; got {chunk}")
    dv, dtype = v.shape[-1], v.dtype
    q, k, v, S, c = _checked(phi_q, phi_k, v, normalize, state, log_space)
    form = form or (log_chunks if log_space else chunked_attention)
    T = q.shape[2]
    sizes = [n for n in (T - T % chunk, T % chunk) if n]
    ys = []
    for n, *x in zip(sizes, *(t.split(sizes, 2) for t in (q, k, _with_ones(v, normalize)))):
        y, S, c = form(*(t.unflatten(2, (-1, min(chunk, n))) for t in x), S, c)
        ys.append(y.flatten(2, 3))  # [B, H, n, E]
    if state is not None:
        state.S, state.c, state.n = S, c, state.n + T
    return _finish(torch.cat(ys, 2), dv, normalize, dtype)


def recurrent_step(
    state: LinearState, phi_q, phi_k, v, normalize: bool = True, log_space: bool = False, form=None
) -> torch.Tensor:
    """Token by token, for decoding: the chunked form on chunks of one token, O(M·dv) each, the
    state updated in place. [B, H, T, dv] out."""
    parts = zip(*(x.split(1, 2) for x in (phi_q, phi_k, v)))
    return torch.cat(
        [causal_linear_attention(*x, 1, normalize, state, log_space, form) for x in parts], 2
    )


def quadratic_causal_attention(
    phi_q, phi_k, v, normalize: bool = True, log_space: bool = False
) -> torch.Tensor:
    """Ground truth: the T×T masked product. [B, H, T, dv] out in v's dtype. In log space each
    kernel value is log(φ_q,t·φ_k,s) = logsumexp_m (log φ_q,tm + log φ_k,sm) and each row is shifted
    by its largest one: exact at any norm, at O(T²M) memory."""
    dv, dtype = v.shape[-1], v.dtype
    q, k, v, _, _ = _checked(phi_q, phi_k, v, normalize, None, log_space)
    if log_space:
        later = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device).triu_(1)
        logits = torch.logsumexp(q[..., :, None, :] + k[..., None, :, :], -1)  # [B, H, T, T]
        logits = logits.masked_fill(later, -math.inf)
        A = torch.exp(logits - logits.detach().amax(-1, keepdim=True))  # [B, H, T, T]
    else:
        A = (q @ k.mT).tril_()  # [B, H, T, T]
    return _finish(A @ _with_ones(v, normalize), dv, normalize, dtype)


class PRFFeatures(nn.Module):
    """Φ(x)_m = sqrt(α_m/M) exp(z_mᵀx / d^¼ − |x|²/(2√d)) per head; trainable z [H, M, d] and
    a = log α [H, M].

    `log_features` gives log Φ exactly, for the forms' log space; no shift is needed here, the forms
    shift by running maxima over the keys seen so far, which cancel exactly (`log_chunks`).
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
        log_phi = self.log_features(q, "q")  # [B, H, T, M]
        return _shifted(log_phi, self._c(log_phi.dtype))


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


class CausalMixer(nn.Module):
    """What every linear-attention stand-in for a teacher layer shares: q, k, v from the frozen
    teacher (`self.base.project`), reported to `capture`; mixed causally by the chunked form (a
    prefill or a decoded token starts from and leaves its state in the cache); sent out through the
    teacher's projection (`self.base.output`). Subclasses set `self.base` (frozen) and `self.chunk`,
    and define `feature_maps(q, k)` -> (phi_q, phi_k, causal_linear_attention's keyword options:
    normalize, log_space, form) and, when the mixed values need more before the output projection,
    `finish(x, o)`. Their new tensors go where the teacher layer's are (`_place`)."""

    def forward(self, x, start: int = 0, cache: LinearState | None = None, capture=None):
        if cache is not None and cache.n != start:
            raise ValueError(
                f"{type(self).__name__}: cache holds {cache.n} tokens but start={start}"
            )
        q, k, v = self.base.project(x, start)  # [B, H, T, d] each
        if capture is not None:
            capture.append((q, k, v))
        phi_q, phi_k, options = self.feature_maps(q, k)
        o = causal_linear_attention(phi_q, phi_k, v, self.chunk, state=cache, **options)
        return self.base.output(self.finish(x, o))

    def finish(self, x, o):
        """The mixed values o [B, H, T, d] as the output projection takes them: unchanged here."""
        return o

    def new_cache(self, batch: int, capacity: int) -> LinearState:
        """An empty state; `capacity` is accepted for the teacher's interface, but the state never
        grows."""
        return LinearState()

    def _place(self, base: nn.Module):
        """Moves the new tensors, set so far, to base's device, in fp32 or base's wider dtype; then
        holds base (frozen)."""
        p = next(base.parameters())
        self.to(p.device, torch.promote_types(p.dtype, torch.float32))
        self.base = base.requires_grad_(False)


class LinearAttention(CausalMixer):
    """Drop-in for a teacher attention layer: the teacher's q, k, v and output projection (frozen),
    with PRF linear attention in place of the softmax, in log space so that no feature underflows at
    any norm. Trainable: features.z, features.a, on the teacher layer's device."""

    def __init__(
        self, base: nn.Module, n_features: int, seed: int, orthogonal: bool = True, chunk: int = 64
    ):
        super().__init__()
        self.chunk = chunk
        self.features = PRFFeatures(base.n_head, base.head_dim, n_features, seed, orthogonal)
        self._place(base)

    def feature_maps(self, q, k):
        log_q = self.features.log_features(q, "q")  # [B, H, T, M]
        return log_q, self.features.log_features(k, "k"), {"log_space": True}


def replace_attention(model: nn.Module, dims, seed: int, orthogonal: bool = True) -> nn.Module:
    """Swap model.blocks[i].attn for LinearAttention with dims[i] features (seed + i), in place, on
    each layer's device; returns model."""
    if len(dims) != len(model.blocks):
        raise ValueError(
            f"replace_attention: {len(dims)} feature dims for {len(model.blocks)} blocks"
        )
    for i, (block, M) in enumerate(zip(model.blocks, dims)):
        block.attn = LinearAttention(block.attn, int(M), seed + i, orthogonal)
    return model
