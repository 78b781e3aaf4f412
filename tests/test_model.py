"""The reimplemented GPT-2 and GPT-NeoX against logits computed by Hugging Face transformers (the
fixtures in tests/fixtures, made by tests/make_fixtures.py) and the stand-in teachers; the cached
forward pass and `keep=`; the checkpoint's tokenizer, refused when it does not fit the model; what
a first run without internet is told to fetch. The loader's checks of config.json and
model.safetensors, and the teacher's identity, are in test_checkpoint.py."""

import functools
import json
import shutil

import pytest
import torch
from conftest import FIXTURES, shared_path
from hypothesis import given, settings
from hypothesis import strategies as st

from dofmini import CheckpointError, hub, load, load_tokenizer

FIXTURE_NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "reference.json").is_file())
# Low-precision bounds, on logits of magnitude ~10: fp16 keeps 11 mantissa bits and bf16 8, and
# both families accumulate rounding over two layers, so these sit a little above the largest
# difference seen.
LOW_PRECISION_BOUND = {torch.float16: 0.05, torch.bfloat16: 0.25}


def reference(name):
    return json.loads((FIXTURES / name / "reference.json").read_text())


def greedy(model, prompt, n):
    """Uncached greedy decoding: the full forward pass on the growing sequence, argmax of the last
    position."""
    ids = torch.tensor([prompt])
    for _ in range(n):
        ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)  # [1, T + 1]
    return ids[0].tolist()


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fp32_logits_match_transformers(name):
    ref = reference(name)
    model = load(FIXTURES / name)
    with torch.no_grad():
        logits = model(torch.tensor(ref["ids"]))  # [2, 12, V]
    assert (logits - torch.tensor(ref["logits_fp32"])).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_greedy_decoding_matches_transformers(name):
    ref = reference(name)
    with torch.no_grad():
        assert greedy(load(FIXTURES / name), ref["greedy_prompt"], 20) == ref["greedy_ids"]


@pytest.mark.parametrize("name", [n for n in FIXTURE_NAMES if reference(n)["dtype"] != "float32"])
def test_low_precision_checkpoint_computes_in_its_dtype(name):
    ref = reference(name)
    dtype = getattr(torch, ref["dtype"])
    model = load(FIXTURES / name, dtype=dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    with torch.no_grad():
        logits = model(torch.tensor(ref["ids"]))  # [2, 12, V]
    assert logits.dtype == dtype
    assert (
        logits.float() - torch.tensor(ref["logits_stored_dtype"])
    ).abs().max().item() < LOW_PRECISION_BOUND[dtype]


def test_bf16_compute_of_fp32_checkpoint_stays_close():
    ref = reference("gpt2-tiny")
    with torch.no_grad():
        logits = load(FIXTURES / "gpt2-tiny", dtype=torch.bfloat16)(
            torch.tensor(ref["ids"])
        )  # [2, 12, V]
    assert (
        logits.float() - torch.tensor(ref["logits_fp32"])
    ).abs().max().item() < LOW_PRECISION_BOUND[torch.bfloat16]


@pytest.mark.parametrize("folder", ["standin-gpt2", "standin-pythia"])
def test_standin_probe_top5_matches_reference(folder):
    path = shared_path("weights", folder)
    probe = json.loads((path / "reference.json").read_text())["probe"]
    tokenizer = load_tokenizer(path)
    assert tokenizer.encode(probe["text"]).ids == probe["ids"]
    with torch.no_grad():
        last = load(path)(torch.tensor([probe["ids"]]))[0, -1]  # [V]
    values, ids = last.topk(5)
    assert ids.tolist() == probe["last_logits_top5"]["ids"]
    assert torch.allclose(values, torch.tensor(probe["last_logits_top5"]["values"]), atol=1e-4)


def test_teacher_is_frozen_and_attention_is_swappable():
    model = load(FIXTURES / "neox-tiny")
    assert not any(p.requires_grad for p in model.parameters())
    capture = []
    ids = torch.tensor(reference("neox-tiny")["ids"])
    model(ids, capture=capture)
    assert len(capture) == model.config.n_layer
    q, k, v = capture[0]
    assert q.shape == k.shape == v.shape == (2, model.config.n_head, 12, model.config.head_dim)


def test_cached_forward_equals_full_forward():
    model = load(FIXTURES / "neox-tiny")
    ids = torch.tensor(reference("neox-tiny")["ids"])  # [2, 12]
    caches = [block.attn.new_cache(2, 12) for block in model.blocks]
    with torch.no_grad():
        full = model(ids)  # [2, 12, V]
        parts = [model(ids[:, :7], 0, caches)] + [
            model(ids[:, t : t + 1], t, caches) for t in range(7, 12)
        ]
    assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-5)


@functools.cache
def fixture_model(name):
    return load(FIXTURES / name)


@pytest.mark.parametrize("name", ["gpt2-tiny", "neox-tiny"])
@settings(max_examples=20, deadline=None)
@given(bits=st.integers(0, 2**24 - 1))
def test_keep_gives_the_kept_rows_of_the_full_forward(name, bits):
    model = fixture_model(name)
    ids = torch.tensor(reference(name)["ids"])  # [2, 12]
    keep = torch.tensor([bool(bits >> i & 1) for i in range(24)]).view(2, 12)  # [2, 12]
    with torch.no_grad():
        full = model(ids)  # [2, 12, V]
        kept = model(ids, keep=keep)  # [N, V]
    assert kept.shape == (int(keep.sum()), model.config.vocab_size)
    torch.testing.assert_close(kept, full[keep])


def test_keep_nothing_gives_no_logits_and_still_captures_every_layer():
    model = fixture_model("neox-tiny")
    ids = torch.tensor(reference("neox-tiny")["ids"])  # [2, 12]
    capture = []
    with torch.no_grad():
        logits = model(ids, capture=capture, keep=torch.zeros(2, 12, dtype=torch.bool))
    assert logits.shape == (0, model.config.vocab_size)
    assert len(capture) == model.config.n_layer


@pytest.mark.parametrize(
    "keep", [torch.ones(2, 12), torch.ones(2, 11, dtype=torch.bool)], ids=["float", "shape"]
)
def test_keep_that_is_not_a_mask_like_ids_is_refused(keep):
    model = fixture_model("gpt2-tiny")
    ids = torch.tensor(reference("gpt2-tiny")["ids"])  # [2, 12]
    with pytest.raises(ValueError, match=r"keep is torch\.\w+ \[2, 1\d\]; expected a torch.bool"):
        model(ids, keep=keep)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32])
def test_ids_of_any_integer_dtype_give_the_long_ids_logits(dtype):
    """uint8 ids index like int64 ones (torch takes uint8 and bool indices as masks)."""
    model = fixture_model("gpt2-tiny")
    ids = torch.tensor(reference("gpt2-tiny")["ids"])  # [2, 12]
    assert torch.equal(model(ids.to(dtype)), model(ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_ids_that_are_not_integers_are_refused(dtype):
    model = fixture_model("gpt2-tiny")
    ids = torch.ones(2, 12, dtype=dtype)
    with pytest.raises(ValueError, match=r"ids is torch\.\w+ \[2, 12\]; expected integer token"):
        model(ids)


# --- tokenizer.json ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content", [b"{not json", b'{"version": "1.0"}', b"\xff\xfe"], ids=["syntax", "shape", "bytes"]
)
def test_invalid_tokenizer_is_named(tmp_path, content):
    folder = shutil.copytree(FIXTURES / "gpt2-tiny", tmp_path / "gpt2-tiny")
    (folder / "tokenizer.json").write_bytes(content)
    with pytest.raises(CheckpointError, match=r"tokenizer.json is not a valid tokenizer.json"):
        load_tokenizer(folder)


def checkpoint_with_tokenizer(tmp_path, standin, tokenizer_folder):
    """A copy of a stand-in's config.json with the tokenizer.json of `tokenizer_folder` (paths under
    ../shared/weights); the weights are not needed to load a tokenizer."""
    folder = tmp_path / standin
    folder.mkdir()
    shutil.copy(shared_path("weights", standin, "config.json"), folder)
    shutil.copy(shared_path("weights", *tokenizer_folder.split("/"), "tokenizer.json"), folder)
    return folder


@pytest.mark.parametrize(
    "standin, tokenizer, message",
    [
        # NeoX's ids run to 50276; GPT-2's embedding has 50257 rows
        *[
            (
                "standin-gpt2",
                t,
                r"tokenizer.json has token ids up to 50276, but .*standin-gpt2/"
                r"config.json has vocab_size 50257",
            )
            for t in ("standin-pythia", "tokenizers/gpt-neox-20b")
        ],
        # ids fit Pythia's 50304 rows, but GPT-2's <|endoftext|> is 50256, Pythia's 0
        *[
            (
                "standin-pythia",
                t,
                r"standin-pythia/config.json has bos_token_id 0, but the special "
                r"tokens of .*tokenizer.json are <\|endoftext\|> = 50256",
            )
            for t in ("standin-gpt2", "tokenizers/gpt2")
        ],
    ],
)
def test_tokenizer_of_another_family_is_refused(tmp_path, standin, tokenizer, message):
    folder = checkpoint_with_tokenizer(tmp_path, standin, tokenizer)
    with pytest.raises(CheckpointError, match=message):
        load_tokenizer(folder)


@pytest.mark.parametrize(
    "standin, tokenizer",
    [
        ("standin-gpt2", "tokenizers/gpt2"),
        ("standin-pythia", "tokenizers/gpt-neox-20b"),
        ("standin-gpt2", "standin-gpt2"),
        ("standin-pythia", "standin-pythia"),
    ],
)
def test_tokenizer_of_the_same_family_loads(tmp_path, standin, tokenizer):
    folder = checkpoint_with_tokenizer(tmp_path, standin, tokenizer)
    eos = json.loads((folder / "config.json").read_text())["eos_token_id"]
    assert load_tokenizer(folder).id_to_token(eos) == "<|endoftext|>"


# --- named checkpoints without internet -----------------------------------------------------------


GPT2_URLS = [f"https://huggingface.co/openai-community/gpt2/resolve/main/{f}" for f in hub.FILES]


def test_missing_files_lists_direct_urls_and_destinations_without_network(tmp_path, monkeypatch):
    weights = tmp_path / "weights"
    monkeypatch.setattr(hub, "WEIGHTS_DIR", weights)
    # huggingface_hub's default endpoint, as when HF_ENDPOINT is unset
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "https://huggingface.co")
    destinations = [weights / "gpt2" / f for f in hub.FILES]
    assert hub.missing_files("gpt2") == list(zip(GPT2_URLS, destinations))
    (weights / "gpt2").mkdir(parents=True)
    (weights / "gpt2" / "config.json").write_text("{}")
    assert hub.missing_files("gpt2") == list(zip(GPT2_URLS[1:], destinations[1:]))
    assert hub.missing_files(FIXTURES / "gpt2-tiny") == []


def test_offline_download_says_what_to_fetch_and_where(tmp_path, monkeypatch):
    pytest.importorskip(
        "huggingface_hub", reason="tokenizers brings huggingface_hub; it is the download path"
    )
    from huggingface_hub import constants

    # Port 9 on loopback has no listener: the state of a machine without internet, on any machine.
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    weights = tmp_path / "weights"
    weights.mkdir()
    monkeypatch.setattr(hub, "WEIGHTS_DIR", weights)
    refused_text = r"could not be downloaded from 127\.0\.0\.1:9 .* by hand.* DOFMINI_WEIGHTS"
    with pytest.raises(CheckpointError, match=refused_text) as refused:
        load("gpt2")
    # the same direct file URLs as missing_files, each with where it goes
    for f in hub.FILES:
        url = f"http://127.0.0.1:9/openai-community/gpt2/resolve/main/{f}"
        assert f"\n  {url}\n    -> {weights / 'gpt2' / f}" in str(refused.value)
    assert not any(weights.iterdir()), (
        "a failed download must leave nothing where a checkpoint is expected"
    )
