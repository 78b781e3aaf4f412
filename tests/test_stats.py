"""Seed statistics against hand-computed numbers, and the oracle allocation against brute force."""

import itertools
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dofmini.study.compare import against_fix
from dofmini.study.oracle import oracle_allocate
from dofmini.study.stats import (
    at_edge,
    clears_by,
    cluster_bootstrap,
    dof_predicts,
    features_needed,
    holm,
    loglog_at,
    loglog_slope,
    mean_ci,
    paired_diff,
    permutation_p,
    share_removed,
    spearman,
    t_critical,
    window_bootstrap,
)

FAST = settings(max_examples=60, deadline=None)
T_975_2 = 4.302653  # Student t quantile 0.975 for 2 degrees of freedom, from the printed tables


@pytest.mark.parametrize(
    "level, df, table",  # two-sided critical values as printed in standard t tables
    [(0.95, 1, 12.7062), (0.95, 2, 4.3027), (0.95, 3, 3.1824), (0.95, 10, 2.2281)]
    + [(0.95, 30, 2.0423), (0.95, 120, 1.9799), (0.99, 5, 4.0321), (0.90, 4, 2.1318)],
)
def test_t_critical_matches_the_tables(level, df, table):
    assert t_critical(level, df) == pytest.approx(table, abs=1e-4)


def test_t_critical_tends_to_the_normal_quantile():
    assert t_critical(0.95, 100_000) == pytest.approx(1.959964, abs=1e-4)


def test_mean_ci_of_one_to_four():
    # s = sqrt((2.25 + 0.25 + 0.25 + 2.25) / 3) = 1.290994; t(0.975, 3) = 3.182446 (tables)
    mean, half = mean_ci([1, 2, 3, 4])
    assert mean == 2.5
    assert half == pytest.approx(3.182446 * 1.290994 / 2, abs=1e-5)  # 2.054260
    assert half == pytest.approx(2.054260, abs=1e-5)


def test_mean_ci_of_one_seed_has_no_interval_and_bad_input_is_named():
    mean, half = mean_ci([0.7])
    assert mean == 0.7 and math.isnan(half)
    with pytest.raises(ValueError, match="mean_ci: values"):
        mean_ci([])
    with pytest.raises(ValueError, match="mean_ci: values"):
        mean_ci([1.0, math.nan])
    with pytest.raises(ValueError, match="level"):
        mean_ci([1.0, 2.0], level=95)


def test_paired_diff_by_hand():
    # differences 2, 3, 2: mean 7/3, s² = (1/9 + 4/9 + 1/9) / 2 = 1/3, half = t·sqrt(1/3)/sqrt(3)
    mean, half = paired_diff([3, 5, 4], [1, 2, 2])
    assert mean == pytest.approx(7 / 3)
    assert half == pytest.approx(T_975_2 / 3, abs=1e-5)
    with pytest.raises(ValueError, match="pair up"):
        paired_diff([1, 2], [1, 2, 3])


def test_share_removed_when_fix_is_clearly_worse():
    # fix − teacher = 1.0, 1.2, 0.8: mean 1, s 0.2, lower end 1 − 4.30·0.2/√3 = 0.50 > 0.
    # ratios (fix − dof)/(fix − teacher) = 1/2, 2/3, 1/2: mean 5/9, s² = (1/324 + 4/324 + 1/324)/2
    # = 1/108, half = t·sqrt(1/108)/sqrt(3) = t/18
    ci, reason = share_removed(1.0, [2.0, 2.2, 1.8], [1.5, 1.4, 1.4])
    assert reason is None
    assert ci[0] == pytest.approx(5 / 9)
    assert ci[1] == pytest.approx(T_975_2 / 18, abs=1e-6)


def test_share_removed_declines_a_ratio_of_noise():
    # fix − teacher = 0.1, −0.1, 0.3: mean 0.1, half 4.30·0.2/√3 = 0.50, so the lower end is < 0
    ci, reason = share_removed(1.0, [1.1, 0.9, 1.3], [1.0, 1.0, 1.0])
    assert ci is None and "not worse than the teacher" in reason
    ci, reason = share_removed(1.0, [2.0], [1.5])
    assert ci is None and "one seed" in reason
    # nine seeds at 2 and one at the teacher: the mean gap is clear (0.9 ± 0.23), one seed's is 0
    ci, reason = share_removed(1.0, [2.0] * 9 + [1.0], [1.5] * 10)
    assert ci is None and "not above the teacher" in reason
    with pytest.raises(ValueError, match="share_removed: fix has 2 seeds, dof has 1"):
        share_removed(1.0, [2.0, 2.0], [1.0])


def test_spearman_with_ties_by_hand():
    # ranks x = 1, 2.5, 2.5, 4 and y = 1, 3, 2, 4 around 2.5: cov 4.5, Sxx 4.5, Syy 5
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / math.sqrt(4.5 * 5))
    assert spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError, match="spearman"):
        spearman([1, 2], [1, 2, 3])


@FAST
@given(st.lists(st.integers(-1000, 1000), min_size=2, max_size=12, unique=True))
def test_spearman_is_one_under_any_increasing_map(x):
    assert spearman(x, [v**3 + 7 for v in x]) == pytest.approx(1.0)
    assert spearman(x, [-v for v in x]) == pytest.approx(-1.0)


def test_permutation_p_by_hand():
    # 6! = 720 <= 10000 orders: exact. Only the identity and the reversal reach |rho| = 1.
    assert permutation_p(range(1, 7), range(1, 7)) == 2 / 720
    assert permutation_p([1, 2, 3], [3, 1, 2]) == 1.0  # rho −0.5; all 6 orders have |rho| >= 0.5
    assert math.isnan(permutation_p([1, 1, 1], [1, 2, 3]))
    # 8! > 1000: the observed order and 1000 seeded draws, each at |rho| = 1 with chance 2/8!
    ordered = permutation_p(range(8), range(8), n=1000, seed=3)
    assert ordered == permutation_p(range(8), range(8), n=1000, seed=3) and ordered <= 3 / 1001
    assert ordered >= 1 / 1001  # the observed order always counts, so p is never 0
    with pytest.raises(ValueError, match="permutation_p: n must be an integer >= 1"):
        permutation_p([1, 2], [1, 2], n=0)


def student(kl, output_rel, ppl):
    """A student result with per-layer errors (no kernel error) and both perplexities."""
    errors = {"kl": kl, "output_rel": output_rel, "kernel_l2": [None] * len(kl)}
    return {"layer_error": errors, "wikitext2_ppl": ppl, "heldout_ppl": ppl}


def test_against_fix_takes_each_seeds_worst_layer_then_pairs_seeds():
    # Fix's layer KLs by seed: worst layers 3, 2, 4 (mean 3, s 1); layer means 2, 2, 2.
    # DoF's: worst 5, 3, 6, paired differences 2, 1, 2 (mean 5/3, s² 1/3, half t·√(1/3)/√3 = t/3)
    # The worst layer of the seed-averaged KL (Fix: 7/3) is not what is reported.
    fix = {s: student(kl, [1, 1], 10.0 + s) for s, kl in enumerate([[1, 3], [2, 2], [4, 0]])}
    dof = {s: student(kl, [2, 1], 11.0 + s) for s, kl in enumerate([[2, 5], [1, 3], [6, 2]])}
    dof[7] = student([9, 9], [9, 9], 99.0)  # a seed Fix lacks drops out of the pairing
    rows = {label: rest for label, *rest in against_fix(fix, dof)}
    assert list(rows) == ["mean KL", "worst-layer KL", "mean output error"] + [
        "worst-layer output error", "WikiText-2 ppl", "held-out ppl"]  # fmt: skip
    fix_ci, dof_ci, diff, relative = rows["worst-layer KL"]
    assert fix_ci == pytest.approx((3, T_975_2 / math.sqrt(3)))
    assert dof_ci[0] == pytest.approx(14 / 3) and relative == pytest.approx(14 / 9 - 1)
    assert diff == pytest.approx((5 / 3, T_975_2 / 3))
    assert rows["mean KL"][0] == (2.0, 0.0) and rows["mean KL"][1][0] == pytest.approx(19 / 6)
    assert rows["worst-layer output error"][2] == (1.0, 0.0)  # 2 − 1 on every seed
    assert rows["held-out ppl"][2] == (1.0, 0.0)


def test_features_needed_interpolates_in_log_m():
    ms, errors = [8, 16, 32], [1.0, 0.5, 0.1]
    # 0.3 is half the drop from 16 to 32 features, so the answer is 16·2^0.5
    assert features_needed(ms, errors, 0.3) == pytest.approx(16 * math.sqrt(2))
    assert features_needed(ms, errors, 0.5) == pytest.approx(16)
    assert features_needed(ms, errors, 2.0) == 8  # already reached at the smallest measured M
    assert features_needed(ms, errors, 0.05) == math.inf
    with pytest.raises(ValueError, match="strictly increasing"):
        features_needed([8, 8, 32], errors, 0.3)
    with pytest.raises(ValueError, match="equal nonzero lengths"):
        features_needed([8, 16], errors, 0.3)


def test_loglog_slope_recovers_a_power_law():
    ms = [8, 16, 32, 64]
    assert loglog_slope(ms, [3 * m**-0.7 for m in ms]) == pytest.approx(-0.7)
    assert loglog_slope([1, 2, 4], [2, 8, 8]) == pytest.approx(1.0)  # log2: x 0 1 2, y 1 3 3
    assert math.isnan(loglog_slope([2, 2], [1, 5]))  # no spread in x
    with pytest.raises(ValueError, match="loglog_slope: x must be .* finite"):
        loglog_slope([1, math.inf], [1, 2])


def test_dof_predicts_ranks_a_never_reached_point_last_and_leaves_it_out_of_the_slope():
    dof, needed = [10, 20, 40, 80], [8, 16, 32, math.inf]
    rho, p, slope, used = dof_predicts(dof, needed, cap=129)
    assert rho == pytest.approx(1.0) and p == pytest.approx(2 / 24)  # 4! orders, two at |ρ| = 1
    assert slope == pytest.approx(1.0) and used == 3
    rho, p, slope, used = dof_predicts([10, 20, 40], [32, 16, 8], cap=129)
    assert rho == pytest.approx(-1.0) and slope == pytest.approx(-1.0) and used == 3
    assert math.isnan(dof_predicts([1, 2, 3], [8, math.inf, math.inf], cap=9)[2])  # 1 point


def power_law(errors, ms, m):
    """The error at m on the power of M through the measured points (linear in log-log)."""
    return float(np.exp(np.interp(np.log(m), np.log(ms), np.log(errors))))


def summed_error(curves, ms, dims):
    """The objective, by numpy's own interpolation in log-log."""
    return sum(power_law(errors, ms, m) for errors, m in zip(curves, dims))


def brute_force(curves, ms, budget):
    """The least summed error over every integer allocation within [ms[0], ms[-1]]."""
    grid = range(ms[0], ms[-1] + 1)
    tables = [{m: power_law(errors, ms, m) for m in grid} for errors in curves]
    return min(
        sum(t[m] for t, m in zip(tables, dims))
        for dims in itertools.product(grid, repeat=len(curves))
        if sum(dims) == len(curves) * budget
    )


def check_oracle(curves, ms, budget):
    dims = oracle_allocate(curves, budget, ms)
    assert sum(dims) == len(curves) * budget
    assert all(ms[0] <= m <= ms[-1] and isinstance(m, int) for m in dims)
    assert summed_error(curves, ms, dims) == pytest.approx(brute_force(curves, ms, budget))


SMALL_MS = [1, 2, 4, 8]
POSITIVE = st.floats(1e-3, 10)
CURVE = st.lists(POSITIVE, min_size=len(SMALL_MS), max_size=len(SMALL_MS))


@FAST
@given(
    st.integers(2, 4).flatmap(lambda n: st.lists(CURVE, min_size=n, max_size=n)), st.integers(1, 8)
)
def test_oracle_matches_brute_force_on_decreasing_curves(curves, budget):
    check_oracle([sorted(c, reverse=True) for c in curves], SMALL_MS, budget)


@FAST
@given(
    st.integers(2, 4).flatmap(lambda n: st.lists(CURVE, min_size=n, max_size=n)), st.integers(1, 8)
)
def test_oracle_matches_brute_force_on_any_curves(curves, budget):
    check_oracle(curves, SMALL_MS, budget)


@FAST
@given(
    st.integers(1, 12).flatmap(
        lambda n: st.lists(
            st.lists(st.floats(1e-6, 1), min_size=5, max_size=5), min_size=n, max_size=n
        )
    ),
    st.integers(8, 128),
)
def test_oracle_spends_the_exact_budget(curves, budget):
    dims = oracle_allocate(curves, budget, [8, 16, 32, 64, 128])
    assert sum(dims) == len(curves) * budget and all(8 <= m <= 128 for m in dims)


def test_oracle_by_hand_where_the_greedy_fails():
    # layer 0 gains nothing from its 2nd feature and ~10 from its 3rd; layer 1 gains 1 then 0.5. A
    # greedy on marginal gains feeds layer 1 twice (summed error 10 + 8.5); the optimum is [3, 1].
    assert oracle_allocate([[10, 10, 0.001], [10, 9, 8.5]], 2) == [3, 1]
    # between M = 1 and 3 layer 0 falls 8-fold and layer 1 2-fold. On the power laws through
    # them, [2, 2] sums 8^(1-p) + 2^(1-p) = 3.45 (p = log 2 / log 3) and [3, 1] sums 1 + 2 = 3:
    # both spare features go to layer 0
    assert oracle_allocate([[8, 1], [2, 1]], 2, ms=[1, 3]) == [3, 1]
    assert oracle_allocate([[1.0, 0.5], [1.0, 0.5]], 2) == [2, 2]


def test_oracle_interpolates_a_power_law_exactly():
    # errors c/M measured at 8 and 128 only: the optimum of Σ c_l/M_l at a fixed sum is
    # M_l ∝ sqrt(c_l), here 1 : 2 of 48 features, which a straight line in M would not find
    curves = [[1 / 8, 1 / 128], [4 / 8, 4 / 128]]
    assert oracle_allocate(curves, 24, ms=[8, 128]) == [16, 32]


def test_oracle_ties_go_to_the_earlier_layer():
    assert oracle_allocate([[3, 2, 1], [3, 2, 1]], 2, ms=[1, 2, 3]) == [3, 1]


@pytest.mark.parametrize(
    "curves, budget, ms, match",
    [
        ([[1.0, 0.5]], 3, [1, 2], r"budget must be an integer in \[1, 2\], got 3"),
        ([[1.0, 0.5]], 1.5, [1, 2], "budget must be an integer"),
        ([[1.0, 0.5], [1.0]], 1, [1, 2], r"\[L, K\] table"),
        ([[1.0]], 1, [1], "K >= 2"),
        ([[1.0, math.inf]], 1, [1, 2], "finite positive"),
        ([[1.0, 0.0]], 1, [1, 2], "finite positive"),
        ([[1.0, 0.5]], 1, [1, 2, 4], "one per column"),
        ([[1.0, 0.5]], 2, [2, 2], "strictly increasing"),
        ([[1.0, 0.5]], 1, [0, 2], "integers >= 1"),
    ],
)
def test_oracle_rejects_bad_input_by_name(curves, budget, ms, match):
    with pytest.raises(ValueError, match=match):
        oracle_allocate(curves, budget, ms)


def test_window_bootstrap_of_two_windows_spans_them():
    # a draw's mean is a (p 1/4), (a + b)/2 (1/2) or b (1/4): 2.5% and 97.5% points are a and b
    assert window_bootstrap([[1.0, 3.0], [3.0, 5.0]], seed=0, draws=2000) == [2.0, 4.0]
    assert window_bootstrap([[7.0]], seed=5, draws=10) == [7.0, 7.0]  # one window: no spread


@FAST
@given(
    st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=12),
    st.floats(-1e3, 1e3),
    st.integers(0, 2**31),
)
def test_window_bootstrap_lies_within_the_windows_and_follows_a_shift(values, shift, seed):
    rows = [values, [v + 1.0 for v in values]]  # two seeds; the per-window mean is v + 0.5
    low, high = window_bootstrap(rows, seed=seed, draws=200)
    assert min(values) + 0.5 - 1e-9 <= low <= high <= max(values) + 0.5 + 1e-9
    moved = window_bootstrap([[v + shift for v in row] for row in rows], seed=seed, draws=200)
    assert moved == pytest.approx([low + shift, high + shift], abs=1e-6)
    assert window_bootstrap(rows, seed=seed, draws=200) == [low, high]  # seeded: the same again


@pytest.mark.parametrize(
    "rows, kwargs",
    [([[1.0], [1.0, 2.0]], {}), ([], {}), ([[1.0, math.nan]], {}), ([[1.0]], {"draws": 0})]
    + [([[1.0]], {"level": 1.0})],
)
def test_window_bootstrap_refuses_bad_input(rows, kwargs):
    with pytest.raises(ValueError, match="window_bootstrap"):
        window_bootstrap(rows, **kwargs)


def test_loglog_at_is_the_power_through_the_points_around_m():
    ms, errors = [8, 32, 128], [1.0, 0.25, 0.125]
    assert loglog_at(ms, errors, 8) == 1.0 and loglog_at(ms, errors, 128) == 0.125
    assert loglog_at(ms, errors, 16) == pytest.approx(0.5)  # half way in log M: √(1·0.25)
    assert loglog_at(ms, errors, 64) == pytest.approx(0.125 * 2**0.5)
    with pytest.raises(ValueError, match="loglog_at"):
        loglog_at(ms, errors, 4)


def test_cluster_bootstrap_weights_an_article_by_its_windows():
    # one seed: only the articles vary. Article A has windows 0, 0, 0 and B one window of 4: the
    # mean over cells is 1. Two articles drawn: AA (p 1/4) has mean 0, AB (1/2) 4/4 = 1 (not
    # the articles' mean 2), BB (1/4) 4; so the 2.5% and 97.5% points are 0 and 4, about a
    # quarter of the draws are <= 0 and all >= 0: p = 2·min(≈1/4, 1) ≈ 1/2.
    found = cluster_bootstrap([[0.0, 4.0, 0.0, 0.0]], ["A", "B", "A", "A"], seed=1, draws=2000)
    assert (found.mean, found.low, found.high) == (1.0, 0.0, 4.0)
    assert found.p == pytest.approx(0.5, abs=0.05)
    assert cluster_bootstrap([[0.0, 4.0, 0.0, 0.0]], "ABAA", seed=1, draws=2000) == found


def test_cluster_bootstrap_of_one_article_draws_only_seeds_and_floors_p():
    # one window: the seeds' values 1 and 3 give means 1, 2, 3 as two windows would
    found = cluster_bootstrap([[1.0], [3.0]], [0], seed=0, draws=2000)
    assert found == (2.0, 1.0, 3.0, 1 / 2000)  # no draw reaches 0: p is floored at 1/draws
    assert cluster_bootstrap([[5.0]], [0], draws=10) == (5.0, 5.0, 5.0, 1 / 10)
    assert cluster_bootstrap([[0.0]], [0], draws=10).p == 1.0  # every draw is both <= and >= 0


def made_up_differences(rng, true, seed_sd, article_sd, noise_sd):
    """(rows, clusters): 5 seeds' per-window differences true + seed effect + article effect +
    window noise (normal, each sd given) on 20 articles of 1 to 8 windows."""
    sizes = [rng.randint(1, 8) for _ in range(20)]
    clusters = [article for article, size in enumerate(sizes) for _ in range(size)]
    article_effects = [rng.gauss(0, article_sd) for _ in sizes]
    rows = []
    for _ in range(5):
        seed_effect = rng.gauss(0, seed_sd)
        noise = [rng.gauss(0, noise_sd) for _ in clusters]
        rows.append([true + seed_effect + article_effects[a] + e for a, e in zip(clusters, noise)])
    return rows, clusters


def test_cluster_bootstrap_covers_where_the_seeds_alone_do_not():
    # the article effects are shared by every seed, so the per-seed means do not vary with them
    # and the seeds' t-interval leaves them out; the two-way bootstrap draws the articles again.
    # Most of the mean's variance is the articles' (≈ 1²·Σn²/N² ≈ 0.06 against seeds' 0.2²/5).
    # Over 1000 repetitions the combined interval covered 0.95, the seeds-only one 0.75: the
    # bounds leave room for 200's noise (sd ≈ 0.015)
    true, repetitions = 0.3, 200
    covered = seeds_covered = 0
    for rep in range(repetitions):
        rows, clusters = made_up_differences(random.Random(rep), true, 0.2, 1.0, 2.0)
        found = cluster_bootstrap(rows, clusters, seed=10_000 + rep, draws=500)
        covered += found.low <= true <= found.high
        per_seed = [math.fsum(row) / len(row) for row in rows]
        mean, half = paired_diff(per_seed, [0.0] * len(per_seed))
        seeds_covered += mean - half <= true <= mean + half
    assert 0.88 <= covered / repetitions <= 0.99
    assert seeds_covered / repetitions <= covered / repetitions - 0.10


@pytest.mark.parametrize(
    "rows, clusters, kwargs, match",
    [
        ([[1.0], [1.0, 2.0]], [0, 1], {}, r"cluster_bootstrap: rows: need rows of one length"),
        ([], [], {}, r"cluster_bootstrap: rows: need rows of one length"),
        ([[1.0, math.inf]], [0, 1], {}, r"cluster_bootstrap: rows\[0\] must be .* finite"),
        ([[1.0, 2.0]], [0], {}, r"cluster_bootstrap: clusters: need one article per window \(2\)"),
        ([[1.0]], [0], {"draws": 0}, r"cluster_bootstrap: draws, level: need an integer draws"),
        ([[1.0]], [0], {"level": 95}, r"cluster_bootstrap: draws, level: .* level in \(0, 1\)"),
    ],
)
def test_cluster_bootstrap_names_the_bad_argument(rows, clusters, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cluster_bootstrap(rows, clusters, **kwargs)


def test_holm_by_hand():
    # p = 0.01, 0.04, 0.03, 0.5 at 0.05, m = 4. Sorted: 0.01 <= 0.05/4 = 0.0125, rejected; then
    # 0.03 > 0.05/3 = 0.0167, so it and every larger p (0.04, 0.5) stand.
    assert holm([0.01, 0.04, 0.03, 0.5]) == [True, False, False, False]
    # m = 3: 0.001 <= 0.05/3, rejected; 0.03 > 0.05/2 = 0.025 stops the steps, so 0.04 stands
    # though it is <= 0.05/1, the last step's bound
    assert holm([0.04, 0.001, 0.03]) == [False, True, False]
    # 0.001 <= 0.05/4, 0.01 <= 0.05/3, 0.02 <= 0.05/2, 0.04 <= 0.05: all rejected
    assert holm([0.02, 0.04, 0.001, 0.01]) == [True, True, True, True]
    assert holm([0.04], level=0.05) == [True] and holm([0.06]) == [False]
    with pytest.raises(ValueError, match=r"holm: need p-values in \[0, 1\]"):
        holm([0.01, 1.5])
    with pytest.raises(ValueError, match="holm: p_values must be a nonempty"):
        holm([])


def test_clears_by_and_at_edge():
    # [0.05, 1.05]: the nearer end is 0.05 from 0, a width of 1: 5%, at the edge (< 10%)
    assert clears_by(0.05, 1.05) == pytest.approx(0.05) and at_edge(0.05, 1.05)
    assert clears_by(-1.2, -0.2) == pytest.approx(0.2) and not at_edge(-1.2, -0.2)
    assert at_edge(-1.2, -0.2, share=0.25)
    assert clears_by(-0.5, 1.5) == pytest.approx(-0.25) and at_edge(-0.5, 1.5)  # holds 0
    assert clears_by(2.0, 2.0) == math.inf and clears_by(-2.0, -2.0) == math.inf
    assert clears_by(0.0, 0.0) == 0.0
    with pytest.raises(ValueError, match="clears_by: need low <= high"):
        clears_by(1.0, 0.0)
    with pytest.raises(ValueError, match="clears_by: low, high must be"):
        clears_by(math.nan, 1.0)
