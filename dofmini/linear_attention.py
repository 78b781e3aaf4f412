"""Positive-random-feature (PRF) linear attention; torch only.

The paper's Eq. 2: y_t = φ_q,t·S_t / φ_q,t·s_t, with S_t = Σ_{s≤t} φ_k,s v_sᵀ
and s_t = Σ_{s≤t} φ_k,s (normalize=False: no denominator; ones in v make S
carry s_t). In order: the plain forms (`chunked_attention`: four steps), the same
on log-features (`log_loop` to read, `log_chunks` to run), any T, the features,
the module."""

import math
from dataclasses import dataclass

import torch
from torch import nn

from .checks import need_integers


def recurrent_step(q, k, v, S):
    """Eq. 2 for one token, q, k [B, H, 1, M], v [B, H, 1, E], from S [B, H, M, E], in
    O(M·E), in place without autograd: (y [B, H, 1, E], the state after)."""
    if q.shape[-2] != 1:
        raise ValueError(f"recurrent_step: q has {q.shape[-2]} tokens; expected 1")
    S = S.addcmul(k.mT, v) if torch.is_grad_enabled() else S.addcmul_(k.mT, v)
    return q @ S, S


def chunked_attention(q, k, v, S):
    """Eq. 2 on N chunks of L tokens, q, k [B, H, N, L, M], v [B, H, N, L, E], from S
    [B, H, M, E]: (y [B, H, N, L, E], the state after)."""
    kv = k.mT @ v  # 1. each chunk's Σ_s φ_k,s v_sᵀ [B, H, N, M, E]
    before, S = chunk_states(S, kv)  # 2. the state before each chunk
    inter = q @ before  # 3. each token reads it [B, H, N, L, E]
    intra = (q @ k.mT).tril_() @ v  # 4. and its chunk up to itself
    return intra.add_(inter), S


def chunk_states(S, kv, A=None):
    """Step 2: states before each chunk [B, H, N, M, E], after the last; A: decays (a scan)."""
    X = torch.cat([S[:, :, None], kv[:, :, :-1]], 2)  # step 3 takes its scan
    before = X.cumsum(2) if A is None else scan_chunks(X, A[..., :-1, :, :])
    decay = 1 if A is None else torch.exp(A[..., -1, :, :] - A[..., -2, :, :])
    return before, kv[:, :, -1] + decay * before[:, :, -1]


def scan_chunks(X, A, block=32):
    """P_n = Σ_{n'≤n} exp(A_n − A_n') X_n' along dim −3, A non-increasing: P_n = X_n +
    exp(A_n − A_n−1) P_n−1, each factor ≤ 1 formed directly. Past `block` chunks: blocks
    side by side (the last filled up with the last chunk), then their ends: ~2√N steps."""
    N = X.shape[-3]
    if N > block:
        if N % block:
            padded = -(-N // block) * block
            held = torch.arange(padded, device=X.device).clamp_max(N - 1)
            X, A = (x.index_select(-3, held) for x in (X, A))
        X, A = (x.unflatten(-3, (-1, block)) for x in (X, A))
        P = scan_chunks(X, A)  # [..., N/b, b, M, E]
        last = P[..., -1, :, :].clone()  # P is ours to add to
        ends = scan_chunks(last, A[..., -1, :, :])  # [..., N/b, M, E]
        decay = torch.exp(A[..., 1:, :, :, :] - A[..., :-1, -1:, :, :])
        P[..., 1:, :, :, :].addcmul_(decay, ends[..., :-1, None, :, :])
        return P.flatten(-4, -3)[..., :N, :, :]
    decays = torch.exp(A[..., 1:, :, :] - A[..., :-1, :, :])  # [.., N−1, ·, 1]
    P = [X[..., 0, :, :]]  # [..., M, E] each
    for x, decay in zip(X.unbind(-3)[1:], decays.unbind(-3)):
        P.append(torch.addcmul(x, decay, P[-1]))
    return torch.stack(P, -3)


# ---- Log space: the forms above on log-features, over running maxima c ----

# Keys ≤ e^40 over `start` (capped): L×L sums ≤ L·M·e^40 < 3e38; a row's terms ≥ e^−39 keep e^−87
RISE = 40.0


def log_step(q, k, v, S, c):
    """recurrent_step on log-features, S over c [B, H, M, 1] (each feature's largest key
    so far): the state moves to the new maximum (a factor ≤ 1), the key over it."""
    new = torch.maximum(c, k.detach().mT)  # [B, H, M, 1]
    shrink = torch.exp(c - new)  # ≤ 1
    S = S * shrink if torch.is_grad_enabled() else S.mul_(shrink)
    a = torch.softmax(q + new.mT, -1)  # [B, H, 1, M]: its scale cancels in y
    key = torch.exp(k - new.mT)  # [B, H, 1, M] ≤ 1
    y, S = recurrent_step(a, key, v, S)
    return y, S, new


def log_loop(q, k, v, S, c):
    """The four steps on log-features, one chunk at a time, to read (log_chunks runs them):
    c moves to the largest key so far, the state with it (S·exp(c_old − c_new), as gated
    linear attention rescales by its decays). A row whose keys all sit e^87 below c
    underflows here; log_chunks keeps it."""
    ys = []
    for q_n, k_n, v_n in zip(q.unbind(2), k.unbind(2), v.unbind(2)):  # [B, H, L, ·]
        new = torch.maximum(c, k_n.detach().amax(2, keepdim=True).mT)  # [B, H, M, 1]
        S = S * torch.exp(c - new)
        keys = torch.exp(k_n - new.mT)  # [B, H, L, M] ≤ 1
        a = torch.softmax(q_n + new.mT, -1)  # [B, H, L, M]
        ys.append(a @ S + (a @ keys.mT).tril() @ v_n)  # 3. and 4.
        S = S + keys.mT @ v_n
        c = new
    return torch.stack(ys, 2), S, c


def log_chunks(q, k, v, S, c):
    """log_loop's steps for all chunks at once: keys over `start` (the running maximum `refs`
    raised to the chunk's first key; capped at e^RISE: `_exact_rows`), so no row underflows;
    the scan moves the states. Step 4's keys serve step 1 over the next start."""
    kd = k.detach()
    top = kd.amax(3, keepdim=True)  # [B, H, N, 1, M] each chunk's largest
    refs = torch.cat([c.mT[:, :, None], top], 2).cummax(2).values  # N+1
    start = torch.maximum(refs[:, :, :-1], kd[:, :, :, :1])  # [B, H, N, 1, M]
    ends = torch.cat([start, refs[:, :, -1:]], 2)  # what each state is over
    keys = (k - start).clamp_max_(RISE).exp_()  # [B, H, N, L, M] ≤ e^RISE
    over_next = torch.exp(start - ends[:, :, 1:]).mT
    kv = (keys.mT @ v).mul_(over_next)  # 1. over the next start
    rise = (top - start).amax(-1)  # [B, H, N, 1]
    risen = (rise > RISE).flatten().nonzero()[:, 0]  # [n] chunks capped
    # their step 1 uncapped, over the next start (factors ≤ 1)
    next_start = _pick(risen, ends[:, :, 1:])  # [n, 1, M]
    risen_keys = torch.exp(_pick(risen, k) - next_start)  # [n, L, M]
    kv.flatten(0, 2)[risen] = risen_keys.mT @ _pick(risen, v)
    held = S * torch.exp(c - start[:, :, 0].mT)  # over the first start
    before, S = chunk_states(held, kv, -ends.mT)  # 2.
    a = torch.softmax(q + start, -1)  # 3. against start (its scale cancels)
    inter = a @ before  # [B, H, N, L, E]
    y = ((a @ keys.mT).tril_() @ v).add_(inter)  # 4.
    if len(risen):
        exact = _exact_rows(risen, q, k, v, start, inter, y)
        y.flatten(0, 2)[risen] = exact
    return y, S, refs[:, :, -1].mT


def _pick(chunks, x):  # [n, ...]: chunks [n] of x [B, H, N, ...]
    return x.flatten(0, 2)[chunks]


def _exact_rows(chunks, q, k, v, start, inter, fast):
    """Capped chunks [n] as [n, L, E]: from a key risen past e^RISE on exact (`_log_intra`
    merged with the state's part), the rows before it as `fast` has them."""
    q_n, k_n, v_n = (_pick(chunks, x) for x in (q, k, v))  # [n, L, ·]
    start_n = _pick(chunks, start)  # [n, 1, M]
    rise = (k_n.detach() - start_n).amax(-1, keepdim=True)  # [n, L, 1]
    rows = rise.cummax(1).values > RISE  # from the first risen key on
    intra, scale = _log_intra(q_n, k_n, v_n)
    read = (q_n + start_n).logsumexp(-1, True)  # step 3's softmax scale
    exact = _merge(intra, scale, _pick(chunks, inter), read)[0]
    return torch.where(rows, exact, _pick(chunks, fast))


def unit_features(log_phi):
    """The one shift, for queries and the distillation losses: (exp(log_phi − u), u = max_m
    log_phi [..., 1] detached). Φ·Φ' = exp(u + u')·(unit·unit') never overflows and no row
    loses all its features (a fixed |z_m|²/2 would lose keys with |k/d^¼ − z_m| ≳ 14)."""
    u = log_phi.detach().amax(-1, keepdim=True)  # [..., 1]
    return (log_phi - u).exp_(), u


def _merge(y1, t1, y2, t2):
    """y1·exp(t1) + y2·exp(t2) as (y, t), t = max(t1, t2): online softmax's."""
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
    second_q = halves[0].unbind(-3)[1]  # [..., L/2, M]
    first_k = halves[1].unbind(-3)[0]
    first_v = halves[2].unbind(-3)[0]  # [..., L/2, E]
    r = first_k.detach().amax(-2, keepdim=True)  # [..., 1, M]
    a, u = unit_features(second_q + r)  # [..., L/2, M], [..., L/2, 1]
    cross = a @ torch.exp(first_k - r).mT @ first_v  # [..., L/2, E]
    y1, y2 = y.unbind(-3)  # [..., L/2, E]
    t1, t2 = t.unbind(-3)  # [..., L/2, 1]
    y2, t2 = _merge(y2, t2, cross, u)
    return torch.cat([y1, y2], -2), torch.cat([t1, t2], -2)


# ---- Any T, any form; the features; the module ----

CPU_PART = 1024  # tokens per part on CPU (cache-sized); any other device takes T in one part


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
    if state is not None:
        state.S = carried[0]
        state.c = carried[1] if log_space else None
        state.n += T
    if normalize:  # only the denominator is clamped, only against 0/0
        dv = v.shape[-1]
        num, den = y.split_with_sizes([dv, 1], -1)  # one split, one backward
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
    hint = "PRF features overflow fp32 once ‖x‖ ≳ 5√d: pass log-features, log_space=True"
    for name, phi in (("phi_q", phi_q), ("phi_k", phi_k)):
        low, high = torch.aminmax(phi)  # one pass; NaN fails both tests
        if not bool((low >= 0) & (high < math.inf)):
            got = f"{name} holds negative, infinite or NaN features"
            raise ValueError(f"{got}; expected finite features >= 0 ({hint})")


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
        self.orthogonal = orthogonal
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
