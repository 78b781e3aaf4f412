"""The reimplemented GPT-2 and GPT-NeoX against logits computed by Hugging Face transformers (the fixtures in
tests/fixtures, made by tests/make_fixtures.py), the stand-in teachers, and the loader's error messages."""

import json
import shutil

import pytest
import torch
from conftest import FIXTURES, shared_path
from safetensors.torch import load_file, save_file

from dofmini import CheckpointError, checkpoint, load, load_tokenizer

FIXTURE_NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "reference.json").is_file())
# Low-precision bounds, on logits of magnitude ~10: fp16 keeps 11 mantissa bits and bf16 8, and both families
# accumulate rounding over two layers, so these sit a little above the largest difference seen.
LOW_PRECISION_BOUND = {torch.float16: 0.05, torch.bfloat16: 0.25}


def reference(name):
    return json.loads((FIXTURES / name / "reference.json").read_text())


def greedy(model, prompt, n):
    """Uncached greedy decoding: the full forward pass on the growing sequence, argmax of the last position."""
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


# --- errors: each bad checkpoint, built on the fly from a good fixture, names what is wrong -----------------


@pytest.fixture
def gpt2_copy(tmp_path):
    folder = tmp_path / "gpt2-copy"
    shutil.copytree(FIXTURES / "gpt2-tiny", folder)
    return folder


def rewrite_tensors(folder, edit):
    file = folder / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda t: t.pop("transformer.h.1.mlp.c_fc.weight"),
            r"missing tensor 'h.1.mlp.c_fc.weight' .* \(expected shape \[32, 128\]",
        ),
        (
            lambda t: t.update({"h.0.attn.extra": torch.zeros(3)}),
            r"unexpected tensor 'h.0.attn.extra'",
        ),
        (
            lambda t: t.update({"transformer.wpe.weight": torch.zeros(63, 32)}),
            r"'transformer.wpe.weight' .* shape \[63, 32\], expected \[64, 32\]",
        ),
        (
            lambda t: t.update({"transformer.ln_f.bias": torch.zeros(32, dtype=torch.int64)}),
            r"'transformer.ln_f.bias' .* dtype",
        ),
    ],
)
def test_bad_tensor_is_named(gpt2_copy, edit, message):
    rewrite_tensors(gpt2_copy, edit)
    with pytest.raises(CheckpointError, match=message):
        load(gpt2_copy)


def test_checkpoint_without_transformer_prefix_loads(gpt2_copy):
    # transformers saves GPT2LMHeadModel with a "transformer." prefix (the fixtures); the hub's gpt2 has none.
    rewrite_tensors(
        gpt2_copy, lambda t: t.update({k.removeprefix("transformer."): t.pop(k) for k in list(t)})
    )
    ref = reference("gpt2-tiny")
    with torch.no_grad():
        logits = load(gpt2_copy)(torch.tensor(ref["ids"]))
    assert (logits - torch.tensor(ref["logits_fp32"])).abs().max().item() < 1e-5


@pytest.mark.parametrize("damage", ["truncate", "garble"])
def test_corrupt_file_is_named(gpt2_copy, damage):
    file = gpt2_copy / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(
        data[: len(data) // 2]
        if damage == "truncate"
        else b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage" + data[17:]
    )
    with pytest.raises(CheckpointError, match="model.safetensors is truncated or corrupt"):
        load(gpt2_copy)


def test_unsupported_model_type_is_named(gpt2_copy):
    config = json.loads((gpt2_copy / "config.json").read_text())
    (gpt2_copy / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(
        CheckpointError, match="model_type 'llama'; dofmini supports 'gpt2' and 'gpt_neox'"
    ):
        load(gpt2_copy)


def test_folder_without_config_and_unknown_name(tmp_path):
    with pytest.raises(CheckpointError, match="has no config.json"):
        load(tmp_path)
    with pytest.raises(
        CheckpointError, match="unknown model 'gpt5': not a folder, and not one of gpt2, pythia-70m"
    ):
        load("gpt5")


def test_offline_download_says_what_to_fetch_and_where(tmp_path, monkeypatch):
    pytest.importorskip(
        "huggingface_hub", reason="tokenizers brings huggingface_hub; it is the download path"
    )
    from huggingface_hub import constants

    # Port 9 on loopback has no listener: the same state as a machine without internet, on any machine.
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(checkpoint, "WEIGHTS_DIR", tmp_path)
    with pytest.raises(
        CheckpointError,
        match=r"hub is unreachable .* Download config.json, model.safetensors, "
        r"tokenizer.json from http://127.0.0.1:9/openai-community/gpt2",
    ):
        load("gpt2")
    assert not any(tmp_path.iterdir()), (
        "a failed download must leave nothing where a checkpoint is expected"
    )
