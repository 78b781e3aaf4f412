"""Eq. 2 on log-features (log Φ) over running maxima c, so nothing overflows: `log_step` for
a token, `log_loop` to read, `log_chunks` to run."""

import torch

from .plain_forms import chunk_states, recurrent_step

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
    """The four steps a chunk at a time, to read (log_chunks runs them): c moves to the largest key
    so far, the state with it (S·exp(c_old − c_new), as gated linear attention decays it). A row
    whose keys all sit e^87 below c underflows here; log_chunks keeps it."""
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
    raised to the chunk's first key), so no row underflows, capped at e^RISE only if one rose
    (a cap costs backward ~10%): `_exact_kv`, `_exact_rows`. Step 4's keys serve step 1."""
    top = k.detach().amax(3, keepdim=True)  # [B, H, N, 1, M] chunk maxima
    refs = torch.cat([c.mT[:, :, None], top], 2).cummax(2).values  # N+1
    start = torch.maximum(refs[:, :, :-1], k.detach()[:, :, :, :1])  # [B, H, N, 1, M]
    ends = torch.cat([start, refs[:, :, -1:]], 2)  # what each state is over
    rise = (top - start).amax(-1)  # [B, H, N, 1]
    risen = (rise > RISE).flatten().nonzero()[:, 0]  # [n] chunks capped
    shifted = k - start  # [B, H, N, L, M]
    keys = (shifted.clamp_max_(RISE) if len(risen) else shifted).exp_()  # ≤ e^RISE
    over_next = torch.exp(start - ends[:, :, 1:]).mT
    kv = (keys.mT @ v).mul_(over_next)  # 1. over the next start
    if len(risen):
        kv.flatten(0, 2)[risen] = _exact_kv(risen, k, v, ends)
    held = S * torch.exp(c - start[:, :, 0].mT)  # over the first start
    before, S = chunk_states(held, kv, -ends.mT)  # 2.
    a = torch.softmax(q + start, -1)  # 3. against start (its scale cancels)
    inter = a @ before  # [B, H, N, L, E]
    y = ((a @ keys.mT).tril_() @ v).add_(inter)  # 4.
    if len(risen):
        y.flatten(0, 2)[risen] = _exact_rows(risen, q, k, v, start, inter, y)
    return y, S, refs[:, :, -1].mT


def _pick(chunks, x):  # [n, ...]: chunks [n] of x [B, H, N, ...]
    return x.flatten(0, 2)[chunks]


def _exact_kv(chunks, k, v, ends):
    """Step 1 of capped chunks [n] as [n, M, E]: keys uncapped over the next start (≤ 1)."""
    next_start = _pick(chunks, ends[:, :, 1:])  # [n, 1, M]
    keys = torch.exp(_pick(chunks, k) - next_start)  # [n, L, M]
    return keys.mT @ _pick(chunks, v)


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
    """The one shift, for queries and distillation losses: (exp(log_phi − u), u = max_m
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
        pad = [torch.nn.functional.pad(x, (0, 0, 0, 1)) for x in (log_q, log_k, v)]
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
