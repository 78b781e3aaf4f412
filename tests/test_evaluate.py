"""Perplexity and task scoring against direct computations: a bigram model whose log-likelihoods
are known in closed form, the tiny transformers-made fixture, and the stand-in teachers'
reference.json."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import FIXTURES, data_path, shared_path
from tokenizers import Tokenizer, models, pre_tokenizers
from torch import nn

from dofmini import load, load_tokenizer
from dofmini.study.evaluate import (
    PPL_TEXTS,
    evaluate_model,
    perplexity,
    score_examples,
    score_requests,
)
from dofmini.study.tasks import DataError, Example

WORDS = ["q", "x", "y", "the", "cat", "dog", "ran", "far"]


class Bigram(nn.Module):
    """Next-token log-probabilities = table[current token]: each score is a sum of table entries."""

    def __init__(self, probs: dict):
        super().__init__()
        self.config = SimpleNamespace(n_ctx=16, name="bigram", vocab_size=len(WORDS))
        V = len(WORDS)
        table = torch.zeros(V, V, dtype=torch.float64)  # [V, V]
        for a, word in enumerate(WORDS):
            row = {WORDS.index(b): p for (a_, b), p in probs.items() if a_ == word}
            table[a] = (1 - sum(row.values())) / (
                V - len(row)
            )  # the leftover spread over the other words
            table[a, list(row)] = torch.tensor(list(row.values()), dtype=torch.float64)
        self.table = nn.Parameter(
            table.log().float(), requires_grad=False
        )  # a weight: evaluate finds its device

    def forward(self, ids, keep=None):
        logprobs = self.table[ids]  # [B, T, V]
        return logprobs if keep is None else logprobs[keep]  # [N, V] as dofmini.model.Model gives


def encode_file(path, tokenizer) -> torch.Tensor:
    """The whole file read as UTF-8 and encoded in one call: the reference protocol, as
    reproduce.py's token caches do it."""
    return torch.tensor(tokenizer.encode(path.read_text(encoding="utf-8")).ids)


@pytest.fixture(scope="module")
def word_tokenizer():
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


@pytest.fixture(scope="module")
def bigram():
    return Bigram(
        {
            ("q", "x"): 0.5,
            ("q", "y"): 0.3,
            ("y", "y"): 0.9,
            ("y", "x"): 0.05,
            ("the", "cat"): 0.05,
            ("the", "dog"): 0.9,
            ("cat", "ran"): 0.8,
            ("dog", "ran"): 0.1,
            ("ran", "far"): 0.5,
        }
    )


def test_scores_are_the_bigram_sums(bigram):
    got = score_requests(bigram, [([0], [1]), ([0], [2, 2]), ([3, 4], [6, 7])])
    want = [math.log(0.5), math.log(0.3 * 0.9), math.log(0.8 * 0.5)]
    assert [s for s, _ in got] == pytest.approx(want, abs=1e-4)
    assert [g for _, g in got] == [True, False, True]  # after q the argmax is x, not y


def test_acc_and_acc_norm_pick_the_expected_choices(bigram, word_tokenizer):
    # " x": log 0.5 = -0.69 over 1 char; " y y": log 0.27 = -1.31 over 3 chars (-0.44 per char).
    plain = [Example(["q", "q"], [" x", " y y"], 0)]
    assert score_examples(bigram, word_tokenizer, plain) == {"acc": 1.0, "acc_norm": 0.0, "n": 1}
    flipped = [Example(["q", "q"], [" x", " y y"], 1)]
    assert score_examples(bigram, word_tokenizer, flipped) == {"acc": 0.0, "acc_norm": 1.0, "n": 1}


def test_a_choice_longer_than_the_context_is_refused_by_name(bigram, word_tokenizer):
    too_long = [Example(["q"], [" y" * (bigram.config.n_ctx + 1)], 0)]
    with pytest.raises(DataError, match=r"piqa: a choice of \d+ tokens does not fit .* --limit 0"):
        score_examples(bigram, word_tokenizer, too_long, what="piqa")


# (requests, batch_tokens, what the refusal says): inputs score_requests cannot score
BAD_REQUESTS = [
    ([], 4096, r"score_requests \(scoring\): requests is empty; expected \(context ids"),
    ([([], [1])], 4096, r"requests\[0\]: context of 0 tokens, continuation of 1; expected a"),
    ([([0], [])], 4096, r"requests\[0\]: context of 1 tokens, continuation of 0"),
    ([([0], [1]), ([0], [8])], 4096, r"requests\[1\]: token id 8; expected an int in \[0, 8\)"),
    ([([-1], [1])], 4096, r"requests\[0\]: token id -1; expected an int"),
    ([([True], [1])], 4096, r"requests\[0\]: token id True; expected an int"),
    ([([0.0], [1])], 4096, r"requests\[0\]: token id 0.0; expected an int"),
    ([([0], [1])], 0, r"score_requests: batch_tokens=0; expected an integer >= 1"),
    ([([0], [1])], True, r"score_requests: batch_tokens=True; expected an integer >= 1"),
]  # fmt: skip


@pytest.mark.parametrize("requests, batch_tokens, says", BAD_REQUESTS)
def test_requests_that_cannot_be_scored_are_refused_at_entry(bigram, requests, batch_tokens, says):
    with pytest.raises(ValueError, match=says) as err:
        score_requests(bigram, requests, batch_tokens)
    assert err.traceback[-1].name == "score_requests"


# (examples, what the refusal says): Examples score_examples cannot score
BAD_EXAMPLES = [
    ([], "examples is empty; expected Examples"),
    ([Example(["q", "q"], [" x", " y"], 2)], r"examples\[0\]: label 2 for 2 choice\(s\); expec"),
    ([Example(["q", "q"], [" x", " y"], 0), Example(["q", "q"], [" x", " y"], -1)],
     r"examples\[1\]: label -1 for 2"),
    ([Example(["q", "q"], [" x", " y"], True)], r"examples\[0\]: label True for 2"),
    ([Example(["q"], [" x", " y"], 0)], r"examples\[0\]: 1 contexts for 2 continuations"),
]  # fmt: skip


@pytest.mark.parametrize("examples, says", BAD_EXAMPLES)
def test_examples_that_cannot_be_scored_are_refused_at_entry(
    bigram, word_tokenizer, examples, says
):
    with pytest.raises(ValueError, match=r"score_examples \(piqa\): " + says) as err:
        score_examples(bigram, word_tokenizer, examples, what="piqa")
    assert err.traceback[-1].name == "score_examples"


def test_partial_scoring_scores_only_the_shared_suffix(bigram, word_tokenizer):
    # The whole sentence is likelier with "dog" (0.9 * 0.1 > 0.05 * 0.8), but the suffix " ran far"
    # is likelier after "cat": partial scoring must pick cat, for acc and acc_norm alike.
    examples = [
        Example(["the dog", "the cat"], [" ran far", " ran far"], 1),
        Example(["the cat", "the dog"], [" ran far", " ran far"], 0),
    ]
    assert score_examples(bigram, word_tokenizer, examples) == {"acc": 1.0, "acc_norm": 1.0, "n": 2}


def test_groups_give_macro_averages_and_cloze_gives_ppl(bigram, word_tokenizer):
    grouped = [
        Example(["q", "q"], [" x", " y"], 0, "a"),
        Example(["q", "q"], [" x", " y"], 1, "a"),
        Example(["q", "q"], [" x", " y"], 0, "b"),
    ]
    result = score_examples(bigram, word_tokenizer, grouped)
    assert result["acc"] == pytest.approx(2 / 3) and result["acc_macro"] == pytest.approx(0.75)
    cloze = score_examples(
        bigram, word_tokenizer, [Example(["q"], [" x"], 0), Example(["q"], [" y y"], 0)]
    )
    assert cloze["acc"] == 0.5 and cloze["ppl"] == pytest.approx(
        math.exp(-math.log(0.5 * 0.27) / 2), rel=1e-4
    )


def direct_scores(model, requests, max_len):
    """One request at a time, full logits, no hook, no padding: the definition."""
    out = []
    for context, continuation in requests:
        full = torch.tensor(context + continuation)
        inputs, targets = full[:-1][-max_len:], full[1:][-max_len:]
        logprobs = model(inputs[None])[0].log_softmax(-1)[-len(continuation) :]  # [n, V]
        picked = logprobs.gather(1, targets[-len(continuation) :, None])
        out.append(
            (
                picked.sum().item(),
                bool((logprobs.argmax(-1) == targets[-len(continuation) :]).all()),
            )
        )
    return out


def test_batched_scoring_equals_one_at_a_time():
    model = load(FIXTURES / "gpt2-tiny")
    gen = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    requests = [
        (draw(int(a)), draw(int(b))) for a, b in torch.randint(1, 40, (30, 2), generator=gen)
    ]
    requests += [
        (requests[0][0], draw(1)),
        (requests[0][0], draw(1)),
    ]  # equal inputs share one forward pass
    requests += [(draw(90), draw(5))]  # longer than the 64 positions: truncated from the left
    with torch.no_grad():
        want = direct_scores(model, requests, model.config.n_ctx)
    for batch_tokens in (1, 200, 10**6):
        got = score_requests(model, requests, batch_tokens=batch_tokens)
        assert [s for s, _ in got] == pytest.approx([s for s, _ in want], abs=1e-4)
        assert [g for _, g in got] == [g for _, g in want]


def test_perplexity_is_exp_mean_nll_of_the_scored_tokens():
    model = load(FIXTURES / "gpt2-tiny")
    ids = torch.randint(
        0, model.config.vocab_size, (103,), generator=torch.Generator().manual_seed(1)
    )
    ctx = 16
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - ctx + 1, ctx):
            window = ids[start : start + ctx]
            for p in range(1, ctx):  # each token on its own, from its in-window prefix
                nll -= model(window[None, :p])[0, -1].log_softmax(-1)[window[p]].item()
                count += 1
    ppl, total, scored = perplexity(model, ids, ctx, batch=3)
    assert scored == count and total == pytest.approx(nll, rel=1e-5)
    assert ppl == pytest.approx(math.exp(nll / count), rel=1e-5)


def test_perplexity_rejects_bad_windows():
    model = load(FIXTURES / "gpt2-tiny")
    with pytest.raises(ValueError, match="ctx=65"):
        perplexity(model, torch.zeros(200, dtype=torch.long), 65)
    with pytest.raises(ValueError, match="do not fill one window"):
        perplexity(model, torch.zeros(10, dtype=torch.long), 16)


def reference_of(folder, ids) -> dict:
    """The folder's reference numbers, once `ids` (the whole WikiText-2 test file encoded) are
    checked to be the tokens the reference scored."""
    reference = json.loads((folder / "reference.json").read_text())
    ctx = reference["protocol"]["ctx"]
    assert (len(ids) // ctx) * (ctx - 1) == reference["protocol"]["scored_tokens"]
    return reference


def test_standin_pythia_wikitext2_perplexity_matches_reference():
    """GPT-2's stand-in is checked against its reference through evaluate_model, below."""
    folder = shared_path("weights", "standin-pythia")
    ids = encode_file(data_path("wikitext-2-raw", "wiki.test.raw"), load_tokenizer(folder))
    reference = reference_of(folder, ids)
    ctx = reference["protocol"]["ctx"]
    ppl, _, scored = perplexity(load(folder), ids[: 64 * ctx], ctx)
    assert scored == 64 * (ctx - 1)
    assert ppl == pytest.approx(reference["wikitext2_test_ppl_first64_windows"], rel=1e-3)


def test_a_teacher_evaluation_gives_reference_perplexity_and_tasks():
    folder = shared_path("weights", "standin-gpt2")
    model, tokenizer, store = load(folder), load_tokenizer(folder), data_path()
    texts = {name: encode_file(store / path, tokenizer) for name, path in PPL_TEXTS.items()}
    reference = reference_of(folder, texts["wikitext2"])
    # the held-out text's reference is of every window, not of the first 64: one window of it
    texts["heldout"] = texts["heldout"][:256]
    result = evaluate_model(model, tokenizer, texts, 256, store, 64, 3, ("piqa", "lambada"))
    assert result["wikitext2_ppl"] == pytest.approx(
        reference["wikitext2_test_ppl_first64_windows"], rel=1e-3
    )
    assert result["wikitext2_tokens"] == 64 * 255 and result["heldout_tokens"] == 255
    assert {t: r["n"] for t, r in result["tasks"].items()} == {"piqa": 3, "lambada": 3}
