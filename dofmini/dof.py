"""Degrees of freedom of attention kernels and the per-layer feature budget (Algorithm 1).

Vendorable: torch and the standard library only.
"""

import math
from fractions import Fraction

import torch

# float64 Gram entries held at once (128 MiB): heads are processed in chunks of this size
GRAM_ENTRIES = 2**24


def degrees_of_freedom(x, lam, normalize=True):
    """tr Σ̂(Σ̂+λI)⁻¹ for the kernel exp(xᵢᵀxⱼ/√d) on rows of x [..., J, d]; returns [...] float64.

    Σ̂ = G/J, the empirical kernel operator (the default); normalize=False uses the raw Gram G (the
    paper's text).
    """
    if x.dim() < 2 or x.shape[-2] < 1 or x.shape[-1] < 1:
        raise ValueError(
            f"degrees_of_freedom: x must be [..., J, d] with J, d >= 1, got {tuple(x.shape)}"
        )
    if not (lam > 0 and math.isfinite(lam)):
        raise ValueError(f"degrees_of_freedom: lam must be positive and finite, got {lam}")
    *batch, J, d = x.shape
    heads = x.detach().reshape(-1, J, d).double()  # [N, J, d]
    if not torch.isfinite(heads).all():
        raise ValueError("degrees_of_freedom: x holds non-finite values")
    out = heads.new_empty(len(heads))  # [N]
    step = max(1, GRAM_ENTRIES // (J * J))
    for i in range(0, len(heads), step):
        xs = heads[i : i + step]  # [n, J, d]
        mat = xs @ xs.transpose(-1, -2) / math.sqrt(d)  # [n, J, J] log G
        sq = mat.diagonal(0, -2, -1).clone()  # [n, J] ‖x‖²/√d
        # Symmetric diagonal rescaling G = D C D, D = diag(e^(sq/2)): C_ij = exp(-‖xᵢ-xⱼ‖²/2√d) lies
        # in (0, 1] and DoF = tr C(C+R)⁻¹ with R = λ·J·D⁻² (λ·D⁻² for the raw Gram). Scaling by G's
        # largest entry alone would drown every point whose norm is far below the largest in
        # rounding (DoF 84 instead of 95.9 on a Pythia stand-in head, J = 96, against an 80-digit
        # reference); this keeps each point at its own scale.
        mat.mul_(-2).add_(sq[:, :, None]).add_(sq[:, None, :])  # [n, J, J] ‖xᵢ-xⱼ‖²/√d
        mat.clamp_(min=0).mul_(-0.5).exp_()  # [n, J, J] C
        ridge = torch.exp(math.log(lam) + (math.log(J) if normalize else 0.0) - sq)  # [n, J]
        # C carries rounding of about d·eps·max sq per entry, so its eigenvalues below
        # J·eps·(d·max sq) are noise; flooring the ridge at J·eps·(J + 1 + d·max sq) loses nothing
        # resolvable and meets Demmel's condition for Cholesky to complete (λ_min > J(J+1)·eps/2;
        # Higham, Accuracy and Stability of Numerical Algorithms, 10.7).
        eps = torch.finfo(torch.float64).eps
        floor = J * eps * (J + 1 + d * sq.amax(-1, keepdim=True))  # [n, 1]
        ridge = torch.maximum(ridge, floor)  # [n, J]
        mat.diagonal(0, -2, -1).add_(ridge)  # [n, J, J] C+R
        chol, info = torch.linalg.cholesky_ex(mat)  # [n, J, J]
        if info.any():
            failed = (i + info.nonzero().flatten()).tolist()
            raise ValueError(f"degrees_of_freedom: Cholesky failed for heads {failed}")
        # tr C(C+R)⁻¹ = J - tr R(C+R)⁻¹ = J - ‖L⁻¹R^½‖²_F
        root = torch.linalg.solve_triangular(
            chol, torch.diag_embed(ridge.sqrt()), upper=False
        )  # [n, J, J]
        # rounding can dip a hair below 0
        out[i : i + step] = (J - root.square().sum((-2, -1))).clamp(min=0)  # [n]
    return out.reshape(batch)


def estimate_dof(model, token_ids, lam, J=1024, seed=0, normalize=True, ctx=None, batch=8):
    """Per-head DoF [L, H] of a frozen teacher's attention kernels on its own queries and keys.

    Algorithm 1, steps 1-4.
    """
    return degrees_of_freedom(
        sample_queries_keys(model, token_ids, J, seed, ctx, batch), lam, normalize
    )


@torch.no_grad()
def sample_queries_keys(model, token_ids, J=1024, seed=0, ctx=None, batch=8):
    """J of each head's pooled queries and keys [L, H, J, d] float64, uniform without replacement.

    token_ids (1-D) is cut into windows of ctx tokens (default model.config.n_ctx; the last partial
    window is dropped). One seeded draw of positions serves every head (each head still gets a
    uniform sample of its own pool), so only J vectors per head are kept and windows with no drawn
    position are not run. Rows are in draw order: [..., :j, :] is exactly the draw of j vectors with
    the same seed, so one pass serves a sweep over J.
    """
    cfg = model.config
    ctx = cfg.n_ctx if ctx is None else ctx
    if token_ids.dim() != 1:
        raise ValueError(
            f"sample_queries_keys: token_ids must be 1-D, got shape {tuple(token_ids.shape)}"
        )
    if not 1 <= ctx <= cfg.n_ctx:
        raise ValueError(
            f"sample_queries_keys: ctx={ctx} outside 1..{cfg.n_ctx} (model.config.n_ctx)"
        )
    n_win = token_ids.numel() // ctx
    pool = 2 * ctx  # per window and head, ctx queries then ctx keys
    if n_win * pool < J:
        raise ValueError(
            f"sample_queries_keys: {n_win} windows of {ctx} tokens give {n_win * pool} "
            f"queries+keys per head, fewer than J={J}; pass more text or a smaller J"
        )
    windows = token_ids[: n_win * ctx].view(n_win, ctx)  # [W, ctx]
    rng = torch.Generator().manual_seed(seed)
    drawn = torch.randperm(n_win * pool, generator=rng)[:J]  # [J] window·2ctx + slot
    rank = drawn.argsort()  # [J] draw position of each pooled index in increasing order
    picked = drawn[rank]  # [J] sorted, so each batch of windows owns a contiguous run
    device = next(model.parameters()).device
    x = torch.empty(cfg.n_layer, cfg.n_head, J, cfg.head_dim, dtype=torch.float64)  # [L, H, J, d]
    lo = 0
    for w0 in range(0, n_win, batch):
        ids = windows[w0 : w0 + batch]  # [B, ctx]
        hi = int((picked < (w0 + len(ids)) * pool).sum())  # picked[lo:hi] fall in these windows
        if hi == lo:
            continue
        mine = picked[lo:hi] - w0 * pool  # [n]
        capture = []
        model(ids.to(device), capture=capture)
        if len(capture) != cfg.n_layer:
            raise ValueError(
                f"sample_queries_keys: model captured {len(capture)} layers, "
                f"config says {cfg.n_layer}"
            )
        rows = (mine // pool).to(device)  # [n]
        slots = (mine % pool).to(device)  # [n]
        for layer, (q, k, _) in enumerate(capture):
            qk = torch.cat((q, k), dim=2)  # [B, H, 2ctx, d]
            x[layer, :, rank[lo:hi]] = (
                qk[rows, :, slots].transpose(0, 1).double().cpu()
            )  # [H, n, d]
        lo = hi
    return x


def saturation_warning(dof, J):
    """A message when any head's DoF [L, H] exceeds J/2, else None.

    Above J/2 the sample size J, not the head, limits the estimate.
    """
    over = int((dof > J / 2).sum())
    if not over:
        return None
    layer, head = divmod(int(dof.argmax()), dof.shape[-1])
    return (
        f"warning: {over} of {dof.numel()} heads have DoF above J/2 = {J / 2:g} "
        f"(largest {dof.max():.0f}, layer {layer} head {head}): J limits these estimates; "
        "use a larger J or a larger lam"
    )


def allocate(layer_dof, budget, cap=None, redistribute=False):
    """Per-layer dims M_s ∝ layer DoF (Algorithm 1, 5-7); per-head [L, H] DoF is max-reduced.

    Integers >= 1 summing to exactly L·budget: exact shares (fractions), then largest remainder,
    ties going to more DoF and then the earlier layer, so more DoF never gets fewer features and
    equal DoF gets equal shares (equal dims unless a remainder tie straddles the cut; then they
    differ by 1).
    cap: "DoF + clip", min(M_s, cap) with the freed budget dropped (the paper). redistribute=True
    instead hands the excess to uncapped layers by the same proportional rule, keeping the sum
    (needs cap >= budget).
    """
    dof = torch.as_tensor(layer_dof, dtype=torch.float64)
    dof = dof.amax(-1) if dof.dim() == 2 else dof
    if dof.dim() != 1 or len(dof) == 0 or not (torch.isfinite(dof) & (dof > 0)).all():
        raise ValueError(
            f"allocate: layer_dof must be positive finite [L] or [L, H], got {layer_dof}"
        )
    if int(budget) != budget or budget < 1:
        raise ValueError(f"allocate: budget must be an integer >= 1, got {budget}")
    if cap is not None and (int(cap) != cap or cap < 1):
        raise ValueError(f"allocate: cap must be an integer >= 1, got {cap}")
    if redistribute and (cap is None or cap < budget):
        raise ValueError(
            f"allocate: redistribute needs cap >= budget to keep the sum, "
            f"got cap={cap}, budget={budget}"
        )
    weights = [Fraction(w) for w in dof.tolist()]
    total = len(weights) * int(budget)
    shares = _shares(weights, total, cap if redistribute else math.inf)
    dims = [math.floor(s) for s in shares]
    # largest remainder first
    order = sorted(range(len(dims)), key=lambda i: (dims[i] - shares[i], -weights[i], i))
    for i in order[: total - sum(dims)]:
        dims[i] += 1
    return [min(m, cap) for m in dims] if cap is not None and not redistribute else dims


def _shares(weights, total, hi):
    """Exact shares clip(c·w, 1, hi) that sum to total.

    The sum is piecewise linear and nondecreasing in c with kinks where some c·w reaches 1 or hi;
    find the segment holding total and interpolate inside it.
    """

    def filled(c):
        return sum(min(max(c * w, 1), hi) for w in weights)

    kinks = sorted(
        {1 / w for w in weights} | ({hi / w for w in weights} if hi < math.inf else set())
    )
    lo_c, lo_f = Fraction(0), len(weights)  # at c -> 0 every share sits at the floor 1
    for c in kinks:
        f = filled(c)
        if f >= total:
            break
        lo_c, lo_f = c, f
    else:  # past the last kink with no cap, every share is c·w: the sum grows with slope Σw
        c, f = lo_c + 1, lo_f + sum(weights)
    if f != total:  # interpolate inside the segment, or extrapolate past the last kink
        c = lo_c + (c - lo_c) * (total - lo_f) / (f - lo_f)
    return [min(max(c * w, 1), hi) for w in weights]


def oracle_allocate(curves, budget, ms=None):
    """Per-layer dims in [ms[0], ms[-1]] summing to exactly L·budget with the least summed error.

    curves[l][k] is layer l's error with ms[k] features (ms: strictly increasing integers >= 1, at
    least two; None means 1, 2, ..., K, a curve measured at every M). Between measured points the
    error is taken as the power of M through them (linear in log M and log error): measured error
    curves fall by a near-constant factor per doubling of M, and a straight line in M between
    points would overstate every error between them, pinning the optimum to the measured Ms
    (with M = 8, 16, 32, ... it keeps a uniform allocation unless two layers' errors differ
    four-fold). Errors must therefore be positive. Every integer M in range has an error. The
    minimum is found
    exactly by dynamic programming over layers (the least summed error of layers 0..l for every
    total), not by a greedy on marginal gains: the greedy is optimal only when every curve is
    convex, and measured curves need not be. On exact ties the earlier layers get the features.
    Cost: L·(ms[-1] − ms[0] + 1) vector steps of length L·(budget − ms[0]) + 1.
    """
    try:
        errors = torch.as_tensor(curves, dtype=torch.float64)  # [L, K]
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"oracle_allocate: curves must be an [L, K] table of numbers: {err}"
        ) from err
    if errors.dim() != 2 or errors.shape[0] < 1 or errors.shape[1] < 2:
        raise ValueError(
            f"oracle_allocate: curves must be [L, K] with L >= 1 and K >= 2 measured points, got "
            f"shape {tuple(errors.shape)}"
        )
    if not torch.isfinite(errors).all() or not (errors > 0).all():
        raise ValueError(
            "oracle_allocate: curves must hold finite positive errors (they are interpolated as a "
            "power of M)"
        )
    ms = list(range(1, errors.shape[1] + 1)) if ms is None else list(ms)
    if (
        len(ms) != errors.shape[1]
        or any(int(m) != m for m in ms)
        or ms[0] < 1
        or any(b <= a for a, b in zip(ms, ms[1:]))
    ):
        raise ValueError(
            f"oracle_allocate: ms must be {errors.shape[1]} strictly increasing integers >= 1 (one "
            f"per column of curves), got {ms}"
        )
    lo, hi = int(ms[0]), int(ms[-1])
    if int(budget) != budget or not lo <= budget <= hi:
        raise ValueError(
            f"oracle_allocate: budget must be an integer in [{lo}, {hi}], got {budget}"
        )
    knots = torch.tensor(ms, dtype=torch.float64)  # [K]
    grid = torch.arange(lo, hi + 1, dtype=torch.float64)  # [R] every integer M in range
    seg = (torch.searchsorted(knots, grid, right=True) - 1).clamp(max=len(ms) - 2)  # [R]
    log_knots, log_errors = knots.log(), errors.log()  # [K], [L, K]
    frac = (grid.log() - log_knots[seg]) / (log_knots[seg + 1] - log_knots[seg])  # [R]
    dense = torch.exp(
        log_errors[:, seg] + frac * (log_errors[:, seg + 1] - log_errors[:, seg])
    )  # [L, R]
    extra = len(errors) * (int(budget) - lo)  # features handed out above lo in every layer
    best = torch.full((extra + 1,), math.inf, dtype=torch.float64)  # [E+1] by total extra
    best[0] = 0.0
    picks = []
    for row in dense:  # [R]
        new = torch.full_like(best, math.inf)  # [E+1]
        pick = torch.zeros(extra + 1, dtype=torch.long)  # [E+1] this layer's extra at the optimum
        for x in range(min(len(row), extra + 1)):
            cand = best[: extra + 1 - x] + row[x]  # [E+1-x]
            # strict: on a tie this layer keeps the smallest x, leaving features to earlier layers
            better = cand < new[x:]  # [E+1-x]
            new[x:] = torch.where(better, cand, new[x:])
            pick[x:] = torch.where(better, x, pick[x:])
        best = new
        picks.append(pick)
    dims = []
    for pick in reversed(picks):
        dims.append(lo + int(pick[extra]))
        extra -= dims[-1] - lo
    return dims[::-1]
