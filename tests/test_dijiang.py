"""DiJiang baseline (dofmini/dijiang.py): the DCT-II matrix and seeded projection, softmax features,
the module's chunked forward against a quadratic reference written out here, token-by-token decoding
of a whole swapped model, causality, which tensors train, placement on the teacher's device, the
student file round trip, and a short end-to-end training run."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import FIXTURES

from dofmini import load
from dofmini.dijiang import DiJiangAttention, dct_matrix, dijiang_projection
from dofmini.distill import TrainSettings, train_direct
from dofmini.students import load_student, make_student, save_student

NEW_PARAMS = {"decay_logit", "norm.weight", "norm.bias", "gate"}


def make_dijiang(teacher, seed):
    return make_student(
        teacher, "dijiang", [teacher.config.head_dim] * teacher.config.n_layer, seed
    )


def perturbed(student, seed=0):
    """The student with every new tensor moved off its init, as training would leave it."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in student.parameters():
            if p.requires_grad:
                p.add_(0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return student


@pytest.mark.parametrize("d", [1, 2, 7, 64])
def test_dct_matrix_is_the_orthonormal_dct_ii(d):
    C = dct_matrix(d)
    assert torch.allclose(C @ C.T, torch.eye(d, dtype=torch.float64), atol=1e-12)
    # Independent route (Makhoul): the DCT-II of x from one FFT of its even samples then its odd
    # ones reversed.
    x = torch.randn(d, generator=torch.Generator().manual_seed(d), dtype=torch.float64)
    k = torch.arange(d, dtype=torch.float64)
    X = (
        2
        * (
            torch.fft.fft(torch.cat([x[::2], x[1::2].flip(0)]))
            * torch.exp(-1j * math.pi * k / (2 * d))
        ).real
    )
    X = X * torch.where(k == 0, math.sqrt(1 / (4 * d)), math.sqrt(1 / (2 * d)))
    assert torch.allclose(C @ x, X, atol=1e-12)


def test_projection_is_seeded_dct_times_normal_quantiles():
    draw = lambda seed: dijiang_projection(16, torch.Generator().manual_seed(seed))  # noqa: E731
    P = draw(3)
    assert torch.equal(P, draw(3)) and not torch.allclose(P, draw(4))
    w = P[0] / dct_matrix(16)[0]  # F⁻¹(u_j): the DCT's first row is the constant 1/√d
    assert torch.allclose(P, dct_matrix(16) * w, atol=1e-12)
    u = torch.rand(16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert torch.allclose(w, torch.special.ndtri(u), atol=1e-12)
    model = make_dijiang(load(FIXTURES / "gpt2-tiny"), 5)  # layer i draws with seed + i
    for i, block in enumerate(model.blocks):
        assert torch.equal(
            block.attn.proj, dijiang_projection(8, torch.Generator().manual_seed(5 + i)).float()
        )


def test_features_are_a_softmax_and_decay_starts_at_the_papers_values():
    attn = make_dijiang(load(FIXTURES / "gpt2-tiny"), 0).blocks[0].attn
    q = 100 * torch.randn(2, 4, 9, 8, generator=torch.Generator().manual_seed(0))  # large norms too
    phi = attn.phi(q)  # [2, 4, 9, 8]
    assert bool((phi >= 0).all()) and torch.allclose(phi.sum(-1), torch.ones(2, 4, 9))
    assert torch.allclose(phi, torch.softmax(q @ attn.proj, -1))
    want = 1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), 4))
    assert torch.allclose(torch.sigmoid(attn.decay_logit), want, rtol=0, atol=1e-6)  # γ


def quadratic_reference(attn: DiJiangAttention, x):
    """The module's output from its definition.

    T×T decayed scores, per-head GroupNorm, SiLU gate, projection.
    """
    q, k, v = attn.base.project(x)  # [B, H, T, d] each
    B, H, T, d = q.shape
    lag = torch.arange(T)[:, None] - torch.arange(T)[None]  # [T, T]
    gamma = torch.sigmoid(attn.decay_logit)[:, None, None]  # [H, 1, 1]
    decay = torch.where(lag >= 0, gamma ** lag.clamp_min(0), 0)  # [H, T, T]
    o = (
        (torch.softmax(q @ attn.proj, -1) @ torch.softmax(k @ attn.proj, -1).mT) * decay
    ) @ v  # [B, H, T, d]
    mean, var = o.mean(-1, keepdim=True), o.var(-1, unbiased=False, keepdim=True)
    o = (o - mean) / (var + attn.norm.eps).sqrt() * attn.norm.weight.view(
        H, 1, d
    ) + attn.norm.bias.view(H, 1, d)
    gate = F.silu(x @ attn.gate / math.sqrt(H * d)).view(B, T, H, d).transpose(1, 2)  # [B, H, T, d]
    return attn.base.output(gate * o)


@pytest.mark.parametrize("T,chunk", [(23, 5), (16, 4), (1, 8), (30, 64)])
def test_chunked_forward_matches_the_quadratic_reference(T, chunk):
    attn = (
        perturbed(make_dijiang(load(FIXTURES / "gpt2-tiny", dtype=torch.float64), 1).double())
        .blocks[1]
        .attn
    )
    attn.chunk = chunk
    x = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(T), dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(attn(x), quadratic_reference(attn, x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ["gpt2-tiny", "neox-tiny"])
def test_recurrent_decoding_matches_the_full_forward(name):
    student = perturbed(make_dijiang(load(FIXTURES / name), 2))
    for block in student.blocks:
        block.attn.chunk = 4  # prefills span several chunks plus a remainder
    ids = torch.randint(
        0, student.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        full = student(ids)  # [2, 24, V]
        caches = [block.attn.new_cache(2, 24) for block in student.blocks]
        steps = [
            student(ids[:, :9], 0, caches),
            student(ids[:, 9:16], 9, caches),
        ]  # prefill, then from a state
        steps += [student(ids[:, t : t + 1], t, caches) for t in range(16, 24)]
    assert torch.allclose(
        torch.cat(steps, 1), full, rtol=0, atol=2e-5
    )  # fp32, logits up to ~5; seen 2e-6
    with pytest.raises(ValueError, match="cache holds 24 tokens but start=3"):
        student(ids[:, :1], 3, caches)


def test_causal_and_only_the_new_tensors_train():
    teacher = load(FIXTURES / "gpt2-tiny")
    student = perturbed(make_dijiang(teacher, 3))
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    later = ids.clone()
    later[:, 25:] = (later[:, 25:] + 1) % 96
    logits = student(ids)  # [2, 40, V]
    assert torch.equal(logits[:, :25], student(later)[:, :25].detach())
    logits.logsumexp(-1).mean().backward()
    trained = {n for n, p in student.named_parameters() if p.requires_grad}
    assert trained == {f"blocks.{i}.attn.{n}" for i in range(2) for n in NEW_PARAMS}
    assert all(p.grad is None for n, p in student.named_parameters() if n not in trained)
    assert all(
        bool(p.grad.isfinite().all()) and p.grad.abs().sum() > 0
        for n, p in student.named_parameters()
        if n in trained
    )
    assert all(
        type(block.attn).__name__ == "Attention" for block in teacher.blocks
    )  # the teacher is untouched


def test_built_on_the_teachers_device_and_its_forward_reads_nothing_back():
    """A DiJiang student of a model on the 'meta' device (no data: a value read back to the host,
    as the old per-forward decay check did, fails there): every tensor lands on 'meta' and a
    forward pass and a decoding step run through."""
    model = make_dijiang(load(FIXTURES / "gpt2-tiny").to("meta"), 0)
    assert {t.device.type for t in (*model.parameters(), *model.buffers())} == {"meta"}
    ids = torch.zeros(1, 9, dtype=torch.long, device="meta")
    caches = [b.attn.new_cache(1, 10) for b in model.blocks]
    with torch.no_grad():
        assert model(ids).shape == (1, 9, 96)
        model(ids, 0, caches)
        assert model(ids[:, :1], 9, caches).shape == (1, 1, 96)


def test_student_file_round_trip(tmp_path):
    teacher = load(FIXTURES / "gpt2-tiny")
    student = perturbed(make_dijiang(teacher, 4))
    save_student(student, tmp_path / "dj.safetensors", {"loss": "direct"})
    loaded, meta = load_student(teacher, tmp_path / "dj.safetensors")
    expected = {"kind": "dijiang", "dims": [8, 8], "feature_seed": 4, "loss": "direct"}
    assert meta == {**expected, "teacher": teacher.identity}
    ids = torch.arange(30)[None] % 96
    with torch.no_grad():
        assert torch.equal(loaded(ids), student(ids))


def test_short_direct_training_lowers_the_lm_loss():
    """20 steps of distill.train_direct on a sequence the tiny model can learn to continue only
    through its attention (a random 13-token pattern, repeated), loss measured on windows it did not
    train on."""
    student = make_dijiang(load(FIXTURES / "gpt2-tiny"), 0)
    seq = torch.randint(0, 96, (13,), generator=torch.Generator().manual_seed(0)).repeat(
        200
    )  # [2600]
    train, held = seq[:2000], seq[2000:2256].view(8, 32)

    def held_loss():
        with torch.no_grad():
            return F.cross_entropy(
                student(held[:, :-1]).flatten(0, 1), held[:, 1:].flatten()
            ).item()

    before = held_loss()
    settings = TrainSettings(steps=20, batch=4, ctx=32, data_seed=0)
    train_direct(student, train, settings, log=lambda line: None)
    assert held_loss() < before - 0.5  # seen: 5.06 -> 3.39
