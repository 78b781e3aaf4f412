"""generate(): the cached path (KV cache for teachers, recurrent LinearState for students) against
the uncached forward pass, seeded sampling, and its errors."""

import copy
import json

import pytest
import torch
from conftest import FIXTURES, shared_path

from dofmini import load, load_tokenizer
from dofmini.generate import generate
from dofmini.linear_attention import LinearAttention, LinearState
from dofmini.students import replace_attention


def uncached_greedy(model, ids, n):
    """The full forward pass on the growing sequence, argmax of the last position.

    [B, T] -> [B, T + n].
    """
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)  # [B, T + 1]
    return ids


def cached_logits(model, ids, split):
    """Logits [B, T, V] from a prefill of ids[:, :split], then one call per token.

    Through the layers' caches.
    """
    caches = [block.attn.new_cache(ids.shape[0], ids.shape[1]) for block in model.blocks]
    with torch.no_grad():
        parts = [model(ids[:, :split], 0, caches)]
        parts += [model(ids[:, t : t + 1], t, caches) for t in range(split, ids.shape[1])]
    return torch.cat(parts, 1), caches


def student(teacher, dims, seed=0):
    return replace_attention(copy.deepcopy(teacher), dims, seed)


def fixture(name):
    return load(FIXTURES / name), json.loads((FIXTURES / name / "reference.json").read_text())


@pytest.mark.parametrize("name", ["gpt2-tiny", "neox-tiny"])
def test_teacher_greedy_matches_uncached_and_transformers(name):
    model, ref = fixture(name)
    out = generate(model, ref["greedy_prompt"], 20)
    assert out == uncached_greedy(model, torch.tensor([ref["greedy_prompt"]]), 20)[0].tolist()
    assert out == ref["greedy_ids"]  # transformers' own greedy decoding of this checkpoint
    batch = torch.tensor(
        ref["ids"]
    )  # [2, 12]: two different prompts decoded together, to position 52 of 64
    assert torch.equal(generate(model, batch, 40), uncached_greedy(model, batch, 40))


def test_standin_teacher_greedy_and_cached_logits(standin_gpt2):
    tok = load_tokenizer(shared_path("weights", "standin-gpt2"))
    prompt = torch.tensor(
        [tok.encode("The history of the city begins in the early twelfth century, when").ids]
    )
    ids = generate(standin_gpt2, prompt, 16)
    assert torch.equal(ids, uncached_greedy(standin_gpt2, prompt, 16))
    logits, caches = cached_logits(standin_gpt2, ids, prompt.shape[1])
    full = standin_gpt2(ids)  # [1, T, V]
    assert (logits - full).abs().max().item() < 1e-4 * full.abs().max().item()
    assert caches[0].length == ids.shape[1]


@pytest.mark.parametrize("name", ["gpt2-tiny", "neox-tiny"])
def test_student_recurrent_decode_equals_chunked_forward(name):
    teacher, ref = fixture(name)
    model = student(teacher, [3, 11])  # head_dim 8: fewer and more features than the head size
    ids = torch.randint(
        0, teacher.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)
    )
    logits, caches = cached_logits(
        model, ids, 5
    )  # 59 recurrent steps after a 5-token chunked prefill
    with torch.no_grad():
        full = model(ids)  # [2, 64, V] chunked form, no cache
    assert (logits - full).abs().max().item() < 1e-5 * full.abs().max().item()
    assert [tuple(c.S.shape) for c in caches] == [
        (2, 4, 3, 9),
        (2, 4, 11, 9),
    ]  # [B, H, M, d + 1], not T
    assert all(c.n == 64 for c in caches)
    batch = torch.tensor(ref["ids"])  # [2, 12]
    assert torch.equal(generate(model, batch, 40), uncached_greedy(model, batch, 40))


def test_standin_student_generates_as_its_chunked_forward(standin_gpt2):
    dims = [32, 96, 64, 48, 80, 64]
    model = student(standin_gpt2, dims)
    prompt = torch.randint(0, 50257, (1, 50), generator=torch.Generator().manual_seed(1))
    ids = generate(model, prompt, 24)  # decodes across the chunk boundary at 64
    assert torch.equal(ids, uncached_greedy(model, prompt, 24))
    ids = torch.cat([ids, prompt[:, :60]], 1)  # [1, 134]: past the next boundary at 128
    logits, caches = cached_logits(model, ids, 90)  # 44 recurrent steps
    with torch.no_grad():
        full = model(ids)  # [1, 134, V]
    assert (logits - full).abs().max().item() < 1e-5 * full.abs().max().item()
    assert all(
        isinstance(c, LinearState) and c.S.shape[2:] == (m, 65) for c, m in zip(caches, dims)
    )


def test_mixed_softmax_and_linear_layers_share_one_generate():
    teacher, ref = fixture("gpt2-tiny")
    model = copy.deepcopy(teacher)
    model.blocks[1].attn = LinearAttention(
        model.blocks[1].attn, 6, seed=3
    )  # layer 0 keeps softmax and a KV cache
    prompt = torch.tensor(ref["ids"])
    assert torch.equal(generate(model, prompt, 30), uncached_greedy(model, prompt, 30))
    one = prompt[:, :1]  # a 1-token prompt: even the prefill takes the recurrent step
    assert torch.equal(generate(model, one, 20), uncached_greedy(model, one, 20))


def test_sampling_is_seeded_and_respects_top_k():
    model, ref = fixture("neox-tiny")
    prompt = torch.tensor(ref["ids"])  # [2, 12]
    a = generate(model, prompt, 40, temperature=1.0, seed=7)
    assert torch.equal(a, generate(model, prompt, 40, temperature=1.0, seed=7))
    assert not torch.equal(a, generate(model, prompt, 40, temperature=1.0, seed=8))
    assert torch.equal(
        generate(model, prompt, 40, temperature=0.7, top_k=1, seed=7), generate(model, prompt, 40)
    )
    ids = generate(model, prompt, 40, temperature=2.0, top_k=3, seed=7)
    with torch.no_grad():
        top3 = (
            model(ids[:, :-1])[:, 11:].topk(3, -1).indices
        )  # [2, 40, 3] the allowed tokens at each new position
    assert (top3 == ids[:, 12:, None]).any(-1).all()


def test_input_forms_and_errors():
    model, ref = fixture("gpt2-tiny")  # n_ctx = 64
    prompt = ref["greedy_prompt"]
    assert isinstance(generate(model, prompt, 3), list)
    assert generate(model, torch.tensor(prompt), 3).shape == (len(prompt) + 3,)
    assert generate(model, prompt, 0) == prompt
    with pytest.raises(ValueError, match="n_ctx=64"):
        generate(model, prompt, 65 - len(prompt))
    with pytest.raises(ValueError, match="explicit seed"):
        generate(model, prompt, 3, temperature=1.0)
    with pytest.raises(ValueError, match="shape"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), 3)


def bad_calls():
    """(call on the gpt2-tiny fixture, the error it must raise): each public function refuses a
    value that would run silently wrong or fail deep inside, naming the function and the value."""
    from dofmini.distill import TrainSettings
    from dofmini.dof import allocate, estimate_dof
    from dofmini.students import make_student
    from dofmini.study.evaluate import layer_errors, perplexity

    ids = torch.arange(64) % 96  # [64] valid ids
    return [
        (lambda m: generate(m, [1, -2, 3], 2), r"generate: token ids span -2..3; expected .*96\)"),
        (lambda m: generate(m, [1.5, 2.0], 2), r"generate: token_ids torch.float32 .* integers"),
        (lambda m: generate(m, [1, 96], 2), r"generate: token ids span 1..96; expected ids in"),
        (lambda m: generate(m, [1], 2.5), r"generate: n=2.5; expected an integer >= 0"),
        (lambda m: generate(m, [1], -1), r"generate: n=-1; expected an integer >= 0"),
        (lambda m: generate(m, [1], 2, temperature=float("nan"), seed=0), r"temperature=nan"),
        (lambda m: estimate_dof(m, -ids, 0.1, J=8, ctx=16), r"sample_queries_keys: token ids"),
        (lambda m: estimate_dof(m, ids.float(), 0.1, J=8, ctx=16), r"torch.float32 \(64,\)"),
        (lambda m: estimate_dof(m, ids, 0.1, J=-5, ctx=16), r"J=-5; expected an integer >= 1"),
        (lambda m: perplexity(m, ids - 5, 16), r"perplexity: token ids span -5..58"),
        (lambda m: perplexity(m, ids + 0.5, 16), r"perplexity: token_ids torch.float32"),
        (lambda m: m(ids[None, :4], -5), r"positions -5..-2 requested; .* has 0..63"),
        (lambda m: make_student(m, "prf", [2.5, 8], 0), r"make_student: dims\[0\]=2.5; expected"),
        (lambda m: make_student(m, "prf", [8, 0], 0), r"make_student: dims\[1\]=0; expected"),
        (lambda m: TrainSettings(lr=float("nan")), r"TrainSettings: lr=nan; expected a positive"),
        (lambda m: TrainSettings(lr_a=-1.0), r"TrainSettings: lr_a=-1.0; expected a positive"),
        (lambda m: layer_errors(m, m, ids, 16, 2, chunk=2.5), r"layer_errors: chunk=2.5"),
        (lambda m: allocate([1.0, 2.0], float("nan")), r"allocate: budget=nan; expected an int"),
        (lambda m: allocate([[], []], 8), r"allocate: layer_dof \[\[\], \[\]\]; expected positive"),
        (lambda m: allocate([], 8), r"allocate: layer_dof \[\]; expected positive finite \[L\]"),
    ]


@pytest.mark.parametrize("index", range(len(bad_calls())))
def test_public_functions_refuse_bad_values_by_name(index):
    call, message = bad_calls()[index]
    with pytest.raises(ValueError, match=message):
        call(load(FIXTURES / "gpt2-tiny"))
