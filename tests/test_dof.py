"""Degrees of freedom against independent numpy formulas (Hypothesis), the estimate on the stand-in
teachers and the saturation warning. The allocator: test_allocate.py."""

import math

import numpy as np
import pytest
import torch
from conftest import data_path, shared_path
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dofmini.dof import (
    degrees_of_freedom,
    dof_by_definition,
    estimate_dof,
    sample_queries_keys,
)
from dofmini.study.compute import saturation_warning

FAST = settings(max_examples=60, deadline=None)


def points(seed, J, d, scale, dups):
    """J random rows, the last `dups` of them copies of earlier ones (so the Gram can lose rank)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(J, d, generator=gen, dtype=torch.float64) * scale  # [J, d]
    x[J - dups :] = x[:dups]
    return x


def naive(x, lam, normalize):
    """DoF by the book: the Gram in plain float64, numpy's eigvalsh, Σ σ/(σ+λ); inf where the Gram
    overflows."""
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
    if math.isfinite(ref):  # the package's own reading of the definition
        assert dof_by_definition(x, lam, normalize).item() == pytest.approx(ref, rel=1e-7, abs=1e-8)
    # tr Σ̂(Σ̂+λI)⁻¹ = J − λ·tr (Σ̂+λI)⁻¹
    trace_form = J - lam * np.trace(np.linalg.inv(op + lam * np.eye(J)))
    assert dof == pytest.approx(trace_form, rel=1e-7, abs=1e-7)
    assert 0 <= dof <= np.linalg.matrix_rank(op) + 1e-7 <= J + 1e-7


@FAST
@given(cases, st.floats(1.01, 64))
def test_dof_decreases_as_lam_grows(case, factor):
    seed, J, d, scale, dups, log2_lam, normalize = case
    x, lam = points(seed, J, d, scale, min(dups, J // 2)), 2.0**log2_lam
    larger_lam = degrees_of_freedom(x, lam * factor, normalize)
    assert larger_lam <= degrees_of_freedom(x, lam, normalize) + 1e-9


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


def test_saturation_warning_names_heads_above_half_of_J():
    assert saturation_warning(torch.tensor([[10.0, 512.0], [3.0, 1.0]]), 1024) is None
    message = saturation_warning(torch.tensor([[10.0, 600.0], [3.0, 900.0]]), 1024)
    assert "2 of 4 heads" in message and "layer 1 head 1" in message and "larger J" in message


def calibration(folder, n_tokens):
    from dofmini import load_tokenizer

    text = data_path("wikitext-2-raw", "wiki.valid.raw").read_text(encoding="utf-8")[:20000]
    return torch.tensor(load_tokenizer(folder).encode(text).ids[:n_tokens])


@pytest.mark.parametrize("name", ["standin_gpt2", "standin_pythia"])
def test_estimate_dof_on_the_whole_pool_matches_the_captured_queries_and_keys(name, request):
    model = request.getfixturevalue(name)
    ids = calibration(shared_path("weights", name.replace("_", "-")), 3 * 16)
    dof = estimate_dof(model, ids, 2**-4, J=96, seed=5, ctx=16, batch=2)  # J = all 3 windows × 32
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
    assert first.shape == (6, 4) and torch.isfinite(first).all()
    assert (first >= 0).all() and (first <= 48).all()
    assert torch.equal(first, again) and not torch.equal(first, other)
    with pytest.raises(ValueError, match="fewer than J"):
        estimate_dof(standin_gpt2, ids[:40], 2**-4, J=65, seed=0, ctx=32)  # one window: 64
    with pytest.raises(ValueError, match="need 1-D"):
        estimate_dof(standin_gpt2, ids.view(4, 32), 2**-4, J=48, seed=0, ctx=32)
    with pytest.raises(ValueError, match="ctx=0"):
        estimate_dof(standin_gpt2, ids, 2**-4, J=48, seed=0, ctx=0)


def test_samples_are_nested_in_draw_order(standin_gpt2):
    ids = calibration(shared_path("weights", "standin-gpt2"), 4 * 32)
    big = sample_queries_keys(standin_gpt2, ids, J=100, seed=3, ctx=32, batch=3)
    assert torch.equal(sample_queries_keys(standin_gpt2, ids, J=40, seed=3, ctx=32), big[:, :, :40])


def test_the_definition_warns_where_its_eigenvalues_are_rounding():
    """32 orthogonal points with ‖x‖²/√d from 70 to 80: the Gram's entries pass e^70 and
    eigvalsh's errors dwarf λ (0.7.1's answer there could be 23 for 32): the definition says so
    and names the stable form, which gives 32."""
    J = 32
    s = torch.linspace(70, 80, J, dtype=torch.float64)
    x = torch.diag((s * math.sqrt(J)).sqrt())  # [J, J], ‖xᵢ‖²/√d = sᵢ
    with pytest.warns(RuntimeWarning, match="use degrees_of_freedom, the stable form"):
        dof_by_definition(x, 1.0)
    assert degrees_of_freedom(x, 1.0).item() == pytest.approx(J, abs=1e-6)
