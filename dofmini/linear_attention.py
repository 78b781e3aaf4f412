"""Positive-random-feature (PRF) linear attention, torch and the standard library only.

The paper's Eq. 2: y_t = φ_q,t·S_t / φ_q,t·s_t, S_t = Σ_{s≤t} φ_k,s v_sᵀ, s_t = Σ_{s≤t} φ_k,s
(normalize=False: no denominator; ones in v make S carry s_t). In order: `recurrent_step`,
`chunked_attention` (four steps), `log_chunks` (the same relative to running maxima),
`causal_linear_attention` (any T), the features, the module."""

import math
from dataclasses import dataclass

import torch
from torch import nn


def recurrent_step(q, k, v, S, c=None):
    """Eq. 2 for one token, q, k [B, H, 1, M], v [B, H, 1, E], from S [B, H, M, E], in
    O(M·E), in place without autograd; in log space S is relative to c [B, H, M, 1]."""
    in_place = not torch.is_grad_enabled()
    key = k.mT  # [B, H, M, 1]
    if c is not None:
        old, c = c, torch.maximum(c, key.detach())  # [B, H, M, 1]
        shrink = torch.exp(old - c)  # [B, H, M, 1] ≤ 1
        S = S.mul_(shrink) if in_place else S * shrink
        key = torch.exp(key - c)  # [B, H, M, 1] ≤ 1
        q = torch.softmax(q + c.mT, -1)  # [B, H, 1, M]: a row's scale cancels in y
    S = S.addcmul_(key, v) if in_place else S.addcmul(key, v)
    return q @ S, S, c  # y [B, H, 1, E]


def chunked_attention(q, k, v, S, c=None):
    """Eq. 2 on N chunks of L tokens, q, k [B, H, N, L, M], v [B, H, N, L, E], from S [B, H, M,
    E]. Returns y [B, H, N, L, E], the state after, c (a form's)."""
    kv = k.mT @ v  # 1. each chunk's Σ_s φ_k,s v_sᵀ [B, H, N, M, E]
    before, S = chunk_states(S, kv)  # 2. the state before each chunk
    inter = q @ before  # 3. each token reads it [B, H, N, L, E]
    intra = (q @ k.mT).tril_() @ v  # 4. and its chunk up to itself
    return intra.add_(inter), S, c


def chunk_states(S, kv, A=None):
    """Step 2: states before each chunk [B, H, N, M, E], after the last; A: decays (a scan)."""
    X = torch.cat([S[:, :, None], kv[:, :, :-1]], 2)  # [B, H, N, M, E]: scan feeds step 3 as is
    before = X.cumsum(2) if A is None else scan_chunks(X, A[..., :-1, :, :])
    decay = 1 if A is None else torch.exp(A[..., -1, :, :] - A[..., -2, :, :])  # [..., ·, 1]
    return before, kv[:, :, -1] + decay * before[:, :, -1]


def scan_chunks(X, A, block=32):
    """P_n = Σ_{n'≤n} exp(A_n − A_n') X_n' along dim −3, A non-increasing: P_n = X_n +
    exp(A_n − A_n−1) P_n−1, each factor ≤ 1 formed directly. Past `block` chunks: blocks
    side by side (the last filled up with the last chunk), then their ends: ~2√N steps."""
    N = X.shape[-3]
    if N > block:
        if N % block:
            held = torch.arange(-(-N // block) * block, device=X.device).clamp_max(N - 1)
            X, A = (x.index_select(-3, held) for x in (X, A))
        X, A = (x.unflatten(-3, (-1, block)) for x in (X, A))
        P = scan_chunks(X, A)  # [..., N/b, b, M, E]
        ends = scan_chunks(P[..., -1, :, :].clone(), A[..., -1, :, :])  # [..., N/b, M, E]
        decay = torch.exp(A[..., 1:, :, :, :] - A[..., :-1, -1:, :, :])  # [.., b, ·, 1]
        P[..., 1:, :, :, :].addcmul_(decay, ends[..., :-1, None, :, :])  # P is ours (ends: a copy)
        return P.flatten(-4, -3)[..., :N, :, :]
    decays = torch.exp(A[..., 1:, :, :] - A[..., :-1, :, :])  # [..., N−1, ·, 1]
    P = [X[..., 0, :, :]]  # [..., M, E] each
    for x, decay in zip(X.unbind(-3)[1:], decays.unbind(-3)):
        P.append(torch.addcmul(x, decay, P[-1]))
    return torch.stack(P, -3)


# Keys ≤ e^40 over `start` (capped): L×L sums ≤ L·M·e^40 < 3e38; a row's terms ≥ e^−39 keep e^−87
RISE = 40.0


def log_chunks(q, k, v, S, c):
    """The four steps relative to running maxima, on log-features (PRF features leave fp32
    once ‖k‖ ≳ 5√d), S relative to c [B, H, M, 1]. No feature underflows at any norm: keys
    over `start` (the running maximum `refs` raised to the chunk's first key; ≤ e^RISE, else the
    row is exact), queries over their log-sum-exp (softmax: largest ≥ 1/M). Shifts only look
    back and cancel in the normalised output. Step 4's keys serve step 1 (one exponential) over
    the next chunk's start: the scan hands each chunk its state over its own start."""
    top = k.detach().amax(3, keepdim=True)  # [B, H, N, 1, M] each chunk's largest
    refs = torch.cat([c.mT[:, :, None], top], 2).cummax(2).values
    start = torch.maximum(refs[:, :, :-1], k.detach()[:, :, :, :1])  # [B, H, N, 1, M]
    risen = (top - start).amax(-1) > RISE  # [B, H, N, 1]
    i = None  # or the chunks to redo: risen ones, all where no flag comes back
    if q.shape[3] > 1 and (not _reads_back(q) or risen.any()):
        every = torch.arange(risen.numel(), device=q.device)
        i = risen.flatten().nonzero()[:, 0] if _reads_back(q) else every
    keys = k - start  # [B, H, N, L, M]
    if i is not None:  # capped where unused: their rows exact, their sums redone
        keys.flatten(0, 2)[i] = _pick(i, keys).clamp_max(RISE)
    keys = keys.exp_()  # ≤ e^RISE
    ends = torch.cat([start, refs[:, :, -1:]], 2)  # [B, H, N+1, 1, M] what each state is over
    kv = (keys.mT @ v).mul_(torch.exp(start - ends[:, :, 1:]).mT)  # 1. over the next start
    if i is not None:
        kv.flatten(0, 2)[i] = torch.exp(_pick(i, k) - _pick(i, ends[:, :, 1:])).mT @ _pick(i, v)
    before, S = chunk_states(S * torch.exp(c - start[:, :, 0].mT), kv, -ends.mT)  # 2.
    a = torch.softmax(q + start, -1)  # 3. [B, H, N, L, M], against start (scale cancels)
    inter = a @ before
    y = ((a @ keys.mT).tril_() @ v).add_(inter)  # 4. [B, H, N, L, E]
    if i is not None:  # exact from a risen key on
        q, k, v, inter, fast, start = (_pick(i, x) for x in (q, k, v, inter, y, start))
        rows = (k.detach() - start).amax(-1, keepdim=True).cummax(1).values > RISE  # [n, L, 1]
        exact = _merge(*_log_intra(q, k, v), inter, (q + start).logsumexp(-1, True))[0]
        y.flatten(0, 2)[i] = torch.where(rows, exact, fast)
    return y, S, refs[:, :, -1].mT


def _pick(i, x):  # chunks i of x [B, H, N, ...] as [n, ...]
    return x.flatten(0, 2)[i]


def unit_features(log_phi):
    """The one shift, for queries and the distillation losses: (exp(log_phi − u), u = max_m
    log_phi [..., 1] detached). Φ·Φ' = exp(u + u')·(unit·unit') never overflows and no row
    loses all its features (a fixed |z_m|²/2 would lose keys with |k/d^¼ − z_m| ≳ 14)."""
    u = log_phi.detach().amax(-1, keepdim=True)  # [..., 1]
    return (log_phi - u).exp_(), u


def _merge(y1, t1, y2, t2):
    """y1·exp(t1) + y2·exp(t2) as (y, t), t = max(t1, t2): online softmax's merge."""
    t = torch.maximum(t1, t2)  # [..., 1]
    return y1 * torch.exp(t1 - t) + y2 * torch.exp(t2 - t), t


def _log_intra(log_q, log_k, v):
    """y_i = Σ_{j≤i} Σ_m exp(log_q,im + log_k,jm − t_i) v_j exactly: halves recursively, then
    the second's queries on the first's keys over their maximum, merged (factors ≤ 1)."""
    L = log_q.shape[-2]
    if L == 1:
        a, t = unit_features(log_q + log_k)  # [..., 1, M], [..., 1, 1]
        return a.sum(-1, keepdim=True) * v, t
    if L % 2:
        pad = [nn.functional.pad(x, (0, 0, 0, 1)) for x in (log_q, log_k, v)]
        return tuple(x[..., :L, :] for x in _log_intra(*pad))
    halves = [x.unflatten(-2, (2, L // 2)) for x in (log_q, log_k, v)]  # [..., 2, L/2, ·]
    y, t = _log_intra(*halves)  # [..., 2, L/2, E], [..., 2, L/2, 1]
    # unbind: its backward is a stack (an index's: a zero-filled copy)
    (_, second_q), (first_k, _), (first_v, _) = (x.unbind(-3) for x in halves)
    r = first_k.detach().amax(-2, keepdim=True)  # [..., 1, M]
    a, u = unit_features(second_q + r)  # [..., L/2, M], [..., L/2, 1]
    cross = a @ torch.exp(first_k - r).mT @ first_v  # [..., L/2, E]
    (y1, y2), (t1, t2) = y.unbind(-3), t.unbind(-3)  # [..., L/2, E | 1]
    y2, t2 = _merge(y2, t2, cross, u)
    return torch.cat([y1, y2], -2), torch.cat([t1, t2], -2)


SEGMENT = {"cpu": 1024}  # tokens per part by device: cache-sized on CPU; a GPU takes one part


def _reads_back(x) -> bool:  # the one device rule: a flag (a key rose?) comes back, not on meta
    return not x.is_meta


@dataclass
class LinearState:
    """Sums after n tokens (S None before the first): S = Σ_s φ_k,s [v_s, 1]ᵀ [B, H, M, dv+1];
    in log space relative to c [B, H, M, 1], each feature's largest log φ_k so far."""

    S: torch.Tensor | None = None
    n: int = 0
    c: torch.Tensor | None = None


def causal_linear_attention(
    phi_q, phi_k, v, chunk=64, normalize=True, state=None, log_space=False, form=None
) -> torch.Tensor:
    """[B, H, T, M] x2, [B, H, T, dv] -> [B, H, T, dv] in v's dtype: one token a
    `recurrent_step`, more `chunked_attention` (`log_chunks` with log_space; or `form`) on the
    whole chunks, part by part (`SEGMENT`), then on the rest as one chunk."""
    fits = phi_q.dim() == 4 == v.dim() and phi_q.shape == phi_k.shape
    if not fits or v.shape[:3] != phi_q.shape[:3] or phi_q.shape[2] == 0 or chunk < 1:
        shapes = [tuple(x.shape) for x in (phi_q, phi_k, v)]
        raise ValueError("phi_q {}, phi_k {}, v {}".format(*shapes) + f", chunk {chunk}: expected "
                         "[B, H, T, M] x2, [B, H, T, dv] with T >= 1, chunk >= 1")  # fmt: skip
    if log_space and not normalize:
        raise ValueError("log_space=True needs normalize=True: its shifts cancel only there")
    f = torch.promote_types(torch.promote_types(phi_q.dtype, v.dtype), torch.float32)
    B, H, T, M = phi_q.shape
    E = v.shape[-1] + normalize
    S, c = (None, None) if state is None else (state.S, state.c)
    if S is None:
        S = v.new_zeros(B, H, M, E, dtype=f)
        # the lowest finite value, not −inf: an empty state weighs exp(−huge) = 0, not NaN
        c = v.new_full((B, H, M, 1), torch.finfo(f).min, dtype=f) if log_space else None
    got = (tuple(S.shape), None if c is None else tuple(c.shape))
    if got != ((B, H, M, E), (B, H, M, 1) if log_space else None):
        space = "log space: c [B, H, M, 1]" if log_space else "linear space: c None"
        raise ValueError(f"state S {got[0]}, c {got[1]} does not fit S [B, H, M, E] = "
                         f"{(B, H, M, E)} (E = dv + 1 when normalize=True; {space})")  # fmt: skip
    q, k, x = phi_q.to(f), phi_k.to(f), v.to(f)
    if normalize:
        x = nn.functional.pad(x, (0, 1), value=1.0)  # [B, H, T, E]
    if T == 1 and form is None:
        y, S, c = recurrent_step(q, k, x, S, c)
    else:
        form = form or (log_chunks if log_space else chunked_attention)
        whole = T - T % chunk
        step = max(SEGMENT.get(q.device.type, T) // chunk, 1) * chunk
        sizes = [min(step, whole - lo) for lo in range(0, whole, step)]
        sizes += [T % chunk] if T % chunk else []  # the rest, one shorter chunk
        ys = []
        for n, *part in zip(sizes, *(t.split(sizes, 2) for t in (q, k, x))):
            part = [t.contiguous().unflatten(2, (-1, min(chunk, n))) for t in part]
            y, S, c = form(*part, S, c)
            ys.append(y.flatten(2, 3))  # [B, H, n, E]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, 2)  # [B, H, T, E]
    if state is not None:
        state.S, state.c, state.n = S, c, state.n + T
    if normalize:  # only the denominator is clamped, only against 0/0; one split, one backward
        num, den = y.split_with_sizes([v.shape[-1], 1], -1)  # [B, H, T, dv | 1]
        y = num * den.clamp_min(torch.finfo(f).tiny).reciprocal()
    return y.to(v.dtype)


class PRFFeatures(nn.Module):
    """Φ(x)_m = sqrt(α_m/M) exp(z_mᵀx / d^¼ − |x|²/(2√d)) per head, trainable z [H, M, d] and
    a = log α [H, M]; no epsilon (it would bias the estimate)."""

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
        H, M, d = self.z.shape
        o = f"seed={self.seed}, orthogonal={self.orthogonal}"
        return f"n_head={H}, n_features={M}, head_dim={d}, {o}"

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
    """A teacher layer's stand-in: its frozen q, k, v mixed with the cache's state. Subclasses set
    `chunk`, new tensors, `_place(base)` and `feature_maps(q, k)` -> (phi_q, phi_k, options)."""

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
    """Drop-in for a teacher's attention: PRF linear attention in log space; trains z and a."""

    def __init__(self, base: nn.Module, n_features: int, seed: int, orthogonal=True, chunk=64):
        super().__init__()
        self.chunk = chunk
        self.features = PRFFeatures(base.n_head, base.head_dim, n_features, seed, orthogonal)
        self._place(base)

    def feature_maps(self, q, k):
        log_q = self.features.log_features(q, "q")  # [B, H, T, M]
        return log_q, self.features.log_features(k, "k"), {"log_space": True}
