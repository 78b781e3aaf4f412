"""Degrees of freedom (against independent numpy formulas) and the budget allocator (Hypothesis),
and the estimate on the stand-in teachers."""

import math
import re

import numpy as np
import pytest
import torch
from conftest import shared_path
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dofmini.dof import (
    allocate,
    degrees_of_freedom,
    estimate_dof,
    sample_queries_keys,
    saturation_warning,
)
from dofmini.study.oracle import oracle_allocate

FAST = settings(max_examples=60, deadline=None)


def points(seed, J, d, scale, dups):
    """J random rows, the last `dups` of them copies of earlier ones (so the Gram can lose rank)."""
    x = (
        torch.randn(J, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        * scale
    )  # [J, d]
    x[J - dups :] = x[:dups]
    return x


def naive(x, lam, normalize):
    """DoF by the book: the Gram in plain float64, numpy's eigvalsh, Σ σ/(σ+λ).

    inf where the Gram overflows.
    """
    x = np.asarray(x, dtype=np.float64)
    J, d = x.shape
    with np.errstate(over="ignore"):
        gram = np.exp(x @ x.T / math.sqrt(d))
    if not np.isfinite(gram).all():
        return math.inf, None
    op = gram / J if normalize else gram
    sig = np.clip(
        np.linalg.eigvalsh(op), 0, None
    )  # a PSD matrix: negative eigenvalues are rounding
    return float((sig / (sig + lam)).sum()), op


cases = st.tuples(
    st.integers(0, 2**31),
    st.integers(1, 24),
    st.integers(1, 8),
    st.floats(0.05, 1.5),
    st.integers(0, 6),
    st.integers(-12, 4),
    st.booleans(),
)


@FAST
@given(cases)
def test_dof_matches_eigenvalue_formula_and_trace_identity(case):
    seed, J, d, scale, dups, log2_lam, normalize = case
    x, lam = points(seed, J, d, scale, min(dups, J // 2)), 2.0**log2_lam
    dof = degrees_of_freedom(x, lam, normalize).item()
    ref, op = naive(x, lam, normalize)
    assert dof == pytest.approx(ref, rel=1e-7, abs=1e-8)
    trace_form = J - lam * np.trace(
        np.linalg.inv(op + lam * np.eye(J))
    )  # tr Σ̂(Σ̂+λI)⁻¹ = J − λ·tr (Σ̂+λI)⁻¹
    assert dof == pytest.approx(trace_form, rel=1e-7, abs=1e-7)
    assert 0 <= dof <= np.linalg.matrix_rank(op) + 1e-7 <= J + 1e-7


@FAST
@given(cases, st.floats(1.01, 64))
def test_dof_decreases_as_lam_grows(case, factor):
    seed, J, d, scale, dups, log2_lam, normalize = case
    x, lam = points(seed, J, d, scale, min(dups, J // 2)), 2.0**log2_lam
    assert (
        degrees_of_freedom(x, lam * factor, normalize)
        <= degrees_of_freedom(x, lam, normalize) + 1e-9
    )


@FAST
@given(cases, st.floats(0, 700))
@example((0, 16, 4, 1.0, 0, -4, False), 705.0)  # the shifted raw Gram overflows float64
def test_dof_is_finite_and_exact_where_the_naive_gram_overflows(case, shift):
    # Appending one coordinate a to every point adds a² to every x_iᵀx_j, so G' = e^c·G with
    # c = a²/√d, and the raw Gram's DoF at λ·e^c equals the unshifted one at λ. Large c overflows
    # the naive float64 Gram.
    seed, J, d, scale, dups, log2_lam, _ = case
    x, lam = points(seed, J, d, scale, min(dups, J // 2)), 2.0**log2_lam
    shifted = torch.cat(
        (x, torch.full((J, 1), math.sqrt(shift * math.sqrt(d + 1)), dtype=torch.float64)), 1
    )
    dof = degrees_of_freedom(shifted, lam * math.exp(shift), normalize=False).item()
    ref, _ = naive(torch.cat((x, torch.zeros(J, 1, dtype=torch.float64)), 1), lam, normalize=False)
    assert math.isfinite(dof) and dof == pytest.approx(ref, rel=1e-6, abs=1e-6)
    direct, _ = naive(shifted, lam * math.exp(shift), normalize=False)
    if math.isfinite(direct):
        assert dof == pytest.approx(direct, rel=1e-6, abs=1e-6)


def test_dof_keeps_small_norm_points_beside_huge_ones():
    # Orthogonal points: G = 11ᵀ − I + diag(e^sᵢ) ⪰ diag(e^sᵢ) − I, so with every sᵢ >= 40 each
    # eigenvalue dwarfs λ and DoF = J to 1e-10.
    # Scaling G by its largest entry (e^600) alone would leave about 1.
    J = 12
    s = torch.linspace(40, 600, J, dtype=torch.float64)
    x = torch.diag((s * math.sqrt(J)).sqrt())  # [J, J], ‖xᵢ‖²/√d = sᵢ
    assert degrees_of_freedom(x, 2**-4).item() == pytest.approx(J, abs=1e-9)


def test_dof_is_batched_over_heads_and_rejects_bad_input():
    x = points(3, 30, 8, 1.0, 0).reshape(2, 3, 5, 8)  # [2, 3, 5, 8]: six heads of five points
    batched = degrees_of_freedom(x, 0.1)
    assert batched.shape == (2, 3)
    assert batched[1, 2].item() == pytest.approx(degrees_of_freedom(x[1, 2], 0.1).item(), rel=1e-12)
    for bad in (
        lambda: degrees_of_freedom(torch.ones(4), 0.1),
        lambda: degrees_of_freedom(x, 0.0),
        lambda: degrees_of_freedom(torch.full((3, 2), math.nan), 0.1),
    ):
        with pytest.raises(ValueError):
            bad()


dofs = st.lists(
    st.one_of(st.floats(1e-3, 1e4), st.sampled_from([1.0, 7.5, 100.0])), min_size=1, max_size=24
)


def assert_monotone(dof, dims):
    assert all(
        dims[i] >= dims[j] for i in range(len(dof)) for j in range(len(dof)) if dof[i] > dof[j]
    )


@FAST
@given(dofs, st.integers(1, 200))
def test_allocate_exact_sum_floor_monotone_proportional(dof, budget):
    dims = allocate(dof, budget)
    total = len(dof) * budget
    assert sum(dims) == total and min(dims) >= 1 and all(isinstance(m, int) for m in dims)
    assert_monotone(dof, dims)
    assert all(
        abs(dims[i] - dims[j]) <= 1
        for i in range(len(dof))
        for j in range(len(dof))
        if dof[i] == dof[j]
    )
    if min(dof) * total >= sum(
        dof
    ):  # no layer needs the floor: largest remainder keeps every M within 1 of its quota
        assert all(abs(m - total * w / sum(dof)) < 1 + 1e-9 for m, w in zip(dims, dof))


RULES = st.one_of(
    st.just("proportional"),
    st.sampled_from(["power:0", "power:0.5", "power:1", "power:2"]),
    st.floats(0, 3).map(lambda g: f"power:{g}"),
)


@FAST
@given(dofs, st.integers(1, 200), st.integers(1, 300), RULES)
def test_every_rule_keeps_the_exact_budget_and_clip_drops_the_excess(dof, budget, cap, rule):
    plain = allocate(dof, budget, rule)
    assert sum(plain) == len(dof) * budget and min(plain) >= 1
    assert all(isinstance(m, int) for m in plain)
    assert_monotone(dof, plain)
    clipped = allocate(dof, budget, rule, cap=cap)
    assert clipped == [min(m, cap) for m in plain]  # the paper's DoF + clip: the excess is dropped


@FAST
@given(dofs, st.integers(1, 200), st.sampled_from([None, 1, 50]))
def test_power_1_is_proportional_exactly(dof, budget, cap):
    assert allocate(dof, budget, "power:1", cap) == allocate(dof, budget, cap=cap)
    assert allocate(dof, budget, "power:0") == [budget] * len(dof)  # γ = 0: uniform


@FAST
@given(st.floats(1e-3, 1e4), st.integers(1, 24), st.integers(1, 200), st.integers(1, 300))
def test_allocate_equal_dof_gives_equal_dims(value, layers, budget, cap):
    assert allocate([value] * layers, budget) == [budget] * layers
    assert allocate([value] * layers, budget, cap=cap) == [min(budget, cap)] * layers
    assert allocate([value] * layers, budget, "power:0.5") == [budget] * layers


def summed_power_law_error(a, beta, dims):
    return sum(x * m ** (-beta) for x, m in zip(a, dims))


# Layer l's error a_l·M^-β; its "difficulty" w_l = a_l^(1/β) is the M that reaches error 1 (what
# DoF stands for). Least summed error at a fixed ΣM: M_l ∝ a_l^(1/(1+β)) = w_l^(β/(1+β)).
power_laws = st.tuples(
    st.lists(st.floats(0.5, 2), min_size=2, max_size=8),  # u_l: the optimal M_l ∝ u_l
    st.floats(0.25, 2),  # β
    st.integers(32, 64),  # budget: every optimal M_l then lies in [8, 128]
)


@FAST
@given(power_laws)
def test_power_rule_with_gamma_beta_over_1_plus_beta_matches_the_oracle(case):
    u, beta, budget = case
    a = [x ** (1 + beta) for x in u]
    difficulty = [x ** (1 / beta) for x in a]
    dims = allocate(difficulty, budget, f"power:{beta / (1 + beta)!r}")
    ms = [8, 16, 32, 64, 128]
    curves = [[x * m ** (-beta) for m in ms] for x in a]
    best = oracle_allocate(curves, budget, ms)
    got, least = (summed_power_law_error(a, beta, d) for d in (dims, best))
    assert got <= 1.01 * least, (dims, best)


@FAST
@given(st.lists(st.floats(0.1, 10), min_size=2, max_size=8), st.floats(0.25, 1))
def test_proportional_never_beats_uniform_when_beta_is_at_most_1(a, beta):
    # On exact shares, Σ a_l·M_l^-β at M ∝ a^(1/β) over that at M uniform is (power mean of a of
    # order 1/β / arithmetic mean of a)^β >= 1 for β <= 1, equal at β = 1. Rounding a share M by
    # less than 1 moves its error by less than a factor 1 ± 2β/M: at a budget of 10^6 that is the
    # only slack, where at small budgets it can tip a near-tie.
    budget = 10**6
    proportional = allocate([x ** (1 / beta) for x in a], budget)
    slack = 2 * beta / min(proportional)
    uniform = [budget] * len(a)
    assert summed_power_law_error(a, beta, proportional) >= summed_power_law_error(
        a, beta, uniform
    ) * (1 - slack)


def test_allocate_takes_max_or_mean_over_heads_and_rejects_bad_input():
    per_head = torch.tensor([[3.0, 50.0], [20.0, 1.0], [9.0, 9.0]])  # [L, H]
    assert allocate(per_head, 64) == allocate([50.0, 20.0, 9.0], 64) == [121, 49, 22]
    assert allocate(per_head, 64, aggregate="mean") == allocate([26.5, 10.5, 9.0], 64)
    assert allocate([1.0, 1.0, 1000.0], 2) == [1, 1, 4]  # the floor of one feature, sum still exact
    assert allocate([1.0, 4.0], 30, "power:0.5") == [20, 40]
    for bad in (([0.0, 1.0], 4, None), ([1.0, math.inf], 4, None), ([1.0], 0, None), ([1.0], 4, 0)):
        with pytest.raises(ValueError):
            allocate(bad[0], bad[1], cap=bad[2])
    for rule in ("sqrt", "power:", "power:-1", "power:nan", "Proportional"):
        with pytest.raises(ValueError, match=rf"rule {re.escape(repr(rule))}; expected"):
            allocate([1.0, 2.0], 4, rule)
    with pytest.raises(ValueError, match="aggregate 'median'"):
        allocate(per_head, 4, aggregate="median")


def test_saturation_warning_names_heads_above_half_of_J():
    assert saturation_warning(torch.tensor([[10.0, 512.0], [3.0, 1.0]]), 1024) is None
    message = saturation_warning(torch.tensor([[10.0, 600.0], [3.0, 900.0]]), 1024)
    assert "2 of 4 heads" in message and "layer 1 head 1" in message and "larger J" in message


def calibration(folder, n_tokens):
    from dofmini import load_tokenizer

    text = shared_path("data", "wikitext-2-raw", "wiki.valid.raw").read_text(encoding="utf-8")[
        :20000
    ]
    return torch.tensor(load_tokenizer(folder).encode(text).ids[:n_tokens])


@pytest.mark.parametrize("name", ["standin_gpt2", "standin_pythia"])
def test_estimate_dof_on_the_whole_pool_matches_the_captured_queries_and_keys(name, request):
    model = request.getfixturevalue(name)
    ids = calibration(shared_path("weights", name.replace("_", "-")), 3 * 16)
    dof = estimate_dof(
        model, ids, 2**-4, J=96, seed=5, ctx=16, batch=2
    )  # J = the whole pool: 3 windows × 32
    capture = []
    with torch.no_grad():
        model(ids.view(3, 16), capture=capture)
    pools = torch.stack(
        [torch.cat((q, k), 2).transpose(0, 1).reshape(q.shape[1], 96, -1) for q, k, _ in capture]
    )
    assert dof.shape == (model.config.n_layer, model.config.n_head)
    assert torch.allclose(dof, degrees_of_freedom(pools, 2**-4), rtol=1e-9)


def test_estimate_dof_is_seeded_and_in_range(standin_gpt2):
    ids = calibration(shared_path("weights", "standin-gpt2"), 4 * 32)
    first, again, other = (
        estimate_dof(standin_gpt2, ids, 2**-4, J=48, seed=s, ctx=32) for s in (0, 0, 1)
    )
    assert (
        first.shape == (6, 4)
        and torch.isfinite(first).all()
        and (first >= 0).all()
        and (first <= 48).all()
    )
    assert torch.equal(first, again) and not torch.equal(first, other)
    with pytest.raises(ValueError, match="fewer than J"):
        estimate_dof(standin_gpt2, ids[:40], 2**-4, J=65, seed=0, ctx=32)  # one window: 64


def test_samples_are_nested_in_draw_order(standin_gpt2):
    ids = calibration(shared_path("weights", "standin-gpt2"), 4 * 32)
    big = sample_queries_keys(standin_gpt2, ids, J=100, seed=3, ctx=32, batch=3)
    assert torch.equal(sample_queries_keys(standin_gpt2, ids, J=40, seed=3, ctx=32), big[:, :, :40])
