"""Degrees of freedom of attention kernels and the per-layer feature budget (Algorithm 1).
Vendorable: torch and the standard library only."""

import math
from fractions import Fraction

import torch


def degrees_of_freedom(x, lam, normalize=True):
    """DoF [...] float64 of the rows of x [..., J, d]: tr Σ̂(Σ̂+λI)⁻¹, λ = lam, for the kernel
    exp(xᵢᵀxⱼ/√d), with Σ̂ = G/J (the paper's theory and numbers) or, normalize=False, the raw Gram
    G (its text)."""
    finite = lam > 0 and math.isfinite(lam) and x.isfinite().all()
    if x.dim() < 2 or 0 in x.shape[-2:] or not finite:
        raise ValueError(
            "degrees_of_freedom: need finite x [..., J, d] with J, d >= 1 and lam positive and "
            f"finite; got shape {tuple(x.shape)}, lam={lam}"
        )
    *batch, J, d = x.shape
    heads = x.detach().reshape(-1, J, d).double()  # [N, J, d]
    out = heads.new_empty(len(heads))  # [N]
    step = max(1, 2**24 // (J * J))  # heads at a time: 2^24 float64 Gram entries, 128 MiB
    eps = torch.finfo(torch.float64).eps
    for i in range(0, len(heads), step):
        xs = heads[i : i + step]  # [n, J, d]
        mat = xs @ xs.transpose(-1, -2) / math.sqrt(d)  # [n, J, J] log G
        sq = mat.diagonal(0, -2, -1).clone()  # [n, J] ‖x‖²/√d
        # G = D C D, D = diag(e^(sq/2)), C_ij = exp(-‖xᵢ-xⱼ‖²/2√d) in (0, 1]: DoF = tr C(C+R)⁻¹,
        # R = λ·J·D⁻² (λ·D⁻² raw), each point at its own scale (G over its largest entry alone gave
        # DoF 84, not 95.9, on a Pythia stand-in head, J = 96, against an 80-digit reference).
        mat.mul_(-2).add_(sq[:, :, None]).add_(sq[:, None, :])  # [n, J, J] ‖xᵢ-xⱼ‖²/√d
        mat.clamp_(min=0).mul_(-0.5).exp_()  # [n, J, J] C
        ridge = torch.exp(math.log(lam) + (math.log(J) if normalize else 0.0) - sq)  # [n, J]
        # C's eigenvalues below J·d·eps·max sq are rounding; a ridge >= J·eps·(J+1+d·max sq) also
        # meets Demmel's condition for Cholesky (λ_min > J(J+1)·eps/2; Higham 2002, §10.7).
        floor = J * eps * (J + 1 + d * sq.amax(-1, keepdim=True))  # [n, 1]
        ridge = torch.maximum(ridge, floor)  # [n, J]
        mat.diagonal(0, -2, -1).add_(ridge)  # [n, J, J] C+R
        chol, info = torch.linalg.cholesky_ex(mat)  # [n, J, J]
        if info.any():
            failed = (i + info.nonzero().flatten()).tolist()
            raise ValueError(f"degrees_of_freedom: Cholesky failed for heads {failed}")
        # DoF = J - tr R(C+R)⁻¹ = J - ‖lr‖²_F, lr = L⁻¹R^½ [n, J, J], clamped at 0 against rounding
        lr = torch.linalg.solve_triangular(chol, ridge.sqrt().diag_embed(), upper=False)
        out[i : i + step] = (J - lr.square().sum((-2, -1))).clamp(min=0)  # [n]
    return out.reshape(batch)


def estimate_dof(model, token_ids, lam, J=1024, seed=0, normalize=True, ctx=None, batch=8):
    """Per-head DoF [L, H] of a frozen teacher's kernels on its own queries and keys (steps 1-4)."""
    x = sample_queries_keys(model, token_ids, J, seed, ctx, batch)  # [L, H, J, d]
    return degrees_of_freedom(x, lam, normalize)


@torch.no_grad()
def capture(model, ids):
    """Every layer's (q, k, v) [B, H, T, d] for ids [B, T], without the head's [B, T, V] logits
    (1.6 GB a batch of 8 for GPT-2 at ctx 1024, and most of a small model's cost)."""
    layers = []
    model(ids, capture=layers, keep=torch.zeros_like(ids, dtype=torch.bool))
    if len(layers) != model.config.n_layer:
        raise ValueError(f"capture: {len(layers)} layers reported, not {model.config.n_layer}")
    return layers


def as_token_ids(token_ids, need: int, what: str) -> torch.Tensor:
    """token_ids as a 1-D CPU LongTensor of at least `need` tokens, or a named error."""
    token_ids = torch.as_tensor(token_ids)
    if token_ids.dim() != 1 or len(token_ids) < need:
        raise ValueError(f"{what}: token_ids {tuple(token_ids.shape)}; need 1-D, >= {need} tokens")
    return token_ids.long().cpu().contiguous()


def sample_queries_keys(model, token_ids, J=1024, seed=0, ctx=None, batch=8):
    """J of each head's pooled queries and keys [L, H, J, d] float64, drawn uniformly without
    replacement from windows of ctx tokens (default n_ctx) of token_ids (1-D). One seeded draw of
    positions serves every head; windows with none are not run. Rows are in draw order:
    [..., :j, :] is the draw of j with the same seed, so one pass serves a sweep over J."""
    cfg, ctx = model.config, model.config.n_ctx if ctx is None else ctx
    if not 1 <= ctx <= cfg.n_ctx:
        raise ValueError(f"sample_queries_keys: ctx={ctx}; need 1 <= ctx <= n_ctx = {cfg.n_ctx}")
    token_ids = as_token_ids(token_ids, ctx, "sample_queries_keys")
    n_win, pool = token_ids.numel() // ctx, 2 * ctx
    if n_win * pool < J:
        raise ValueError(
            f"sample_queries_keys: {n_win} windows of {ctx} tokens give {n_win * pool} "
            f"queries+keys per head, fewer than J={J}; pass more text or a smaller J"
        )
    windows = token_ids[: n_win * ctx].view(n_win, ctx)  # [W, ctx]
    drawn = torch.randperm(n_win * pool, generator=torch.Generator().manual_seed(seed))[:J]  # [J]
    win, slot = drawn // pool, drawn % pool  # [J], [J] window; ctx queries then ctx keys
    device = next(model.parameters()).device
    x = torch.empty(cfg.n_layer, cfg.n_head, J, cfg.head_dim, dtype=torch.float64)  # [L, H, J, d]
    for w0 in range(0, n_win, batch):
        mine = ((win >= w0) & (win < w0 + batch)).nonzero().flatten()  # [n] draws in these windows
        if len(mine):
            rows, slots = (win[mine] - w0).to(device), slot[mine].to(device)  # [n], [n]
            for layer, (q, k, _) in enumerate(capture(model, windows[w0 : w0 + batch].to(device))):
                picks = torch.cat((q, k), dim=2)[rows, :, slots]  # [n, H, d]
                x[layer, :, mine] = picks.transpose(0, 1).cpu().double()  # [H, n, d] on the host
    return x


def saturation_warning(dof, J):
    """A message when any head's DoF [L, H] exceeds J/2 (then J limits the estimate), else None."""
    if not (over := int((dof > J / 2).sum())):
        return None
    layer, head = divmod(int(dof.argmax()), dof.shape[-1])
    return (
        f"warning: {over} of {dof.numel()} heads have DoF above J/2 = {J / 2:g} "
        f"(largest {dof.max():.0f}, layer {layer} head {head}): J limits these estimates; "
        "use a larger J or a larger lam"
    )


def allocate(layer_dof, budget, rule="proportional", cap=None, aggregate="max", floor=1):
    """Per-layer feature dims [L] (steps 5-7), integers >= floor summing to exactly L·budget, from
    layer_dof [L] or per-head [L, H] (a layer's DoF: its heads' "max", one M, the paper; or "mean").
    rule "proportional" (the paper): M_l ∝ DoF_l; "power:γ", any finite γ: M_l ∝ DoF_l^γ ("power:1"
    is "proportional" exactly, "power:0" uniform; γ < 0 gives low-DoF layers more, as end-to-end
    error asks of GPT-2's first layer). Exact shares (fractions, each >= floor, 1 <= floor <=
    budget), then largest remainder, ties to more weight, then the earlier layer: more weight never
    gets fewer features, equal DoF equal shares (1 apart if a remainder tie straddles the cut).
    cap: min(M_l, cap), the freed budget dropped ("DoF + clip", the paper). Why γ < 1: if layer
    l's error is a_l·M^-β, the least summed error at fixed ΣM has M_l ∝ a_l^(1/(1+β)); with DoF as
    the M for a fixed error, w_l = a_l^(1/β), so γ = β/(1+β); for β <= 1 proportional never beats
    uniform on exact shares (a power-mean inequality; integer rounding can tip a near-tie)."""
    if aggregate not in ("max", "mean"):
        raise ValueError(f"allocate: aggregate {aggregate!r}; expected 'max' or 'mean'")
    kind, _, arg = rule.partition(":")
    try:
        gamma = 1.0 if rule == "proportional" else float(arg) if kind == "power" else math.nan
    except ValueError:
        gamma = math.nan
    if not math.isfinite(gamma):
        raise ValueError(f"allocate: rule {rule!r}; expected 'proportional' or 'power:γ', γ finite")
    dof = torch.as_tensor(layer_dof, dtype=torch.float64)  # [L] or [L, H]
    if dof.dim() == 2:
        dof = dof.amax(-1) if aggregate == "max" else dof.mean(-1)  # [L]
    if dof.dim() != 1 or len(dof) == 0 or not (torch.isfinite(dof) & (dof > 0)).all():
        raise ValueError(f"allocate: need positive finite layer_dof [L] or [L, H], got {layer_dof}")
    for name, n in (("budget", budget), ("cap", 1 if cap is None else cap)):
        if int(n) != n or n < 1:
            raise ValueError(f"allocate: {name} must be an integer >= 1, got {n}")
    if int(floor) != floor or not 1 <= floor <= budget:
        raise ValueError(f"allocate: floor must be an integer in [1, budget {budget}], got {floor}")
    weights = dof.pow(gamma)  # [L] x^1.0 is x exactly, so "power:1" is "proportional"
    if not (torch.isfinite(weights) & (weights > 0)).all():
        raise ValueError(f"allocate: rule {rule!r} takes DoF^{gamma:g} out of float64's range")
    weights = [Fraction(w) for w in weights.tolist()]
    total = len(weights) * int(budget)
    shares = _shares(weights, total, int(floor))
    dims = [math.floor(s) for s in shares]
    order = sorted(range(len(dims)), key=lambda i: (dims[i] - shares[i], -weights[i], i))
    for i in order[: total - sum(dims)]:  # largest remainder first
        dims[i] += 1
    return dims if cap is None else [min(m, cap) for m in dims]


def _shares(weights, total, floor=1):
    """Exact shares max(c·w, floor) summing to total: fix the layers whose share is below floor and
    share out the rest again until none is (c only falls, so a floored layer stays floored)."""
    floored = set()
    while True:
        free = [i for i in range(len(weights)) if i not in floored]
        c = (total - floor * len(floored)) / sum(weights[i] for i in free)
        low = {i for i in free if c * weights[i] < floor}
        if not low:
            return [max(c * w, floor) for w in weights]
        floored |= low
