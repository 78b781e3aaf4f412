"""The oracle allocation: per-layer dims with the least summed error on measured error curves.
A study tool, not part of Algorithm 1: it needs every layer's error curve, measured by training
students at several feature dims, which Algorithm 1 exists to avoid."""

import math

import torch


def oracle_allocate(curves, budget, ms=None):
    """Per-layer dims in [ms[0], ms[-1]] summing to exactly L·budget with the least summed error.

    curves[l][k] is layer l's error (> 0) with ms[k] features (ms: K >= 2 strictly increasing
    integers >= 1; None: 1..K). Between measured points the error is the power of M through them
    (linear in log M and log error): measured curves fall by a near-constant factor per doubling,
    and straight lines in M would overstate every error, pinning the optimum to the measured Ms.
    The minimum is exact, by dynamic programming over layers (the least summed error of layers
    0..l for every total), not a greedy on marginal gains, which needs convex curves; on exact
    ties the earlier layers get the features."""
    try:
        errors = torch.as_tensor(curves, dtype=torch.float64)  # [L, K]
    except (TypeError, ValueError) as err:
        raise ValueError(f"oracle_allocate: curves must be an [L, K] table: {err}") from err
    if errors.dim() != 2 or errors.shape[0] < 1 or errors.shape[1] < 2:
        raise ValueError(f"oracle_allocate: curves must be [L >= 1, K >= 2]: {tuple(errors.shape)}")
    if not (torch.isfinite(errors) & (errors > 0)).all():
        raise ValueError("oracle_allocate: curves must hold finite positive errors")
    ms = list(range(1, errors.shape[1] + 1)) if ms is None else list(ms)
    integers = all(int(m) == m and m >= 1 for m in ms)
    if len(ms) != errors.shape[1] or not integers or any(b <= a for a, b in zip(ms, ms[1:])):
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
    rise = log_errors[:, seg + 1] - log_errors[:, seg]  # [L, R]
    dense = torch.exp(log_errors[:, seg] + frac * rise)  # [L, R] error at every M in range
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


def curves_record(errors: dict, ms, budgets, curve_only_seconds: float) -> dict:
    """The error curves' record from each seed's layer errors at each of `ms` features
    (errors[seed][k]), with the oracle allocation at each budget that the seeds' mean layer KL
    implies; each head's KL is kept for the per-head evidence."""
    kl = {seed: [e["kl"] for e in by_m] for seed, by_m in errors.items()}  # [M][layer]
    heads = {seed: [e["kl_heads"] for e in by_m] for seed, by_m in errors.items()}  # [M][L][H]
    found = dict(seed_mean_oracle(kl, ms, budgets), kl_heads=heads)
    return dict(found, curve_only_train_seconds=curve_only_seconds)


def seed_mean_oracle(kl: dict, ms, budgets) -> dict:
    """{"dims", "kl", "mean_kl" [layer][M], "oracle"}: the mean over seeds of curves kl[seed][M]
    [layer] measured at ms, and the oracle allocation on those means at each budget."""
    by_seed = list(kl.values())  # [seed][M][layer]; summed in seed order, as numpy's mean does
    layers = range(len(by_seed[0][0]))
    mean = [[sum(s[k][i] for s in by_seed) / len(by_seed) for k in range(len(ms))] for i in layers]
    oracle = {str(b): oracle_allocate(mean, b, ms=list(ms)) for b in budgets}
    return dict(dims=list(ms), kl=kl, mean_kl=mean, oracle=oracle)
