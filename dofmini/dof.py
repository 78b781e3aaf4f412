"""Degrees of freedom of attention kernels and each layer's feature budget (Algorithm 1); torch
only. A teacher: any module with `config`, `capture(ids)`, `token_ids(ids, need, what)`."""

import math
import numbers
import warnings
from fractions import Fraction

import torch

from .checks import need_integers, need_one_of, need_positive

EPS = torch.finfo(torch.float64).eps


def dof_by_definition(x, lam, normalize=True):
    """DoF [...] of x [..., J, d] by its definition: tr Σ̂(Σ̂+λI)⁻¹, Σ e/(e+λ) over the eigenvalues
    e of Σ̂ = G/J (or G), G_ij = exp(xᵢᵀxⱼ/√d): the stable form's reference."""
    J, d = x.shape[-2:]
    x = x.double()
    gram = torch.exp(x @ x.mT / math.sqrt(d))  # [..., J, J]
    sigma = gram / J if normalize else gram  # [..., J, J]
    stable = "use degrees_of_freedom, the stable form"
    try:
        e = torch.linalg.eigvalsh(sigma).clamp(min=0)  # [..., J] below 0 is rounding
    except torch.linalg.LinAlgError as err:  # Σ̂ too ill-conditioned to converge
        raise ValueError(f"dof_by_definition: {err}; {stable}") from None
    # eigvalsh errs by ~J·eps·max e: once that reaches λ, so do those near λ
    noise = J * EPS * e.amax()
    if not noise < lam:
        says = f"eigenvalues carry errors ~{noise:.3g} >= lam={lam}"
        warnings.warn(f"dof_by_definition: {says}; {stable}", RuntimeWarning, stacklevel=2)
    return (e / (e + lam)).sum(-1)


def degrees_of_freedom(x, lam, normalize=True):
    """dof_by_definition's DoF [...] float64 of x [..., J, d], also where G overflows or its
    small eigenvalues drown in rounding (normalize=False: the paper's text's raw G)."""
    what = "degrees_of_freedom"
    need_positive(what, lam=lam)
    if x.dim() < 2 or 0 in x.shape[-2:] or not x.isfinite().all():
        raise ValueError(f"{what}: x shape {tuple(x.shape)}; expected finite [..., J>0, d>0]")
    *batch, J, d = x.shape
    heads = x.detach().reshape(-1, J, d).double()  # [N, J, d]
    out = heads.new_empty(len(heads))  # [N]
    step = max(1, 2**24 // (J * J))  # heads at a time: 128 MiB of float64
    log_ridge = math.log(lam) + (math.log(J) if normalize else 0.0)
    for i in range(0, len(heads), step):
        xs = heads[i : i + step]  # [n, J, d]
        mat = xs @ xs.mT / math.sqrt(d)  # [n, J, J] log G
        sq = mat.diagonal(0, -2, -1).clone()  # [n, J] ‖x‖²/√d
        # G = D C D, D = diag(e^(sq/2)), C_ij = exp(-‖xᵢ-xⱼ‖²/2√d) in (0, 1]:
        # DoF = tr C(C+R)⁻¹, R = λ·J·D⁻² (λ·D⁻² raw), each point at its own scale
        mat.mul_(-2).add_(sq[:, :, None]).add_(sq[:, None, :])  # ‖xᵢ-xⱼ‖²/√d
        mat.clamp_(min=0).mul_(-0.5).exp_()  # [n, J, J] C
        # C's eigenvalues below J·d·eps·max sq are rounding; a ridge >= J·eps·(J+1+d·max sq)
        # meets Demmel's condition for Cholesky (λ_min > J(J+1)·eps/2; Higham 2002, §10.7).
        floor = J * EPS * (J + 1 + d * sq.amax(-1, keepdim=True))  # [n, 1]
        ridge = torch.exp(log_ridge - sq).maximum(floor)  # [n, J]
        mat.diagonal(0, -2, -1).add_(ridge)  # [n, J, J] C+R
        chol, info = torch.linalg.cholesky_ex(mat)  # [n, J, J]
        if info.any():
            failed = (i + info.nonzero().flatten()).tolist()
            raise ValueError(f"{what}: Cholesky failed for heads {failed}")
        # DoF = J - tr R(C+R)⁻¹ = J - ‖L⁻¹R^½‖²_F, at least 0
        root = ridge.sqrt().diag_embed()  # [n, J, J]
        lr = torch.linalg.solve_triangular(chol, root, upper=False)
        out[i : i + step] = (J - lr.square().sum((-2, -1))).clamp(min=0)
    return out.reshape(batch)


def estimate_dof(model, token_ids, lam, J=1024, seed=0, normalize=True, ctx=None, batch=8):
    """Per-head DoF [L, H] of a frozen teacher's kernels on its queries and keys (1-4)."""
    x = sample_queries_keys(model, token_ids, J, seed, ctx, batch)
    return degrees_of_freedom(x, lam, normalize)  # x [L, H, J, d]


def sample_queries_keys(model, token_ids, J=1024, seed=0, ctx=None, batch=8):
    """J of each head's pooled queries and keys [L, H, J, d] float64, drawn uniformly without
    replacement from ctx-token windows (default n_ctx) of token_ids: one seeded draw
    serves every head, and [..., :j, :] is the draw of j (one pass, a sweep over J)."""
    what = "sample_queries_keys"
    cfg = model.config
    ctx = cfg.n_ctx if ctx is None else ctx
    if not 1 <= ctx <= cfg.n_ctx:
        raise ValueError(f"{what}: ctx={ctx}; need 1..n_ctx = {cfg.n_ctx}")
    need_integers(what, J=J, batch=batch)
    token_ids = model.token_ids(token_ids, ctx, what)
    n_win = token_ids.numel() // ctx
    pool = 2 * ctx  # ctx queries, then ctx keys
    if n_win * pool < J:
        got = f"{n_win} windows of {ctx} tokens: {n_win * pool} queries+keys a head"
        raise ValueError(f"{what}: {got}, fewer than J={J}; pass more text")
    windows = token_ids[: n_win * ctx].view(n_win, ctx)  # [W, ctx]
    gen = torch.Generator().manual_seed(seed)
    drawn = torch.randperm(n_win * pool, generator=gen)[:J]  # [J]
    win = drawn // pool  # [J]
    slot = drawn % pool
    device = next(model.parameters()).device
    shape = (cfg.n_layer, cfg.n_head, J, cfg.head_dim)
    x = torch.empty(shape, dtype=torch.float64)  # [L, H, J, d]
    for w0 in range(0, n_win, batch):
        here = (win >= w0) & (win < w0 + batch)  # [J]
        mine = here.nonzero().flatten()  # [n] draws in these windows
        rows = (win[mine] - w0).to(device)  # [n]
        slots = slot[mine].to(device)
        ids = windows[w0 : w0 + batch].to(device)  # [b, ctx]
        for layer, (q, k, _) in enumerate(model.capture(ids) if len(mine) else ()):
            picks = torch.cat((q, k), dim=2)[rows, :, slots]  # [n, H, d]
            x[layer, :, mine] = picks.transpose(0, 1).cpu().double()  # [H, n, d]
    return x


def allocate(layer_dof, budget, rule="proportional", cap=None, aggregate="max", floor=1):
    """Per-layer feature dims [L] (steps 5-7) summing to L·budget: M_l = C·w_l / mean w,
    C = budget, w: `layer_weights`, none below `floor` (`exact_shares`); integers by largest
    remainder, ties to more weight, then earlier layers; cap: min(M_l, cap), freed budget
    dropped ("DoF + clip", the paper)."""
    weights = layer_weights(layer_dof, rule, aggregate)  # [L] DoF^γ
    need_integers("allocate", budget=budget, cap=budget if cap is None else cap)
    if not (isinstance(floor, numbers.Integral) and 1 <= floor <= budget):
        raise ValueError(f"allocate: floor={floor!r}; expected an integer in 1..{budget}")
    total = len(weights) * int(budget)
    shares = exact_shares(weights, total, int(floor))  # C·w_l / mean w, floored
    dims = [math.floor(s) for s in shares]
    order = sorted(range(len(dims)), key=lambda i: (dims[i] - shares[i], -weights[i], i))
    for i in order[: total - sum(dims)]:
        dims[i] += 1
    return dims if cap is None else [min(m, cap) for m in dims]


def layer_weights(layer_dof, rule, aggregate):
    """Each layer's exact weight [L] (Fractions) from layer_dof [L] or [L, H] (a layer's DoF: its
    heads' "max", one M, the paper's; or "mean"): its DoF for rule "proportional" (the paper's),
    DoF^γ for "power:γ", any finite γ (0: uniform; < 0: more to less DoF)."""
    need_one_of("allocate", ("max", "mean"), aggregate=aggregate)
    kind, _, arg = rule.partition(":")
    try:
        gamma = float(arg) if kind == "power" else math.nan
    except ValueError:
        gamma = math.nan
    gamma = 1.0 if rule == "proportional" else gamma
    dof = torch.as_tensor(layer_dof, dtype=torch.float64)  # [L] or [L, H]
    if dof.dim() == 2 and dof.numel():
        dof = dof.amax(-1) if aggregate == "max" else dof.mean(-1)  # [L]
    positive = torch.isfinite(dof) & (dof > 0)
    if dof.dim() != 1 or len(dof) == 0 or not positive.all():
        raise ValueError(f"allocate: layer_dof {layer_dof}; expected positive finite [L] or [L, H]")
    weights = dof.pow(gamma)  # [L] x^1.0 is x exactly
    if not math.isfinite(gamma) or not (torch.isfinite(weights) & (weights > 0)).all():
        want = "'proportional' or 'power:γ', γ finite, each DoF^γ in float64's range"
        raise ValueError(f"allocate: rule {rule!r}; expected {want}")
    return [Fraction(w) for w in weights.tolist()]


def exact_shares(weights, total, floor):
    """Exact shares max(c·w_l, floor) summing to total: fix the layers below the floor, share
    out the rest again until none is (c only falls: fixed layers stay fixed)."""
    fixed = set()
    while True:
        free = [i for i in range(len(weights)) if i not in fixed]
        c = (total - floor * len(fixed)) / sum(weights[i] for i in free)
        low = {i for i in free if c * weights[i] < floor}
        if not low:
            return [max(c * w, floor) for w in weights]
        fixed |= low
