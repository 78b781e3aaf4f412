"""PRF linear attention (dofmini/linear_attention.py): the chunked form agrees with token-by-token
decoding and with a quadratic form written out here (values and gradients, on features, on
log-features and with dijiang.py's decay), is exactly causal, stays finite at large norms (in log
space: no row lost at any norm), continues a prefill token by token, runs long sequences in parts,
puts a student's tensors on its teacher's device; the features estimate the softmax kernel without
bias at the 1/√M rate."""

import copy
import math

import pytest
import torch
from conftest import FIXTURES
from hypothesis import given, settings
from hypothesis import strategies as st

from dofmini import load, log_space, plain_forms
from dofmini.dijiang import decay_form
from dofmini.linear_attention import (
    CPU_PART,
    LinearAttention,
    LinearState,
    PRFFeatures,
    causal_linear_attention,
)
from dofmini.log_space import unit_features
from dofmini.plain_forms import scan_chunks
from dofmini.students import replace_attention

# Relative-RMS bounds, relative to the size of what is summed (`magnitudes`). All forms compute in
# fp32 from the same inputs, so in fp32 they differ by summation order only: 1e-5 is ~100 fp32
# epsilons. In bf16/fp16 the fp32 results are rounded to the output dtype: at most one unit in the
# last place, 2^-7 (bf16), 2^-10 (fp16).
BOUND = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}
FAST = settings(max_examples=30, deadline=None)
PRIMES = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47]


def rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300)).item()


def options(decay, normalize, log_space=False):
    """causal_linear_attention's keywords for a decay γ [H] (dijiang.py's form) or none."""
    form = None if decay is None else decay_form(decay)
    return dict(normalize=normalize, log_space=log_space, form=form)


def chunked(chunk, log_space=False):
    return lambda q, k, v, decay, normalize: causal_linear_attention(
        q, k, v, chunk, **options(decay, normalize, log_space)
    )


def recurrent_step(state, q, k, v, **kw):
    """Token by token, as decoding runs: one token at a time from the state, which it updates."""
    tokens = zip(*(x.split(1, 2) for x in (q, k, v)))
    return torch.cat([causal_linear_attention(*x, 1, state=state, **kw) for x in tokens], 2)


def recurrent(log_space=False):
    return lambda q, k, v, decay, normalize: recurrent_step(
        LinearState(), q, k, v, **options(decay, normalize, log_space)
    )


def quadratic(log_space=False):
    """Ground truth, the T×T masked product, written out here, in fp32 or wider: each term weighed
    by γ^(t−s) with a decay; in log space each kernel value logsumexp_m (log φ_q,tm + log φ_k,sm),
    each row shifted by its largest (exact at any norm)."""

    def form(q, k, v, decay, normalize):
        f = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.float32)
        (q, k, x), T = (t.to(f) for t in (q, k, v)), q.shape[2]
        lag = torch.arange(T)[:, None] - torch.arange(T)  # [T, T]
        if log_space:
            logits = torch.logsumexp(q[..., :, None, :] + k[..., None, :, :], -1)  # [B, H, T, T]
            logits = logits.masked_fill(lag < 0, -math.inf)
            A = torch.exp(logits - logits.detach().amax(-1, keepdim=True))  # [B, H, T, T]
        else:
            gamma = torch.ones(q.shape[1], dtype=f) if decay is None else decay.to(f)  # [H]
            A = q @ k.mT * torch.where(lag >= 0, gamma[:, None, None] ** lag.clamp_min(0), 0)
        y, den = A @ x, A.sum(-1, keepdim=True).clamp_min(torch.finfo(f).tiny)  # [B, H, T, ·]
        return (y / den if normalize else y).to(v.dtype)

    return form


@st.composite
def problems(draw, max_norm=3.0, log_space=None):
    """Random sizes (T near chunk edges and primes included), features, inputs, decay and
    normalisation; features or log-features (log_space, drawn unless given: then no decay and
    normalize=True)."""
    chunk = draw(st.sampled_from([1, 2, 3, 8, 16]))
    T = draw(
        st.one_of(
            st.sampled_from([1, max(chunk - 1, 1), chunk, chunk + 1, 2 * chunk + 1]),
            st.sampled_from(PRIMES),
            st.integers(1, 70),
        )
    )
    B, H, M, d, dv = (
        draw(st.integers(1, 2)),
        draw(st.integers(1, 3)),
        draw(st.integers(1, 16)),
        draw(st.integers(1, 16)),
        draw(st.integers(1, 6)),
    )
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    features = PRFFeatures(H, d, M, seed, orthogonal=draw(st.booleans()))
    with torch.no_grad():  # trained-looking features: moved z, unequal weights
        features.z.add_(0.3 * torch.randn(features.z.shape, generator=gen))
        features.a.copy_(torch.randn(features.a.shape, generator=gen))
    norms = max_norm * math.sqrt(d) * torch.rand(2, B, H, T, 1, generator=gen)  # up to max_norm·√d
    q, k = torch.nn.functional.normalize(torch.randn(2, B, H, T, d, generator=gen), dim=-1) * norms
    v = torch.randn(B, H, T, dv, generator=gen)
    log_space = draw(st.booleans()) if log_space is None else log_space
    decay = 0.5 + 0.5 * torch.rand(H, generator=gen) if draw(st.booleans()) else None
    return dict(
        chunk=chunk,
        features=features,
        q=q,
        k=k,
        v=v,
        decay=None if log_space else decay,
        normalize=log_space or draw(st.booleans()),
        log_space=log_space,
    )


def forms(p):
    log_space = p["log_space"]
    return {
        "quadratic": quadratic(log_space),
        "recurrent": recurrent(log_space),
        "chunked": chunked(p["chunk"], log_space),
    }


def units(f, x):
    """(Φ(x) over its own largest entry, that entry's log): unit_features of f's log-features."""
    return unit_features(f.log_features(x))


def feature_maps(p, q, k):
    """What the forms are fed for q, k: Φ(q), Φ(k) each over its largest entry, or log Φ (fp32 or
    wider)."""
    f = p["features"]
    if p["log_space"]:
        return f.log_features(q), f.log_features(k)
    return units(f, q)[0], units(f, k)[0]


def fed(p, dtype, exact=False):
    """What the forms are fed when q, k, v come in `dtype`: feature maps, v, and decay, as autograd
    leaves or fp64 copies for the exact reference."""
    x = [
        *feature_maps(p, p["q"].to(dtype), p["k"].to(dtype)),
        p["v"].to(dtype).detach().requires_grad_(),
    ]
    x = [t.double() for t in x] if exact else x
    decay = None if p["decay"] is None else p["decay"].clone().requires_grad_()
    f = p["features"]
    return x, decay, x + [f.z, f.a] + ([] if decay is None else [decay])


def cotangent(out, dtype):
    """A fixed random cotangent, representable in the tested output dtype so that every form gets
    the same one."""
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(dtype).double()


def run(form, p, dtype, exact=False):
    """Output and gradients wrt (phi_q, phi_k, v, z, a[, decay])."""
    (phi_q, phi_k, v), decay, wrt = fed(p, dtype, exact)
    out = form(phi_q, phi_k, v, decay, p["normalize"])
    return out, torch.autograd.grad((out.double() * cotangent(out, dtype)).sum(), wrt)


def magnitudes(p, dtype):
    """The size of what each compared quantity adds up before cancellation, in fp64: the output with
    |v|, and each gradient of num/den as its two terms (num's, den's) apart. Rounding errors scale
    with these, not with a result that cancels to ~0 (e.g. a normalised output of one token is v
    whatever the features: zero gradient). Log-features are exponentiated here (fp64 holds them at
    these norms)."""
    (phi_q, phi_k, v), decay, wrt = fed(p, dtype, exact=True)
    if p["log_space"]:
        phi_q, phi_k = phi_q.exp(), phi_k.exp()
    quad = lambda v, normalize: quadratic()(phi_q, phi_k, v, decay, normalize)
    out = quad(v.abs(), p["normalize"])
    num = quad(v, False)  # [B, H, T, dv]
    c = cotangent(num, dtype)
    if p["normalize"]:
        den = quad(torch.ones_like(v[..., :1]), False)  # [B, H, T, 1]
        terms = [((c / den).detach() * num).sum(), ((c * num / den**2).detach() * den).sum()]
    else:
        terms = [(c * num).sum()]
    grads = [torch.autograd.grad(t, wrt, allow_unused=True, retain_graph=True) for t in terms]
    return out.norm().item(), [
        sum(0.0 if g[i] is None else g[i].norm().item() for g in grads) for i in range(len(wrt))
    ]


def err(x, ref):
    return (x.double() - ref.double()).norm().item()


@FAST
@given(problems(), st.sampled_from([torch.float32, torch.bfloat16]))
def test_three_forms_agree_in_values_and_gradients(p, dtype):
    """Each form in fp32/bf16 against the quadratic form in fp64 on the same (rounded) inputs."""
    out_ref, grads_ref = run(quadratic(p["log_space"]), p, dtype, exact=True)
    out_size, grad_sizes = magnitudes(p, dtype)
    for name, form in forms(p).items():
        out, grads = run(form, p, dtype)
        assert out.dtype == dtype and err(out, out_ref) <= BOUND[dtype] * out_size, name
        for i, (g, g_ref, size) in enumerate(
            zip(grads, grads_ref, grad_sizes)
        ):  # each held to its own dtype
            assert err(g, g_ref) <= BOUND[g.dtype] * size, (
                name,
                ["phi_q", "phi_k", "v", "z", "a", "decay"][i],
            )


@FAST
@given(problems(max_norm=30.0), st.data())
def test_chunked_form_is_exactly_causal(p, data):
    """Changing every input after position t leaves outputs up to t bit-for-bit unchanged, at
    norms up to 30√d, where in log space some rows take the exact path (earlier keys say which)."""
    T = p["q"].shape[2]
    t = data.draw(st.integers(0, T - 1))
    gen = torch.Generator().manual_seed(T)
    changed = [x.clone() for x in (p["q"], p["k"], p["v"])]
    for x in changed:
        x[:, :, t + 1 :] = 10 * torch.randn(x[:, :, t + 1 :].shape, generator=gen)
    with torch.no_grad():
        outs = [
            chunked(p["chunk"], p["log_space"])(
                *feature_maps(p, q, k), v, p["decay"], p["normalize"]
            )
            for q, k, v in ((p["q"], p["k"], p["v"]), changed)
        ]
    assert torch.equal(outs[0][:, :, : t + 1], outs[1][:, :, : t + 1])


HALF_AND_FULL = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])


@settings(max_examples=20, deadline=None)
@given(problems(max_norm=30.0, log_space=False), HALF_AND_FULL)
def test_large_norms_stay_finite_and_forms_agree_on_features(p, dtype):
    """‖q‖, ‖k‖ up to 30√d, inputs in fp32/bf16/fp16, on Φ as unit_features shifts it: finite
    features (each query's and key's largest exactly 1) and outputs, and each form agrees with the
    exact (fp64) quadratic form on the same Φ, element by element, to within its dtype's rounding
    plus what fp32 underflow can drop: a feature e^87 below its row's largest is 0 (log space keeps
    it: next test). Rows whose exact denominator is 0 allow any finite value."""
    f = p["features"]
    q, k, v = p["q"].to(dtype), p["k"].to(dtype), p["v"].to(dtype)
    B, H, T, M = *q.shape[:3], f.z.shape[1]
    with torch.no_grad():
        (phi_q, log_scale), (phi_k, key_scale) = units(f, q), units(f, k)
        assert all(x.isfinite().all() and (x >= 0).all() for x in (phi_q, phi_k))
        assert all(x.amax(-1).eq(1).all() for x in (phi_q, phi_k))
        assert log_scale.isfinite().all() and key_scale.isfinite().all()
        outs = {
            name: form(phi_q, phi_k, v, p["decay"], p["normalize"])
            for name, form in forms(p).items()
        }
        exact, size, den = (
            quadratic()(phi_q.double(), phi_k.double(), x, p["decay"], normalize)
            for x, normalize in (
                (v.double(), p["normalize"]),
                (v.double().abs(), p["normalize"]),
                (torch.ones(B, H, T, 1, dtype=torch.float64), False),
            )
        )
    dropped = (
        M * T * torch.finfo(torch.float32).tiny * v.abs().max().double()
    )  # from num, and from den per |v|
    allowed = (
        BOUND[dtype] * size
        + torch.finfo(dtype).tiny
        + (2 * dropped / den if p["normalize"] else dropped)
    )
    for name, out in outs.items():
        assert out.dtype == dtype and out.isfinite().all(), name
        assert ((out.double() - exact).abs() <= allowed).all(), name


@settings(max_examples=25, deadline=None)
@given(problems(max_norm=30.0, log_space=True), HALF_AND_FULL)
def test_log_space_loses_no_row_at_any_norm(p, dtype):
    """‖q‖, ‖k‖ up to 30√d, q, k, v in fp32/bf16/fp16, fed as log-features (as LinearAttention
    does): every form's output is finite, has no all-zero row (the exact rows are never 0 here) and
    agrees with a float64 log-space reference from the same z, a and the same rounded q, k, v; its
    gradients for q, k, z, a, v are finite. Allowed error: the dtype's rounding, plus what fp32
    log-features of size up to Λ carry: their own error δ (measured against the fp64 ones) and the
    shifts' rounding, a few Λ·2^-24, each a relative error of every kernel value, so at most twice
    that in a normalised row."""
    f, f64 = p["features"], copy.deepcopy(p["features"]).double()
    q, k, v = (p[x].to(dtype).requires_grad_() for x in "qkv")
    with torch.no_grad():
        log_q, log_k = f64.log_features(q.double()), f64.log_features(k.double())  # [B, H, T, M]
        exact, size = (
            quadratic(True)(log_q, log_k, x, None, True) for x in (v.double(), v.double().abs())
        )
        delta = max(
            (a.double() - b).abs().max().item()
            for a, b in zip(feature_maps(p, q, k), (log_q, log_k))
        )
        scale = max(log_q.abs().max().item(), log_k.abs().max().item())  # Λ
    allowed = BOUND[dtype] * size + 2 * math.expm1(2 * delta + 8 * scale * 2**-24) * size
    for name, form in forms(p).items():
        out = form(*feature_maps(p, q, k), v, None, True)  # [B, H, T, dv]
        assert out.dtype == dtype and out.isfinite().all(), name
        assert not (out == 0).all(-1).any(), name
        assert ((out.double() - exact).abs() <= allowed).all(), name
        grads = torch.autograd.grad(
            (out.double() * cotangent(out, dtype)).sum(), [q, k, f.z, f.a, v]
        )
        assert all(g.isfinite().all() for g in grads), name


@settings(max_examples=25, deadline=None)
@given(problems(max_norm=30.0, log_space=True))
def test_log_space_denominators_are_at_least_one(p):
    """A query's features sum to 1 (a softmax) and each feature's keys hold a 1 (the one its shift
    came from), so at any norm no row's denominator is below 1: `log_chunks` on the whole chunks,
    `recurrent_step` on every token (ones for v: the output is the denominator)."""
    log_q, log_k = (p["features"].log_features(p[x]).detach() for x in "qk")  # [B, H, T, M]
    B, H, T, M = log_q.shape
    L, ones = p["chunk"], torch.ones(B, H, T, 1)
    start = (torch.zeros(B, H, M, 1), torch.full((B, H, M, 1), torch.finfo(torch.float32).min))
    dens, (S, c) = [], start
    if T >= L:
        whole = [x[:, :, : T // L * L].unflatten(2, (-1, L)) for x in (log_q, log_k, ones)]
        dens.append(log_space.log_chunks(*whole, *start)[0])  # [B, H, T // L, L, 1]
    for t in range(T):
        token = (x[:, :, t : t + 1] for x in (log_q, log_k, ones))
        den, S, c = log_space.log_step(*token, S, c)  # [B, H, 1, 1]
        dens.append(den)
    # Each 1 is exp of a difference of fp32 numbers of size up to Λ (log-features and their
    # shifts), so it carries a few Λ·eps32 (Λ near 780 gave 0.99997574, under a fixed 1 − 1e-5);
    # the softmax's M weights sum to 1 within M·eps32.
    eps = torch.finfo(torch.float32).eps
    scale = max(log_q.abs().max().item(), log_k.abs().max().item())  # Λ
    bound = math.exp(-4 * scale * eps) - M * eps
    assert all((den >= bound).all() for den in dens)


@FAST
@given(problems(), st.data())
def test_prefill_then_recurrent_decoding_equals_one_chunked_pass(p, data):
    """A chunked prefill of any length leaves a state from which token-by-token steps continue the
    whole pass (in log space too, where the state carries each feature's running maximum)."""
    (q, k), v = feature_maps(p, p["q"], p["k"]), p["v"]
    kw = options(p["decay"], p["normalize"], p["log_space"])
    with torch.no_grad():
        whole = causal_linear_attention(q, k, v, p["chunk"], **kw)
        state, cut = LinearState(), data.draw(st.integers(0, q.shape[2]))
        parts = (
            [
                causal_linear_attention(
                    q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], p["chunk"], state=state, **kw
                )
            ]
            if cut
            else []
        )
        parts += [
            recurrent_step(state, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], **kw)
            for t in range(cut, q.shape[2])
        ]
    assert state.n == q.shape[2] and state.S.shape[-1] == v.shape[-1] + p["normalize"]
    assert rel(torch.cat(parts, 2), whole) <= BOUND[torch.float32]


@pytest.mark.parametrize("log_space", [False, True])
def test_a_decoding_step_updates_the_state_in_place_without_autograd(log_space):
    """A one-token step without autograd writes the new sums into the state's own tensor (no
    state allocated per token); with autograd it leaves the old tensor as it was, since earlier
    outputs' gradients read it. Both give the same state."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.rand(1, 2, 9, 4, generator=gen) for _ in range(3))  # [1, 2, 9, 4]
    states = []
    for grad in (False, True):
        state = LinearState()
        with torch.no_grad():
            causal_linear_attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], 4, state=state,
                                    log_space=log_space)  # fmt: skip
        S = state.S
        kept = S.clone()
        with torch.set_grad_enabled(grad):
            last = [x[:, :, 8:].clone().requires_grad_(grad) for x in (q, k, v)]
            causal_linear_attention(*last, 4, state=state, log_space=log_space)
        assert (state.S is S) != grad and torch.equal(S, kept) == grad and state.n == 9
        states.append(state.S.detach())
    assert torch.equal(*states)


@pytest.mark.parametrize("kind", ["plain", "decay", "log"])
def test_long_sequences_run_in_parts_and_agree(kind):
    """T past CPU_PART tokens: on CPU the chunked pass goes part by part, carrying the state, then
    the 5 tokens left as one chunk, and still gives the quadratic form's outputs and gradients
    (fp64). In log space the log-features span e^±90, so keys rise far above their chunk's start
    and rows take the exact path too."""
    T, gen = CPU_PART + 37, torch.Generator().manual_seed(0)
    log_space = kind == "log"
    inputs = [
        30 * torch.randn(1, 2, T, 4, generator=gen)
        if log_space
        else torch.rand(1, 2, T, 4, generator=gen)
        for _ in range(2)
    ] + [torch.randn(1, 2, T, 3, generator=gen)]
    inputs += [torch.tensor([0.999, 0.9])] if kind == "decay" else []
    results = []
    for form, dtype in (
        (chunked(16, log_space), torch.float32),
        (quadratic(log_space), torch.float64),
    ):
        x = [t.to(dtype).requires_grad_() for t in inputs]
        out = form(*x[:3], x[3] if kind == "decay" else None, True)
        results.append([out, *torch.autograd.grad((out * cotangent(out, torch.float32)).sum(), x)])
    for got, exact in zip(*results):
        assert rel(got, exact) <= BOUND[torch.float32]


@pytest.mark.parametrize("N", [1, 2, 3, 5, 8, 13, 64, 100])
def test_scan_over_chunks_is_the_decayed_sum_without_overflow(N):
    """scan_chunks against Σ_{n'≤n} exp(A_n − A_n') X_n' written out (fp64), for A falling by up to
    e^90 per chunk: exp(−A) alone would overflow; values and gradients agree (N past 32: blocks,
    one of them partly filled)."""
    gen = torch.Generator().manual_seed(N)
    X = torch.randn(2, N, 3, 4, generator=gen, dtype=torch.float64).requires_grad_()
    A = (-90 * torch.rand(2, N, 3, 1, generator=gen, dtype=torch.float64)).cumsum(1)
    A = A.requires_grad_()  # [2, N, 3, 1] non-increasing along the chunks
    direct = torch.stack(
        [sum(torch.exp(A[:, n] - A[:, m]) * X[:, m] for m in range(n + 1)) for n in range(N)], 1
    )  # [2, N, 3, 4]
    cot = torch.randn(direct.shape, generator=gen, dtype=torch.float64)
    results = [
        [P, *torch.autograd.grad((P * cot).sum(), [X, A], materialize_grads=True)]
        for P in (scan_chunks(X, A), direct)
    ]
    for got, exact in zip(*results):
        assert got.isfinite().all() and err(got, exact) <= 1e-12 * max(exact.norm().item(), 1)


def test_student_tensors_go_to_the_teachers_device_and_a_decoding_step_reads_nothing_back():
    """replace_attention on a model on the 'meta' device (no data: reading a value back to the host
    fails there): every parameter lands on 'meta', and a one-token decoding step runs through (a
    chunked pass reads back one flag, whether a key rose past e^RISE, so it needs data)."""
    model = replace_attention(load(FIXTURES / "gpt2-tiny").to("meta"), [8, 3], seed=11)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    ids = torch.zeros(1, 1, dtype=torch.long, device="meta")
    caches = [b.attn.new_cache(1, 10) for b in model.blocks]
    with torch.no_grad():
        assert model(ids, 0, caches).shape == (1, 1, 96)
    assert caches[0].n == 1 and caches[0].S.device.type == "meta"


@FAST
@given(problems(log_space=True))
def test_the_loop_form_agrees_with_log_chunks(p):
    """log_loop (one chunk at a time, the state rescaled to each new maximum) against log_chunks
    on the same log-features: values and gradients, as the forms above agree."""
    out_size, grad_sizes = magnitudes(p, torch.float32)
    results = []
    for form in (log_space.log_chunks, log_space.log_loop):
        (q, k, v), _, wrt = fed(p, torch.float32)
        out = causal_linear_attention(q, k, v, p["chunk"], log_space=True, form=form)
        grads = torch.autograd.grad((out.double() * cotangent(out, torch.float32)).sum(), wrt)
        results.append((out, grads))
    (out, grads), (loop, loop_grads) = results
    assert err(loop, out) <= BOUND[torch.float32] * out_size
    for g, g_loop, size in zip(grads, loop_grads, grad_sizes):
        assert err(g_loop, g) <= BOUND[torch.float32] * size


def test_log_scale_recovers_the_exact_kernel_estimate():
    """exp(u_q + u_k)·Φ̃(q)·Φ̃(k) (unit_features: Φ̃ over its largest entry exp(u)) is SPEC §2's
    Φ(q)ᵀΦ(k), written out directly, in fp64."""
    H, d, M = 2, 16, 24
    f = PRFFeatures(H, d, M, seed=3).double()
    with torch.no_grad():
        f.a.normal_(generator=torch.Generator().manual_seed(1))
    q, k = 2 * torch.randn(
        2, 1, H, 7, d, generator=torch.Generator().manual_seed(2), dtype=torch.float64
    )

    def log_phi(x):  # [1, H, 7, M]
        return (
            0.5 * (f.a[:, None] - math.log(M))
            + x @ f.z.mT / d**0.25
            - (x * x).sum(-1, keepdim=True) / (2 * math.sqrt(d))
        )

    direct = log_phi(q).exp() @ log_phi(k).exp().mT  # [1, H, 7, 7]
    (phi_q, u_q), (phi_k, u_k) = units(f, q), units(f, k)
    assert phi_q.amax(-1).eq(1).all() and phi_k.amax(-1).eq(1).all()
    assert rel(torch.exp(u_q + u_k.mT) * (phi_q @ phi_k.mT), direct) < 1e-12


def kernel_draws(n, d, M, x, y, seed, orthogonal):
    """n independent estimates Φ(x)ᵀΦ(y), each from its own M features (one 'head' per draw)."""
    f = PRFFeatures(n, d, M, seed, orthogonal)
    with torch.no_grad():
        (phi_q, u_q), (phi_k, u_k) = (units(f, t.expand(1, n, 1, d)) for t in (x, y))
        return (torch.exp(u_q + u_k) * (phi_q * phi_k).sum(-1, keepdim=True)).flatten().double()


@st.composite
def pairs(draw, max_norm):
    """x, y with |x|/d^¼, |y|/d^¼ <= max_norm, so that one feature's log-variance |x'+y'|² stays
    modest."""
    d, seed = draw(st.integers(1, 16)), draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.nn.functional.normalize(
        torch.randn(2, d, generator=gen, dtype=torch.float64), dim=-1
    ) * (max_norm * d**0.25 * torch.rand(2, 1, generator=gen, dtype=torch.float64))
    return d, seed, x.float(), y.float(), math.exp(float(x @ y) / math.sqrt(d))


@settings(max_examples=10, deadline=None)
@given(pairs(max_norm=0.7), st.integers(1, 8), st.booleans())
def test_features_are_unbiased(pair, M, orthogonal):
    """Mean of N = 4000 independent estimates within 5 standard errors (from their sample variance)
    of K(x, y)."""
    d, seed, x, y, K = pair
    est = kernel_draws(4000, d, M, x, y, seed, orthogonal)
    assert abs(est.mean().item() - K) <= 5 * est.std().item() / math.sqrt(len(est))


@settings(max_examples=10, deadline=None)
@given(pairs(max_norm=0.5))
def test_error_shrinks_at_the_one_over_sqrt_m_rate(pair):
    """i.i.d. features: E(K̂ − K)² = K²(exp|x'+y'|² − 1)/M exactly (x' = x/d^¼). The measured mean
    squared error at M = 4, 16, 64 matches it within 5 standard errors, so the RMS error falls as
    1/√M."""
    d, seed, x, y, K = pair
    one_feature_var = K**2 * math.expm1(float((x + y).double().norm() ** 2) / math.sqrt(d))
    for M in (4, 16, 64):
        sq = (kernel_draws(4000, d, M, x, y, seed + M, orthogonal=False) - K) ** 2
        assert abs(sq.mean().item() - one_feature_var / M) <= 5 * sq.std().item() / math.sqrt(
            len(sq)
        ), M


def test_orthogonal_draw_has_orthogonal_blocks_and_is_seeded():
    z = PRFFeatures(2, 8, 20, seed=5).z.detach().double()  # 20 rows: blocks of 8, 8, 4
    for lo, hi in ((0, 8), (8, 16), (16, 20)):
        u = torch.nn.functional.normalize(z[:, lo:hi], dim=-1)
        assert torch.allclose(
            u @ u.mT, torch.eye(hi - lo, dtype=torch.float64).expand(2, -1, -1), atol=1e-6
        )
    assert torch.equal(PRFFeatures(2, 8, 20, seed=5).z, PRFFeatures(2, 8, 20, seed=5).z)
    assert not torch.equal(PRFFeatures(2, 8, 20, seed=5).z, PRFFeatures(2, 8, 20, seed=6).z)


def test_bad_shapes_are_named():
    f = PRFFeatures(2, 8, 4, seed=0)
    with pytest.raises(ValueError, match=r"q has shape \(1, 3, 5, 8\); expected \[B, 2, T, 8\]"):
        f.log_features(torch.zeros(1, 3, 5, 8), "q")
    phi = torch.ones(1, 2, 5, 4)
    with pytest.raises(ValueError, match="v"):
        causal_linear_attention(phi, phi, torch.zeros(1, 2, 6, 3))
    with pytest.raises(ValueError, match=r"decay must be \[H\] with values in \(0, 1\]"):
        decay_form(torch.tensor([0.5, 1.5]))
    with pytest.raises(ValueError, match=r"decay must be \[H=2\]; got shape \(3,\)"):
        causal_linear_attention(phi, phi, phi, form=decay_form(torch.tensor([0.5, 0.5, 1.0])))
    with pytest.raises(ValueError, match="log_space=True needs normalize=True"):
        causal_linear_attention(phi, phi, torch.zeros(1, 2, 5, 3), normalize=False, log_space=True)
    state = LinearState()
    causal_linear_attention(phi, phi, torch.zeros(1, 2, 5, 3), state=state)
    with pytest.raises(ValueError, match="state S"):
        recurrent_step(
            state, phi[:, :, :1], phi[:, :, :1], torch.zeros(1, 2, 1, 3), normalize=False
        )
    with pytest.raises(ValueError, match=r"state S \(1, 2, 4, 4\), c None .* log space: c \[B"):
        recurrent_step(state, phi[:, :, :1], phi[:, :, :1], torch.zeros(1, 2, 1, 3), log_space=True)


def decode(model, ids, prefill, chunk):
    """Logits from a prefill of `prefill` tokens (chunked, with state) then one token at a time
    (recurrent)."""
    for block in model.blocks:
        block.attn.chunk = chunk
    caches = [block.attn.new_cache(ids.shape[0], ids.shape[1]) for block in model.blocks]
    logits = [model(ids[:, :prefill], 0, caches)] if prefill else []
    logits += [model(ids[:, t : t + 1], t, caches) for t in range(prefill, ids.shape[1])]
    return torch.cat(logits, 1)


@pytest.mark.parametrize("name", ["gpt2-tiny", "neox-tiny"])
def test_student_from_a_real_model(name):
    """replace_attention on a real (tiny) checkpoint: only z and a train, logits are finite and
    causal, and decoding with caches equals the full chunked forward."""
    model = replace_attention(load(FIXTURES / name), [8, 3], seed=11)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"blocks.{i}.attn.features.{w}" for i in range(2) for w in "za"}
    assert [b.attn.features.seed for b in model.blocks] == [11, 12]
    ids = torch.randint(
        0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        full = model(ids)  # [2, 40, V]
        assert full.isfinite().all()
        changed = ids.clone()
        changed[:, 25:] = (changed[:, 25:] + 1) % model.config.vocab_size
        assert torch.equal(model(changed)[:, :25], full[:, :25])
        for prefill, chunk in ((0, 64), (1, 64), (23, 8)):
            assert rel(decode(model, ids, prefill, chunk), full) <= BOUND[torch.float32], (
                prefill,
                chunk,
            )
        with pytest.raises(ValueError, match="cache holds 0 tokens but start=3"):
            model(ids[:, :1], 3, [b.attn.new_cache(2, 4) for b in model.blocks])


def test_student_of_the_standin_teacher(standin_pythia):
    """The real-size stand-in (rotary, 64-wide heads): finite logits, and cached decoding equals the
    chunked pass."""
    model = replace_attention(copy.deepcopy(standin_pythia), [64, 96, 32, 64, 17, 111], seed=0)
    ids = torch.randint(
        0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        full = model(ids)
        assert full.isfinite().all()
        assert rel(decode(model, ids, 40, 16), full) <= BOUND[torch.float32]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_student_runs_in_half_precision(dtype):
    """A half-precision teacher: Φ and the states stay fp32 inside, the student's logits come out
    finite in dtype."""
    model = replace_attention(load(FIXTURES / "neox-tiny", dtype=dtype), [8, 8], seed=0)
    with torch.no_grad():
        logits = model(torch.randint(0, 96, (2, 50), generator=torch.Generator().manual_seed(0)))
    assert logits.dtype == dtype and logits.isfinite().all()


def test_linear_attention_reports_q_k_v_to_capture():
    model = load(FIXTURES / "gpt2-tiny")
    ids = torch.arange(10)[None]
    teacher_capture, student_capture = [], []
    with torch.no_grad():
        model(ids, capture=teacher_capture)
        replace_attention(model, [4, 4], seed=0)(ids, capture=student_capture)
    assert len(student_capture) == 2 and isinstance(model.blocks[0].attn, LinearAttention)
    for t, s in zip(
        teacher_capture[:1], student_capture[:1]
    ):  # layer 0 sees the same input in both
        assert all(torch.equal(a, b) for a, b in zip(t, s))


@pytest.mark.parametrize("tokens", [1, 5, 70])  # a decoding step, one chunk, chunks and a rest
@pytest.mark.parametrize("decay", [None, torch.tensor([0.9, 1.0])])
def test_features_whose_sums_overflow_are_refused_naming_log_space(tokens, decay):
    """Finite features near e^50 pass the input check, but their products pass fp32's e^88: every
    output would be NaN. The call refuses, naming the log-space option; the state has not moved."""
    phi = torch.full((1, 2, tokens, 4), math.exp(50.0))
    v = torch.randn(1, 2, tokens, 3)
    state = LinearState()
    with pytest.raises(ValueError, match=r"causal_linear_attention: .* overflow .*log_space=True"):
        causal_linear_attention(phi, phi, v, state=state, **options(decay, True))
    assert state.n == 0
    smaller = causal_linear_attention(phi / math.exp(20.0), phi, v, **options(decay, True))
    assert smaller.isfinite().all()  # e^30 · e^50 · 280 terms: finite


def test_calls_a_vendoring_engineer_makes_are_refused_by_name():
    """Each input that gave a wrong answer, uninitialised memory or NaN is refused before any
    work, naming the argument and what was expected."""
    phi = torch.rand(1, 2, 5, 4)
    v = torch.randn(1, 2, 5, 3)
    with pytest.raises(TypeError, match="v is torch.int64; expected a floating dtype"):
        causal_linear_attention(phi, phi, torch.ones(1, 2, 5, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="phi_k is torch.int32; expected a floating dtype"):
        causal_linear_attention(phi, phi.int(), v)
    with pytest.raises(ValueError, match="phi_q holds negative.* expected finite features >= 0"):
        causal_linear_attention(phi - 0.5, phi, v)
    with pytest.raises(ValueError, match="phi_k is on meta, v on cpu; expected one"):
        causal_linear_attention(phi, phi.to("meta"), v)
    overflowed = torch.randn(1, 2, 5, 4).mul(100).exp()  # features of ‖k‖ ≫ 5√d: inf in fp32
    with pytest.raises(ValueError, match=r"phi_q holds .* infinite .*log_space=True"):
        causal_linear_attention(overflowed, phi, v)
    with pytest.raises(ValueError, match="recurrent_step: q has 2 tokens; expected 1"):
        plain_forms.recurrent_step(phi[:, :, :2], phi[:, :, :2], v[:, :, :2],
                                        torch.zeros(1, 2, 4, 3))  # fmt: skip
