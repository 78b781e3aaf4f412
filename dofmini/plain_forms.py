"""Eq. 2 on positive features (ones in v make S hold s_t), by token or by chunks:
y_t = φ_q,t·S_t / φ_q,t·s_t, S_t = Σ_{s≤t} φ_k,s v_sᵀ, s_t = Σ_{s≤t} φ_k,s; torch only."""

import torch


def recurrent_step(q, k, v, S):
    """One token, q, k [B, H, 1, M], v [B, H, 1, E], from S [B, H, M, E], in
    O(M·E), in place without autograd: (y [B, H, 1, E], the state after)."""
    if q.shape[-2] != 1:
        raise ValueError(f"recurrent_step: q has {q.shape[-2]} tokens; expected 1")
    S = S.addcmul(k.mT, v) if torch.is_grad_enabled() else S.addcmul_(k.mT, v)
    return q @ S, S


def chunked_attention(q, k, v, S):
    """N chunks of L tokens, q, k [B, H, N, L, M], v [B, H, N, L, E], from S
    [B, H, M, E]: (y [B, H, N, L, E], the state after)."""
    kv = k.mT @ v  # 1. each chunk's Σ_s φ_k,s v_sᵀ [B, H, N, M, E]
    before, S = chunk_states(S, kv)  # 2. the state before each chunk
    inter = q @ before  # 3. each token reads it [B, H, N, L, E]
    intra = (q @ k.mT).tril_() @ v  # 4. and its chunk up to itself
    return intra.add_(inter), S


def chunk_states(S, kv, A=None):
    """Step 2: states before each chunk [B, H, N, M, E], after the last; A: decays (scan)."""
    X = torch.cat([S[:, :, None], kv[:, :, :-1]], 2)  # step 3 takes its scan
    before = X.cumsum(2) if A is None else scan_chunks(X, A[..., :-1, :, :])
    decay = 1 if A is None else torch.exp(A[..., -1, :, :] - A[..., -2, :, :])
    return before, kv[:, :, -1] + decay * before[:, :, -1]


def scan_chunks(X, A, block=32):
    """P_n = Σ_{n'≤n} exp(A_n − A_n') X_n' along dim −3, A non-increasing: P_n = X_n +
    exp(A_n − A_n−1) P_n−1, each factor ≤ 1 formed directly. Past `block` chunks: blocks
    side by side (the last padded with chunk N), then the ends: ~2√N steps."""
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
