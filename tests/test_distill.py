"""Layerwise distillation and the direct baseline: training lowers held-out error on the GPT-2
stand-in, the metrics and gradients match a dense float64 reference, and only z and α ever change.
Resuming from progress files: test_runs.py; student files (reproducible bytes, exact reloads):
test_core_on_fixtures.py."""

import copy
import hashlib
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import data_path, shared_path

from dofmini import load_tokenizer
from dofmini.distill import (
    TrainSettings,
    distill,
    distill_layers,
    layer_backward,
    train_direct,
)
from dofmini.files import changed_settings
from dofmini.linear_attention import PRFFeatures, causal_linear_attention
from dofmini.students import make_student
from dofmini.study import bank, compute, devices, store
from dofmini.study.evaluate import layer_errors, layer_pass, perplexity
from dofmini.study.run import Run
from dofmini.tensor_files import read_tensors

S = TrainSettings


quiet = lambda line: None


@pytest.fixture(scope="module")
def wiki():
    """(training ids, held-out ids): two disjoint slices of WikiText-2 validation, GPT-2 tokens."""
    text = data_path("wikitext-2-raw", "wiki.valid.raw").read_text(encoding="utf-8")
    tokenizer = load_tokenizer(shared_path("weights", "standin-gpt2"))
    return tuple(
        torch.tensor(tokenizer.encode(part).ids) for part in (text[:60_000], text[300_000:330_000])
    )


def tensors_hash(model) -> str:
    parts = (n.encode() + t.contiguous().numpy().tobytes() for n, t in model.state_dict().items())
    return hashlib.sha256(b"".join(parts)).hexdigest()


def trainable(student) -> dict:
    return {n: p.detach().clone() for n, p in student.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("loss, metric", [("l2", "kernel_l2"), ("softmax", "kl")])
def test_each_loss_beats_the_performer_draw_on_heldout_text(standin_gpt2, wiki, loss, metric):
    train, held = wiki
    dims = [64] * standin_gpt2.config.n_layer
    settings = S(steps=30, batch=2, ctx=64)
    student, _ = distill(standin_gpt2, dims, train, settings, loss=loss, log=quiet)
    before, after = (
        layer_errors(standin_gpt2, st, held, 64, windows=8, batch=4)
        for st in (make_student(standin_gpt2, "prf", dims, 0), student)
    )
    # kl is the softmax loss minus the teacher's own entropy: lower kl, lower held-out softmax loss
    for name in (metric, "output_rel"):
        assert all(a < b for a, b in zip(after[name], before[name])), (before[name], after[name])


def test_direct_training_lowers_heldout_lm_loss(standin_gpt2, wiki):
    train, held = wiki
    student = make_student(standin_gpt2, "prf", [64] * standin_gpt2.config.n_layer, 0)
    before = perplexity(student, held[:1024], ctx=64)[0]
    train_direct(student, train, S(steps=10, batch=2, ctx=64), log=quiet)
    after = perplexity(student, held[:1024], ctx=64)[0]
    assert after < before


def dense_losses(features, q, k):
    """(l2 loss, softmax loss, KL) per head [H] and the teacher's and student's attention rows, from
    the full T×T matrices in float64 with K̂ = exp(log Φ(q))·exp(log Φ(k)), unshifted (the tiny
    model's features are far from float64's limits)."""
    B, H, T, d = q.shape
    q, k = q.double(), k.double()
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    s = (q @ k.mT / math.sqrt(d)).masked_fill(~causal, -math.inf)  # [B, H, T, T]
    m = s.amax(-1, keepdim=True)
    phi_q, phi_k = (features.log_features(x).exp() for x in (q, k))  # [B, H, T, M]
    k_hat = (phi_q @ phi_k.mT) * causal  # [B, H, T, T]
    l2 = (k_hat * torch.exp(-m) - torch.exp(s - m)).square().sum((0, 2, 3)) / (B * T * (T + 1) / 2)
    p, p_hat = s.softmax(-1), k_hat / k_hat.sum(-1, keepdim=True)
    ce = -(p * torch.where(causal, p_hat, 1).log()).sum((0, 2, 3)) / (B * T)
    return l2, ce, ce + torch.xlogy(p, p).sum((0, 2, 3)) / (B * T), p, p_hat


def tiny_capture(tiny, tiny_ids, batch, ctx):
    capture = []
    with torch.no_grad():
        tiny(tiny_ids[: batch * ctx].view(batch, ctx), capture=capture)
    return capture


def trained_tiny(tiny, tiny_ids, loss):
    settings = S(steps=3, batch=2, ctx=32, data_seed=1)
    return distill(tiny, [5, 12], tiny_ids, settings, loss=loss, feature_seed=1, log=quiet)[0]


def test_metrics_match_a_dense_float64_reference_at_any_chunk(tiny, tiny_ids):
    student = trained_tiny(tiny, tiny_ids, "softmax")
    # layer_errors runs in float32 (the default), layer_pass in float64 on request
    got = [layer_errors(tiny, student, tiny_ids, 32, windows=4, batch=2, chunk=c) for c in (7, 256)]
    for layer, (q, k, v) in enumerate(tiny_capture(tiny, tiny_ids, 4, 32)):
        features = student.blocks[layer].attn.features
        with torch.no_grad():
            l2, _, kl, p, _ = dense_losses(features, q, k)
            exact = [
                layer_pass(features, q, k, v, {"l2", "kl"}, c, dtype=torch.float64)
                for c in (7, 256)
            ]
            # the output as the student's forward pass computes it: chunked linear attention in fp32
            phi_q, phi_k = (features.log_features(x).exp() for x in (q, k))  # [B, H, T, M]
            y_hat = causal_linear_attention(phi_q, phi_k, v, chunk=8)  # [B, H, T, d]
        y = p @ v.double()  # [B, H, T, d]
        rel = ((y_hat - y).square().sum((0, 2, 3)) / y.square().sum((0, 2, 3))).sqrt().mean()
        for terms in exact:
            assert terms["l2"].mean().item() == pytest.approx(l2.mean().item(), rel=1e-9)
            assert terms["kl"].mean().item() == pytest.approx(kl.mean().item(), rel=1e-9)
        for errors in got:
            assert errors["kernel_l2"][layer] == pytest.approx(l2.mean().item(), rel=1e-5)
            assert errors["kl"][layer] == pytest.approx(kl.mean().item(), rel=1e-5)
            assert errors["output_rel"][layer] == pytest.approx(rel.item(), rel=1e-4)  # fp32 y_hat


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-9), (torch.float32, 1e-5)])
@pytest.mark.parametrize("loss", ["l2", "softmax"])
def test_chunked_backward_gives_the_dense_gradient(tiny, tiny_ids, loss, dtype, tol):
    student = trained_tiny(tiny, tiny_ids, "l2")
    for layer, (q, k, _) in enumerate(tiny_capture(tiny, tiny_ids, 2, 32)):
        features = student.blocks[layer].attn.features
        dense = dense_losses(features, q, k)[0 if loss == "l2" else 1].mean()
        dense.backward()
        expected = [features.z.grad.clone(), features.a.grad.clone()]
        features.zero_grad()
        term = "l2" if loss == "l2" else "ce"
        value = layer_backward(features, q.to(dtype), k.to(dtype), term, chunk=5)
        assert value.mean().item() == pytest.approx(dense.item(), rel=tol)
        for got, want in zip([features.z.grad, features.a.grad], expected):
            gap, scale = (got - want).abs().max(), want.abs().max()
            assert gap <= max(tol, 1e-5) * scale, (gap, scale)
        features.zero_grad()


def far_from_every_z():
    """PRF features and (q, k, v) [1, 2, 6, 8] whose keys 2 and 4 lie far from every z: each of
    their features is below float32's range once shifted by |z_m|²/2 as PRFFeatures.keys does."""
    features = PRFFeatures(2, 8, 16, seed=0)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=gen) for _ in range(3))  # [1, 2, 6, 8]
    k[:, :, 2] = 34 * k[:, :, 2] / k[:, :, 2].norm(dim=-1, keepdim=True)  # |k/d^¼| = 20
    k[:, :, 4] = -34 * k[:, :, 4] / k[:, :, 4].norm(dim=-1, keepdim=True)
    q[:, :, 3:] += 0.2 * k[:, :, 2:3]  # later queries attend to key 2 (p up to ~1)
    return features, q, k, v


def test_float32_terms_stay_exact_for_keys_far_from_every_z():
    features, q, k, v = far_from_every_z()
    with torch.no_grad():
        shifted = features.log_features(k) - 0.5 * features.z.square().sum(-1)[:, None]
    assert (shifted[:, :, [2, 4]] < math.log(torch.finfo(torch.float32).tiny)).all()
    want = {"l2", "kl", "err"}
    wide, narrow = (layer_pass(features, q, k, v, want, 4, dtype=t) for t in DTYPE_PAIR)
    for name in want:
        assert torch.isfinite(narrow[name]).all(), (name, narrow[name])
        torch.testing.assert_close(narrow[name].double(), wide[name], rtol=1e-4, atol=1e-7)
    for term in ("l2", "ce"):
        grads = []
        for dtype in DTYPE_PAIR:
            layer_backward(features, q.to(dtype), k.to(dtype), term, 4)
            grads.append(features.z.grad.double())
            features.zero_grad()
        assert torch.isfinite(grads[1]).all()
        assert (grads[1] - grads[0]).abs().max() <= 1e-4 * grads[0].abs().max()


DTYPE_PAIR = (torch.float64, torch.float32)


@pytest.mark.parametrize("loss", ["l2", "softmax", "direct"])
def test_only_z_and_alpha_change_and_the_teacher_stays_intact(tiny, tiny_ids, loss):
    teacher_hash = tensors_hash(tiny)
    start = make_student(tiny, "prf", [8, 3], 2)
    before = {n: t.clone() for n, t in start.state_dict().items()}
    settings = S(steps=3, batch=2, ctx=32, data_seed=2)
    if loss == "direct":
        student, _ = train_direct(start, tiny_ids, settings, log=quiet)
    else:
        student, _ = distill(tiny, [8, 3], tiny_ids, settings, loss=loss, feature_seed=2, log=quiet)
    after = student.state_dict()
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed == {f"blocks.{i}.attn.features.{p}" for i in range(2) for p in "za"}
    assert set(trainable(student)) == changed
    assert tensors_hash(tiny) == teacher_hash
    assert student.wte.data_ptr() == tiny.wte.data_ptr()  # shared, not copied
    assert all(type(block.attn).__name__ == "Attention" for block in tiny.blocks)


def test_direct_loss_gradients_reach_only_z_and_alpha(tiny, tiny_ids):
    student = make_student(tiny, "prf", [8, 3], 0)
    logits = student(tiny_ids[:64].view(2, 32))  # [2, 32, V]
    targets = tiny_ids[:64].view(2, 32)[:, 1:]  # [2, 31]
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten()).backward()
    with_grad = {n for n, p in student.named_parameters() if p.grad is not None}
    assert with_grad == {f"blocks.{i}.attn.features.{p}" for i in range(2) for p in "za"}
    assert all(p.grad is None for p in tiny.parameters())


def test_changed_settings_names_every_differing_or_missing_key():
    assert changed_settings({"lr": 0.1, "b": 1}, {"lr": 0.1, "b": 1}) == ""
    assert changed_settings({"lr": 0.1, "x": None}, {"lr": 0.2, "b": 1}) == "b, lr, x"


@pytest.mark.parametrize(
    "dims, loss, ctx, message",
    [
        ([4, 4], "kl", 32, "loss='kl'"),
        ([4, 4], "l2", 65, "ctx <= 64"),
        ([4], "l2", 32, "1 dims for 2 layers"),
    ],
)
def test_bad_settings_are_named(tiny, tiny_ids, dims, loss, ctx, message):
    with pytest.raises(ValueError, match=message):
        distill(tiny, dims, tiny_ids, S(steps=1, batch=1, ctx=ctx), loss=loss, log=quiet)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"steps": 0}, "steps=0"), ({"ctx": 1}, "ctx=1"), ({"dtype": "float16"}, "'float16'")],
)
def test_bad_train_settings_are_named_before_any_work(kwargs, message):
    with pytest.raises(ValueError, match=message):
        S(**kwargs)


def test_layers_trained_alone_assemble_the_jointly_trained_student_bit_for_bit(tiny, tiny_ids):
    """Each layer learns from its own teacher q, k (seed + layer, the same windows, Adam per
    tensor): layer l with M features is one tensor whichever student it sits in."""
    settings = S(steps=2, batch=2, ctx=16, data_seed=3, log_every=1)
    joint, record = distill(tiny, [3, 5], tiny_ids, settings, feature_seed=3, log=quiet)
    curves = []
    options = dict(loss="softmax", feature_seed=3, log=quiet)
    for layer, m in enumerate([3, 5]):
        trained, info = distill_layers(tiny, [(layer, m)], tiny_ids, settings, **options)
        alone = trained[layer, m]
        mine = joint.blocks[layer].attn.features
        assert torch.equal(alone.z, mine.z) and torch.equal(alone.a, mine.a)
        curves.append(info["loss_curve"])
    mean = [[a[0], (a[1] + b[1]) / 2] for a, b in zip(*curves)]
    assert mean == record["loss_curve"]  # the logged mean too, to the bit
    # a bank's pass: one layer at two feature counts beside another, each the tensor it is alone
    pairs = [(0, 7), (1, 5), (0, 3)]
    banked, info = distill_layers(tiny, pairs, tiny_ids, settings, **options)
    for layer, m in [(0, 3), (1, 5)]:
        mine = joint.blocks[layer].attn.features
        assert torch.equal(banked[layer, m].z, mine.z) and torch.equal(banked[layer, m].a, mine.a)
    assert [len(means) for _, means in info["layer_curves"]] == [3, 3]


@pytest.mark.parametrize("loss", ["softmax", "l2"])
def test_losses_stay_finite_for_queries_and_keys_scaled_100_times(tiny, tiny_ids, loss):
    """Issue 45: q·k x10⁴ leaves a query's and a key's unit features no shared m (their product 0
    in float32) while the teacher's attention is finite; the pairs it attends to are recomputed
    in log space, so training and evaluation see finite losses and gradients."""
    big = copy.deepcopy(tiny)
    d_model = big.config.d_model
    for block in big.blocks:
        block.attn.qkv_w[:, : 2 * d_model] *= 100  # q and k, not v
        block.attn.qkv_b[: 2 * d_model] *= 100
    assert torch.isfinite(big(tiny_ids[:64].view(2, 32))).all()
    settings = S(steps=2, batch=2, ctx=32)
    student, record = distill(big, [3, 5], tiny_ids, settings, loss=loss, log=quiet)
    assert all(math.isfinite(loss) for _, loss in record["loss_curve"])
    errors = layer_errors(big, student, tiny_ids, 32, windows=2, batch=2)
    assert all(math.isfinite(x) for name in ("kl", "kernel_l2") for x in errors[name])


def bank_run(tiny, tiny_ids, out):
    """A run of the tiny model whose students train 2 steps of 2 windows of 16 tokens into out."""
    cfg = SimpleNamespace(
        out=out, steps=2, batch=2, lr=0.02, lr_a=0.2, train_chars=None, per_device=1
    )
    inputs = {"teacher": tiny.identity, "tokenizer": "t", "device": "cpu/float32"}
    return Run(cfg, tiny, None, 16, 0.0625, (4,), inputs, texts={"train": tiny_ids})


def trained_units(run, specs) -> list:
    """Whether each distinct unit of `specs` is trained, in order of first use."""
    return [bank.is_trained(run, unit) for unit in bank.distinct_units(run, specs)]


def train_student(run, spec, together=()) -> tuple:
    """(The student trained as the pipeline trains it, its training record)."""
    compute.train_student(run, spec, together)
    return compute.load(run, spec), store.saved(spec.path(run.cfg.out), spec.key)["info"]


def test_a_second_rule_trains_only_the_units_no_earlier_student_had(tiny, tiny_ids, tmp_path):
    run = bank_run(tiny, tiny_ids, tmp_path)
    first = run.student("fix", "softmax", 4, 0, (3, 5))
    second = run.student("dof", "softmax", 4, 0, (3, 7))  # layer 0 as the first's
    units = ["softmax/l0/m3/s0", "softmax/l1/m5/s0", "softmax/l1/m7/s0"]
    assert [u.name for u in bank.distinct_units(run, [first, second])] == units
    assert not any(trained_units(run, [first, second]))
    lines = []
    bank.train_units(run, [run.unit("softmax", 0, 3, 0)], log=lines.append)
    second_units = bank.units_of(run, second)  # the second rule's: layer 0 trained already
    assert bank.train_units(run, second_units, log=lines.append) == second_units[1:]
    said = [line for line in lines if line.startswith("units trained already, not again")]
    assert len(said) == 1 and said[0].endswith(": softmax/l0/m3/s0")
    assert trained_units(run, [first, second]) == [True, False, True]
    assembled, info = train_student(run, second)
    settings = run.settings(0)
    joint, record = distill(tiny, (3, 7), tiny_ids, settings, share=devices.shared, log=quiet)
    assert tensors_hash(assembled) == tensors_hash(joint) and info == {**record, **info}
    assert info["loss_curve"] == record["loss_curve"]
    assert trained_units(run, [first, second]) == [True, False, True]


def test_a_unit_file_cut_short_is_named_and_trained_again(tiny, tiny_ids, tmp_path, capsys):
    """Whether a unit is trained is read from its file's header alone; opening it still checks
    that the header covers the whole file, so one cut short is not taken for trained."""
    run = bank_run(tiny, tiny_ids, tmp_path)
    unit = run.unit("softmax", 0, 3, 0)
    bank.train_units(run, [unit], log=quiet)
    path = unit.path(tmp_path)
    stored, record = read_tensors(path)
    assert read_tensors(path, tensors=False) == ({}, record)  # the header's record, no tensors
    assert trained_units(run, [run.student("fix", "softmax", 4, 0, (3,))]) == [True]
    cut = path.read_bytes()[:-8]
    path.unlink()  # a new file: `stored` may still be mapped from the old one
    path.write_bytes(cut)
    capsys.readouterr()
    assert not bank.is_trained(run, unit)
    lines = []
    assert bank.train_units(run, [unit], log=lines.append) == [unit]
    assert any(line.startswith(f"redo: cannot read {path}") for line in lines), lines
    again = read_tensors(path)
    assert again[0].keys() == stored.keys()
    assert all(torch.equal(again[0][name], stored[name]) for name in stored)


def test_the_first_student_to_train_trains_its_seeds_known_units_in_one_pass(
    tiny, tiny_ids, tmp_path
):
    """Its batch: the units of every student of its loss and seed whose dims are known; the
    next student's units are then all trained, and it is the student trained alone."""
    run = bank_run(tiny, tiny_ids, tmp_path)
    first = run.student("fix", "softmax", 4, 0, (3, 5))
    second = run.student("dof", "softmax", 4, 0, (3, 7))
    other_seed = run.student("fix", "softmax", 4, 1, (3, 5))
    unknown = run.student("oracle", "softmax", 4, 0, None)  # dims from curves not yet made
    together = [first, second, other_seed, unknown]
    batch = bank.to_train(run, first, together)
    assert [u.name for u in batch] == ["softmax/l0/m3/s0", "softmax/l1/m5/s0", "softmax/l1/m7/s0"]
    train_student(run, first, together)
    assert all(trained_units(run, [first, second]))
    records = [read_tensors(u.path(tmp_path))[1] for u in batch]
    assert len({r["info"]["train_seconds"] for r in records}) == 1  # equal shares of one pass
    assert not any(trained_units(run, [other_seed]))
    assert bank.to_train(run, second, together) == []  # nothing left to train
    assembled, info = train_student(run, second, together)
    settings = run.settings(0)
    joint, record = distill(tiny, (3, 7), tiny_ids, settings, share=devices.shared, log=quiet)
    assert tensors_hash(assembled) == tensors_hash(joint)
    assert info["loss_curve"] == record["loss_curve"]
