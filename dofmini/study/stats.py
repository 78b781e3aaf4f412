"""Statistics over seeds, standard library only: two-sided Student t-intervals (s with n − 1 in
the denominator), paired differences, a bootstrap over the text's windows, a two-way bootstrap
over seeds and articles (or evaluation examples) with its p-value, Holm's step-down over a family
of tests, how far an interval clears 0, the share of Fix's degradation that DoF removes,
Spearman's ρ with a permutation p-value, the features a layer needs to reach a target error, and
a curve's error between its measured points."""

import itertools
import math
import random
from bisect import bisect_left, bisect_right
from typing import NamedTuple


def t_critical(level, df):
    """The t with P(|T| <= t) = level for integer df >= 1 (3.18245 for 0.95, 3): P(|T| <= t) is
    an exact finite sum in θ = atan(t/√df) (Abramowitz & Stegun 26.7.3-4), inverted by bisection."""
    if not 0 < level < 1 or int(df) != df or df < 1:
        raise ValueError(f"t_critical: need a level in (0, 1) and integer df >= 1: {level}, {df}")

    def central_mass(t):
        theta = math.atan(t / math.sqrt(df))
        odd, cos2 = df % 2, math.cos(theta) ** 2
        term = total = 1.0
        for k in range(1, df // 2):  # cos² powers weighted 2·4/(3·5)… for odd df, 1·3/(2·4)… even
            term *= cos2 * (2 * k + odd - 1) / (2 * k + odd)
            total += term
        if odd:  # df = 1 has no sum term
            return 2 / math.pi * (theta + (df > 1) * math.sin(theta) * math.cos(theta) * total)
        return math.sin(theta) * total

    lo, hi = 0.0, 1.0
    while central_mass(hi) < level:
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-13 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if central_mass(mid) < level else (lo, mid)
    return (lo + hi) / 2


def mean_ci(values, level=0.95):
    """(mean, half width of the t-interval) over the values, one per seed; one value has half
    width nan, which prints as "no interval" rather than as a spurious zero."""
    values = _finite("mean_ci: values", values)
    n = len(values)
    mean = math.fsum(values) / n
    if n == 1:
        return mean, math.nan
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, t_critical(level, n - 1) * sd / math.sqrt(n)


def paired_diff(a, b, level=0.95):
    """mean_ci of a[s] − b[s] over paired seeds s."""
    a, b = _paired("paired_diff", a, b)
    return mean_ci([x - y for x, y in zip(a, b)], level)


def window_bootstrap(rows, seed=0, draws=2000, level=0.95):
    """[low, high]: the percentile interval of the mean over seeds and windows when the text is
    drawn again. rows[s][w] is seed s's value on window w; every seed saw the same windows (and a
    paired difference is one row per seed of differences), so each draw takes one set of W window
    indices, with replacement, for all seeds, by random.Random(seed). The seeds stay fixed: this
    is the text's share of the uncertainty, beside mean_ci's over seeds."""
    rows = _bootstrap_rows("window_bootstrap", rows, draws, level)
    per_window = [math.fsum(column) / len(rows) for column in zip(*rows)]  # the seeds' mean
    rng, count = random.Random(seed), len(per_window)
    means = sorted(math.fsum(rng.choices(per_window, k=count)) / count for _ in range(draws))
    return list(_percentiles(means, level))


class Bootstrap(NamedTuple):
    """cluster_bootstrap's answer: the mean, its percentile interval [low, high], and the
    two-sided bootstrap p-value of a mean of 0."""

    mean: float
    low: float
    high: float
    p: float


def cluster_bootstrap(rows, clusters, seed=0, draws=2000, level=0.95) -> Bootstrap:
    """The Bootstrap of the mean over seeds and windows when both the seeds and the text's
    articles are drawn again. rows[s][w] is seed s's value on window w (a paired difference:
    rule − Fix on the same seed and window); clusters[w] is the article window w lies in. Each
    draw, by random.Random(seed), takes as many seeds as there are, with replacement, and as
    many articles, with replacement, every window of a drawn article coming along, and takes the
    mean over the drawn (seed, window) cells: an article drawn twice counts twice, each (seed,
    article) pair weighted by its windows. With one seed only the articles vary, with one article
    only the seeds. p = 2·min(share of draws <= 0, share >= 0), at least 1/draws, at most 1."""
    rows = _bootstrap_rows("cluster_bootstrap", rows, draws, level)
    clusters = list(clusters)
    windows = len(rows[0])
    if len(clusters) != windows:
        why = f"need one article per window ({windows}), got {len(clusters)}"
        raise ValueError(f"cluster_bootstrap: clusters: {why}")
    members = {}  # article: its windows, in first-seen order, so the draws are reproducible
    for w, article in enumerate(clusters):
        members.setdefault(article, []).append(w)
    sizes = [len(found) for found in members.values()]
    sums = [[math.fsum(row[w] for w in found) for found in members.values()] for row in rows]
    mean = math.fsum(map(math.fsum, sums)) / (len(rows) * windows)
    rng, seeds, articles = random.Random(seed), range(len(rows)), range(len(sizes))
    means = []
    for _ in range(draws):
        drawn_seeds = rng.choices(seeds, k=len(seeds))
        drawn = rng.choices(articles, k=len(articles))
        total = math.fsum(math.fsum(map(sums[s].__getitem__, drawn)) for s in drawn_seeds)
        cells = len(drawn_seeds) * sum(map(sizes.__getitem__, drawn))
        means.append(total / cells)
    means.sort()
    at_most_0 = bisect_right(means, 0.0) / draws
    at_least_0 = 1 - bisect_left(means, 0.0) / draws
    p = min(1.0, max(1 / draws, 2 * min(at_most_0, at_least_0)))
    return Bootstrap(mean, *_percentiles(means, level), p)


def holm(p_values, level=0.05) -> list:
    """Holm's step-down at family-wise error `level`: a list of bools, True where the hypothesis
    of p_values[k] is rejected. The k-th smallest p (from 1, of m) is rejected when it and every
    smaller one are <= level/(m − k + 1); ties keep their order, which changes nothing."""
    p_values = _finite("holm: p_values", p_values)
    if not all(0 <= p <= 1 for p in p_values) or not 0 < level < 1:
        why = f"need p-values in [0, 1] and a level in (0, 1), got {p_values}, {level}"
        raise ValueError(f"holm: {why}")
    count = len(p_values)
    rejected = [False] * count
    for rank, k in enumerate(sorted(range(count), key=p_values.__getitem__)):
        if p_values[k] > level / (count - rank):
            break
        rejected[k] = True
    return rejected


def clears_by(low, high) -> float:
    """The share of [low, high]'s width by which it lies clear of 0: the nearer end's distance
    from 0 over the width (0.1: a tenth of it), <= 0 where it holds 0, inf for a point off 0."""
    low, high = _finite("clears_by: low, high", [low, high])
    if high < low:
        raise ValueError(f"clears_by: need low <= high, got {low}, {high}")
    gap = max(low, -high)  # > 0 exactly where the interval excludes 0
    width = high - low
    if width == 0:
        return math.inf if gap > 0 else 0.0
    return gap / width


def at_edge(low, high, share=0.10) -> bool:
    """Whether [low, high] clears 0 by less than `share` of its width (clears_by); one that holds
    0 does not clear it at all, so is at the edge too."""
    return clears_by(low, high) < share


def share_removed(teacher, fix, dof, level=0.95):
    """(mean_ci of (fix_s − dof_s)/(fix_s − teacher) over seeds s, None), or (None, why not), for
    lower-better errors. Only where Fix is worse than the teacher beyond noise: the t-interval of
    fix_s − teacher and every seed's own gap lie above 0 (else a ratio divides by ~0 or flips
    sign). One seed has no interval, so never a ratio."""
    teacher = _finite("share_removed: teacher", [teacher])[0]
    fix, dof = _paired("share_removed", fix, dof, names=("fix", "dof"))
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
    """Pearson's r of the ranks, tied values sharing their average rank; nan when either sequence
    is constant (its ranks have no spread)."""
    x, y = _paired("spearman", x, y, names="xy", least=2, unit="values")
    mean = (len(x) + 1) / 2  # the mean of ranks 1..n, ties included

    def centred_ranks(values):  # 1-based ranks less their mean
        order = sorted(values)
        return [(bisect_left(order, v) + bisect_right(order, v) + 1) / 2 - mean for v in values]

    rx, ry = centred_ranks(x), centred_ranks(y)
    spread = math.sqrt(math.fsum(a * a for a in rx) * math.fsum(b * b for b in ry))
    return math.fsum(a * b for a, b in zip(rx, ry)) / spread if spread > 0 else math.nan


def permutation_p(x, y, seed=0, n=10000):
    """Two-sided: the share of orders of y whose |spearman| reaches the observed one (less 1e-12,
    lest rounding split equal values); nan where ρ is. Every order when len(y)! <= n (exact), else
    the observed and n drawn by random.Random(seed), so p = (1 + hits)/(1 + n) is never 0."""
    if int(n) != n or n < 1:
        raise ValueError(f"permutation_p: n must be an integer >= 1, got {n}")
    observed = abs(spearman(x, y))
    if math.isnan(observed):
        return math.nan
    y = list(y)
    if math.factorial(len(y)) <= n:
        orders = list(itertools.permutations(y))
    else:
        rng = random.Random(seed)
        orders = [y] + [rng.sample(y, len(y)) for _ in range(n)]
    return sum(abs(spearman(x, order)) >= observed - 1e-12 for order in orders) / len(orders)


def features_needed(ms, errors, target):
    """The M at which the curve errors[k] (measured at ms[k], strictly increasing) first reaches
    error <= target, the error linear in log M between the points around it; ms[0] when the first
    point already reaches it (read "ms[0] or fewer"); math.inf when no measured point does."""
    ms, errors = _paired("features_needed", ms, errors, names=("ms", "errors"), unit="points")
    if ms[0] <= 0 or any(b <= a for a, b in zip(ms, ms[1:])):
        raise ValueError(f"features_needed: ms must be positive and strictly increasing: {ms}")
    target = _finite("features_needed: target", [target])[0]
    reached = next((k for k, e in enumerate(errors) if e <= target), None)
    if reached is None:
        return math.inf
    if reached == 0:
        return ms[0]
    e0, e1 = errors[reached - 1], errors[reached]
    return ms[reached - 1] * (ms[reached] / ms[reached - 1]) ** ((e0 - target) / (e0 - e1))


def loglog_slope(x, y):
    """The least-squares slope of log y on log x: 1 where y ∝ x, −β for errors y = a·x^(−β)."""
    x, y = _paired("loglog_slope", x, y, names="xy", least=2, unit="values")
    lx, ly = [math.log(v) for v in x], [math.log(v) for v in y]
    mx, my = math.fsum(lx) / len(lx), math.fsum(ly) / len(ly)
    spread = math.fsum((a - mx) ** 2 for a in lx)
    return math.fsum((a - mx) * (b - my) for a, b in zip(lx, ly)) / spread if spread else math.nan


def loglog_at(ms, errors, m):
    """The error at m features of a curve measured at ms (strictly increasing, m within them):
    the power of M through the measured points around m, as oracle_allocate reads a curve."""
    ms, errors = _paired("loglog_at", ms, errors, names=("ms", "errors"), least=2, unit="points")
    if not ms[0] <= m <= ms[-1] or min(ms + errors) <= 0:
        raise ValueError(f"loglog_at: need positive ms and errors and m within ms: {m}, {ms}")
    k = min(bisect_right(ms, m), len(ms) - 1)  # the measured point at or above m
    frac = math.log(m / ms[k - 1]) / math.log(ms[k] / ms[k - 1])
    return errors[k - 1] * (errors[k] / errors[k - 1]) ** frac


def dof_predicts(dof, needed, cap, seed=0, n=10000):
    """How well DoF orders the features needed to reach a common error: (Spearman ρ, its
    permutation p, the log-log slope of needed on DoF, how many points the slope used). A point
    that never reached the target (inf) ranks last, at `cap`, and is left out of the slope."""
    ranked = [min(m, cap) for m in needed]
    rho, p = spearman(dof, ranked), permutation_p(dof, ranked, seed=seed, n=n)
    pairs = [(d, m) for d, m in zip(dof, needed) if math.isfinite(m)]
    slope = loglog_slope(*zip(*pairs)) if len(pairs) > 2 else math.nan
    return rho, p, slope, len(pairs)


def _finite(name, values):
    """values as a list of floats, or a ValueError naming them when empty or not all finite."""
    values = [float(v) for v in values]
    if not values or not all(map(math.isfinite, values)):
        raise ValueError(f"{name} must be a nonempty sequence of finite numbers, got {values}")
    return values


def _bootstrap_rows(caller, rows, draws, level):
    """rows as lists of finite floats, all of one nonzero length, or a ValueError naming the
    caller and the argument; likewise for draws (an integer >= 1) and level (in (0, 1))."""
    if int(draws) != draws or draws < 1 or not 0 < level < 1:
        why = f"need an integer draws >= 1 and a level in (0, 1), got {draws}, {level}"
        raise ValueError(f"{caller}: draws, level: {why}")
    rows = [_finite(f"{caller}: rows[{s}]", row) for s, row in enumerate(rows)]
    if not rows or len({len(row) for row in rows}) != 1:
        lengths = [len(row) for row in rows]
        raise ValueError(f"{caller}: rows: need rows of one length (one per seed), got {lengths}")
    return rows


def _percentiles(means, level):
    """(low, high): the percentile interval at `level` of the sorted bootstrap means."""
    tail = round((1 - level) / 2 * len(means))  # draws below the interval, and as many above it
    return means[tail], means[len(means) - 1 - tail]


def _paired(caller, a, b, names="ab", least=1, unit="seeds"):
    """a and b as lists of finite floats of one length >= least, or a ValueError naming them."""
    a = _finite(f"{caller}: {names[0]}", a)
    b = _finite(f"{caller}: {names[1]}", b)
    if len(a) != len(b) or len(a) < least:
        sizes = f"{names[0]} has {len(a)} {unit}, {names[1]} has {len(b)}"
        raise ValueError(f"{caller}: {sizes}; they must pair up (equal nonzero lengths >= {least})")
    return a, b
