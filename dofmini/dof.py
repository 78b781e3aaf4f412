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
    the same seed, so one pass serves a sweep over J. The teacher runs without its head: no
    [B, T, V] logits (1.6 GB a batch of 8 for GPT-2 at ctx 1024).
    """
    cfg = model.config
    ctx = cfg.n_ctx if ctx is None else ctx
    if token_ids.dim() != 1 or not 1 <= ctx <= cfg.n_ctx:
        raise ValueError(
            f"sample_queries_keys: need 1-D token_ids and 1 <= ctx <= {cfg.n_ctx} (n_ctx); got "
            f"shape {tuple(token_ids.shape)}, ctx={ctx}"
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
        ids = windows[w0 : w0 + batch].to(device)  # [B, ctx]
        hi = int((picked < (w0 + len(ids)) * pool).sum())  # picked[lo:hi] fall in these windows
        if hi == lo:
            continue
        mine = picked[lo:hi] - w0 * pool  # [n]
        capture = []
        model(ids, capture=capture, keep=torch.zeros_like(ids, dtype=torch.bool))
        if len(capture) != cfg.n_layer:
            raise ValueError(
                f"sample_queries_keys: {len(capture)} layers captured, not {cfg.n_layer}"
            )
        rows, slots = (mine // pool).to(device), (mine % pool).to(device)  # [n], [n]
        for layer, (q, k, _) in enumerate(capture):
            qk = torch.cat((q, k), dim=2)  # [B, H, 2ctx, d]
            picks = qk[rows, :, slots].transpose(0, 1)  # [H, n, d]
            x[layer, :, rank[lo:hi]] = picks.double().cpu()
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


AGGREGATES = {"max": lambda dof: dof.amax(-1), "mean": lambda dof: dof.mean(-1)}


def allocate(layer_dof, budget, rule="proportional", cap=None, aggregate="max"):
    """Per-layer feature dims (Algorithm 1, steps 5-7): integers >= 1 summing to exactly L·budget.

    layer_dof: [L], or per-head [L, H] reduced over heads by `aggregate`: "max" (the paper: a
    layer's heads share one M, so its hardest head decides) or "mean".
    rule: "proportional" (the paper), M_l ∝ DoF_l; or "power:γ" (γ >= 0), M_l ∝ DoF_l^γ ("power:1"
    is "proportional" exactly, "power:0.5" the square root, "power:0" uniform). Why a power: if
    layer l's error falls as a_l·M^-β, the least summed error at a fixed ΣM has M_l ∝ a_l^(1/(1+β));
    reading DoF as the features a layer needs for a fixed error, w_l = a_l^(1/β), that is
    M_l ∝ w_l^(β/(1+β)), i.e. γ = β/(1+β) < 1. Proportional (γ = 1) is optimal only as β → ∞,
    and for β <= 1 it never beats uniform on exact shares (a power-mean inequality; rounding to
    integers can tip a near-tie); the tests check both.
    Exact shares (fractions of the float weights), then largest remainder, ties going to more weight
    and then the earlier layer, so more DoF never gets fewer features and equal DoF gets equal
    shares (equal dims unless a remainder tie straddles the cut; then they differ by 1).
    cap: "DoF + clip", min(M_l, cap) with the freed budget dropped (the paper).
    """
    if aggregate not in AGGREGATES:
        raise ValueError(f"allocate: aggregate {aggregate!r}; expected one of {list(AGGREGATES)}")
    dof = torch.as_tensor(layer_dof, dtype=torch.float64)  # [L] or [L, H]
    dof = AGGREGATES[aggregate](dof) if dof.dim() == 2 else dof  # [L]
    if dof.dim() != 1 or len(dof) == 0 or not (torch.isfinite(dof) & (dof > 0)).all():
        raise ValueError(
            f"allocate: layer_dof must be positive finite [L] or [L, H], got {layer_dof}"
        )
    if int(budget) != budget or budget < 1:
        raise ValueError(f"allocate: budget must be an integer >= 1, got {budget}")
    if cap is not None and (int(cap) != cap or cap < 1):
        raise ValueError(f"allocate: cap must be an integer >= 1, got {cap}")
    weights = [Fraction(w) for w in rule_weights(dof, rule).tolist()]
    total = len(weights) * int(budget)
    shares = _shares(weights, total)
    dims = [math.floor(s) for s in shares]
    # largest remainder first
    order = sorted(range(len(dims)), key=lambda i: (dims[i] - shares[i], -weights[i], i))
    for i in order[: total - sum(dims)]:
        dims[i] += 1
    return dims if cap is None else [min(m, cap) for m in dims]


def rule_weights(dof, rule: str):
    """The weights [L] float64 that `rule` makes of positive layer DoF [L] (see allocate)."""
    gamma = 1.0 if rule == "proportional" else None
    if rule.startswith("power:"):
        try:
            gamma = float(rule[len("power:") :])
        except ValueError:
            gamma = None
    if gamma is None or not (math.isfinite(gamma) and gamma >= 0):
        raise ValueError(
            f"allocation rule {rule!r}; expected 'proportional' or 'power:γ' with γ a finite "
            "number >= 0 (e.g. 'power:0.5')"
        )
    weights = dof.pow(gamma)  # [L] x^1.0 is x exactly, so "power:1" is "proportional"
    if not (torch.isfinite(weights) & (weights > 0)).all():
        raise ValueError(f"allocation rule {rule!r}: DoF^{gamma:g} leaves float64's range")
    return weights


def _shares(weights, total):
    """Exact shares max(c·w, 1) that sum to total.

    The sum is piecewise linear and nondecreasing in c with kinks where some c·w reaches 1; find the
    segment holding total and interpolate inside it.
    """
    kinks = sorted({1 / w for w in weights})
    lo_c, lo_f = Fraction(0), len(weights)  # at c -> 0 every share sits at the floor 1
    for c in kinks:
        f = sum(max(c * w, 1) for w in weights)
        if f >= total:
            break
        lo_c, lo_f = c, f
    else:  # past the last kink every share is c·w: the sum grows with slope Σw
        c, f = lo_c + 1, lo_f + sum(weights)
    if f != total:  # interpolate inside the segment, or extrapolate past the last kink
        c = lo_c + (c - lo_c) * (total - lo_f) / (f - lo_f)
    return [max(c * w, 1) for w in weights]
