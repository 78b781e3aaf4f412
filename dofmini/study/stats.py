"""Statistics over seeds for the report: t-intervals, paired differences, the share of Fix's
degradation that DoF removes, rank correlation, and the features a layer needs for a target error.

Standard library only. Every interval is a two-sided Student t-interval over seeds, mean ± t·s/√n
with s the sample standard deviation (n − 1 in the denominator) and t the quantile for n − 1
degrees of freedom, computed here rather than read from a table (see t_critical).
"""

import math


def t_critical(level, df):
    """Two-sided Student t critical value: the t with P(|T| <= t) = level for integer df >= 1.

    Computed, not tabulated: P(|T| <= t) for integer df has an exact finite sum in θ = atan(t/√df)
    (Abramowitz & Stegun 26.7.3 for odd df, 26.7.4 for even df); it rises monotonically in t, so
    bisection inverts it to double precision. t_critical(0.95, 3) = 3.18245, as in the tables.
    """
    if not 0 < level < 1:
        raise ValueError(f"t_critical: level must lie in (0, 1), got {level}")
    if int(df) != df or df < 1:
        raise ValueError(f"t_critical: df must be an integer >= 1, got {df}")
    lo, hi = 0.0, 1.0
    while _t_central_mass(hi, df) < level:
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-13 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_central_mass(mid, df) < level else (lo, mid)
    return (lo + hi) / 2


def _t_central_mass(t, df):
    """P(|T| <= t) for Student's t with integer df, by the finite sums of A&S 26.7.3-4."""
    theta = math.atan(t / math.sqrt(df))
    cos2 = math.cos(theta) ** 2
    term, total = 1.0, 1.0
    if df % 2:
        for k in range(1, (df - 1) // 2):
            term *= cos2 * 2 * k / (2 * k + 1)
            total += term
        tail = math.sin(theta) * math.cos(theta) * total if df > 1 else 0.0
        return 2 / math.pi * (theta + tail)
    for k in range(1, df // 2):
        term *= cos2 * (2 * k - 1) / (2 * k)
        total += term
    return math.sin(theta) * total


def mean_ci(values, level=0.95):
    """(mean, half_width) of the Student t-interval over the values (one per seed).

    One value gives half_width nan: a single seed carries no estimate of the spread, and a nan
    prints and plots as "no interval" rather than as a spurious zero.
    """
    values = _finite("mean_ci: values", values)
    n = len(values)
    mean = math.fsum(values) / n
    if n == 1:
        return mean, math.nan
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, t_critical(level, n - 1) * sd / math.sqrt(n)


def paired_diff(a, b, level=0.95):
    """(mean, half_width) of a[s] − b[s] over paired seeds s (both from the same seed)."""
    a, b = _finite("paired_diff: a", a), _finite("paired_diff: b", b)
    if len(a) != len(b):
        raise ValueError(f"paired_diff: a has {len(a)} seeds, b has {len(b)}; they must pair up")
    return mean_ci([x - y for x, y in zip(a, b)], level)


def share_removed(teacher, fix, dof, level=0.95):
    """The share of Fix's degradation that DoF removes, (fix − dof)/(fix − teacher).

    Returns (ci, reason). fix[s] and dof[s] are one seed's errors, lower being better (pass a score
    where higher is better negated); teacher is one number (the teacher has no seed).
    ci is (mean, half_width), the t-interval over the per-seed ratios, and reason is None; or ci is
    None and reason says why no ratio is given. The ratio is given only when Fix is worse than the
    teacher beyond noise: the lower end of the t-interval of fix_s − teacher is above 0, and so is
    every seed's own fix_s − teacher (a seed at or below the teacher would divide by ~0 or flip the
    sign of its ratio). One seed has no interval, so it never gives a ratio.
    """
    teacher = _finite("share_removed: teacher", [teacher])[0]
    fix, dof = _finite("share_removed: fix", fix), _finite("share_removed: dof", dof)
    if len(fix) != len(dof):
        raise ValueError(f"share_removed: fix has {len(fix)} seeds, dof has {len(dof)}")
    if len(fix) == 1:
        return None, "one seed: no interval, so Fix is not shown to be worse than the teacher"
    gap, gap_hw = mean_ci([f - teacher for f in fix], level)
    if gap - gap_hw <= 0:
        return None, (
            f"Fix is not worse than the teacher beyond noise: fix − teacher = {gap:.4g} ± "
            f"{gap_hw:.3g} ({level:.0%} t-interval over {len(fix)} seeds)"
        )
    if min(fix) <= teacher:
        return None, f"a seed's Fix error {min(fix):.4g} is not above the teacher's {teacher:.4g}"
    return mean_ci([(f - d) / (f - teacher) for f, d in zip(fix, dof)], level), None


def spearman(x, y):
    """Spearman rank correlation: Pearson's r of the ranks, tied values sharing their average rank.

    nan when either sequence is constant (its ranks have no spread, so no correlation is defined).
    """
    x, y = _finite("spearman: x", x), _finite("spearman: y", y)
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"spearman: x and y need equal lengths >= 2, got {len(x)} and {len(y)}")
    rx, ry = _ranks(x), _ranks(y)
    mean = (len(x) + 1) / 2  # the mean of ranks 1..n, ties included
    cov = math.fsum((a - mean) * (b - mean) for a, b in zip(rx, ry))
    spread = math.sqrt(
        math.fsum((a - mean) ** 2 for a in rx) * math.fsum((b - mean) ** 2 for b in ry)
    )
    return cov / spread if spread > 0 else math.nan


def _ranks(values):
    """1-based ranks, each run of equal values getting the average of the ranks it spans."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for i in order[start : end + 1]:
            ranks[i] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def features_needed(ms, errors, target):
    """The feature count M at which an error curve first reaches target (error <= target).

    errors[k] is the error measured with ms[k] features (ms strictly increasing). Between the last
    point above target and the first at or below it, the error is taken linear in log M, so the
    answer is ms[k-1]·(ms[k]/ms[k-1])^f with f the fraction of the error drop that reaches target.
    Returns ms[0] when the first point already reaches target (nothing below ms[0] was measured, so
    read it as "ms[0] or fewer"), and math.inf when no measured point reaches it.
    """
    ms, errors = _finite("features_needed: ms", ms), _finite("features_needed: errors", errors)
    if len(ms) != len(errors) or not ms:
        raise ValueError(
            f"features_needed: ms ({len(ms)}) and errors ({len(errors)}) need equal nonzero lengths"
        )
    if ms[0] <= 0 or any(b <= a for a, b in zip(ms, ms[1:])):
        raise ValueError(f"features_needed: ms must be positive and strictly increasing, got {ms}")
    target = _finite("features_needed: target", [target])[0]
    reached = next((k for k, e in enumerate(errors) if e <= target), None)
    if reached is None:
        return math.inf
    if reached == 0:
        return ms[0]
    e0, e1 = errors[reached - 1], errors[reached]
    return ms[reached - 1] * (ms[reached] / ms[reached - 1]) ** ((e0 - target) / (e0 - e1))


def _finite(name, values):
    """values as a list of floats, or a ValueError naming them when empty or not all finite."""
    values = [float(v) for v in values]
    if not values or not all(map(math.isfinite, values)):
        raise ValueError(f"{name} must be a nonempty sequence of finite numbers, got {values}")
    return values
