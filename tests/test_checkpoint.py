"""Reading checkpoints: the teacher's identity from its weights' content, the error each bad
config.json, tokenizer.json or model.safetensors gets (built on the fly from copies of the good
fixtures and stand-ins), and what a first run without internet is told to fetch."""

import json
import os
import re
import shutil
import struct

import pytest
import torch
from conftest import FIXTURES, shared_path
from safetensors.torch import load_file, save_file

from dofmini import CheckpointError, hub, load, load_tokenizer
from dofmini.students import load_student, make_student, save_student


def copy_fixture(tmp_path, name="gpt2-tiny", under="copy"):
    """A copy of a fixture folder, under the same folder name; copytree keeps the files' mtimes."""
    return shutil.copytree(FIXTURES / name, tmp_path / under / name)


@pytest.fixture
def gpt2_copy(tmp_path):
    return copy_fixture(tmp_path)


def rewrite_tensors(folder, edit):
    file = folder / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def halve(tensors):
    for name in tensors:
        tensors[name] = tensors[name] / 2


def edit_config(folder, edit):
    file = folder / "config.json"
    config = json.loads(file.read_text())
    edit(config)
    file.write_text(json.dumps(config))


# --- identity ----------------------------------------------------------------------------------


def test_identity_follows_the_weights_content(tmp_path):
    original = load(FIXTURES / "gpt2-tiny")
    same = copy_fixture(tmp_path, under="elsewhere")
    halved = copy_fixture(tmp_path, under="halved")
    rewrite_tensors(halved, halve)
    assert original.identity.startswith("gpt2-tiny:")
    assert load(same).identity == original.identity
    assert load(halved).identity != original.identity
    # the point of the identity: a student of one teacher is refused by the other
    student_file = tmp_path / "student.safetensors"
    save_student(make_student(original, "prf", [4, 4], 0), student_file)
    with pytest.raises(CheckpointError, match="holds a student of teacher 'gpt2-tiny:"):
        load_student(load(halved), student_file)


def overwrite_first_value(file, name, value):
    """Overwrite, in place, the first float32 of stored tensor `name`: same size, one weight
    changed."""
    with open(file, "r+b") as f:
        header_size = int.from_bytes(f.read(8), "little")
        start = json.loads(f.read(header_size))[name]["data_offsets"][0]
        f.seek(8 + header_size + start)
        f.write(struct.pack("<f", value))


def test_weights_edited_in_place_with_their_mtime_restored_change_the_identity(
    gpt2_copy, tmp_path, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    weights = gpt2_copy / "model.safetensors"
    before = weights.stat()
    first = load(gpt2_copy)
    overwrite_first_value(weights, "transformer.wte.weight", 0.5)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = weights.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    edited = load(gpt2_copy)
    assert edited.wte[0, 0] == 0.5 != first.wte[0, 0]
    assert edited.identity != first.identity
    # no hash is remembered anywhere: nothing is written to the user's cache
    assert not (tmp_path / "cache").exists()


def test_checkpoint_folder_is_never_written(gpt2_copy):
    before = sorted((p.name, p.stat().st_mtime_ns) for p in gpt2_copy.iterdir())
    assert load(gpt2_copy).identity == load(FIXTURES / "gpt2-tiny").identity
    assert sorted((p.name, p.stat().st_mtime_ns) for p in gpt2_copy.iterdir()) == before


# --- config.json -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, edit, message",
    [
        (
            "gpt2-tiny",
            lambda c: c.pop("n_embd"),
            r"config.json: missing 'n_embd'; expected a positive integer",
        ),
        (
            "gpt2-tiny",
            lambda c: c.update(n_layer="2"),
            r"config.json: 'n_layer' is '2'; expected a positive integer",
        ),
        (
            "gpt2-tiny",
            lambda c: c.update(n_head=True),
            r"config.json: 'n_head' is True; expected a positive integer",
        ),
        (
            "gpt2-tiny",
            lambda c: c.update(n_positions=0),
            r"config.json: 'n_positions' is 0; expected a positive integer",
        ),
        (
            "gpt2-tiny",
            lambda c: c.update(layer_norm_epsilon=-1e-5),
            r"config.json: 'layer_norm_epsilon' is -1e-05; expected a positive number",
        ),
        (
            "gpt2-tiny",
            lambda c: c.update(n_embd=30),
            r"config.json: 'n_embd' = 30 is not divisible by 'n_head' = 4",
        ),
        (
            "gpt2-tiny",
            lambda c: c.update(activation_function="relu"),
            r"config.json: 'activation_function' is 'relu'; expected one of gelu, gelu_new",
        ),
        (
            "neox-tiny",
            lambda c: c.update(num_attention_heads=3),
            r"config.json: 'hidden_size' = 32 is not divisible by 'num_attention_heads' = 3",
        ),
        (
            "neox-tiny",
            lambda c: c["rope_parameters"].update(partial_rotary_factor=0),
            r"config.json: 'rope_parameters.partial_rotary_factor' is 0; "
            r"expected a number in \(0, 1\]",
        ),
        (
            "neox-tiny",
            lambda c: c.update(rotary_pct=1.5),
            r"config.json: 'rotary_pct' is 1.5; expected a number in \(0, 1\]",
        ),
        (
            "neox-tiny",
            lambda c: c["rope_parameters"].update(partial_rotary_factor=0.375),
            r"config.json: rotary fraction 0.375 of 8 dims per head rotates 3; "
            r"expected an even number",
        ),
        (
            "neox-tiny",
            lambda c: c.update(rope_parameters="default"),
            r"config.json: 'rope_parameters' is 'default'; expected a JSON object",
        ),
        (
            "neox-tiny",
            lambda c: c.update(use_parallel_residual="yes"),
            r"config.json: 'use_parallel_residual' is 'yes'; expected true or false",
        ),
        (
            "neox-tiny",
            lambda c: c.update(model_type="llama"),
            r"config.json has model_type 'llama'; dofmini supports 'gpt2' and 'gpt_neox'",
        ),
    ],
)
def test_bad_config_field_is_named(tmp_path, name, edit, message):
    folder = copy_fixture(tmp_path, name)
    edit_config(folder, edit)
    with pytest.raises(CheckpointError, match=message):
        load(folder)


def test_config_that_is_not_an_object_is_named(gpt2_copy):
    (gpt2_copy / "config.json").write_text("[32, 4]")
    with pytest.raises(CheckpointError, match=r"config.json holds a JSON list; expected an object"):
        load(gpt2_copy)


def test_folder_without_config_and_unknown_name(tmp_path):
    with pytest.raises(CheckpointError, match="has no config.json"):
        load(tmp_path)
    with pytest.raises(
        CheckpointError, match="unknown model 'gpt5': not a folder, and not one of gpt2, pythia-70m"
    ):
        load("gpt5")


# --- tokenizer.json ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content", [b"{not json", b'{"version": "1.0"}', b"\xff\xfe"], ids=["syntax", "shape", "bytes"]
)
def test_invalid_tokenizer_is_named(gpt2_copy, content):
    (gpt2_copy / "tokenizer.json").write_bytes(content)
    with pytest.raises(CheckpointError, match=r"tokenizer.json is not a valid tokenizer.json"):
        load_tokenizer(gpt2_copy)


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


# --- model.safetensors -------------------------------------------------------------------------


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


@pytest.mark.parametrize(
    "name, stored, other",
    [
        ("gpt2-tiny", "transformer.h.0.ln_1.weight", "h.0.ln_1.weight"),
        ("neox-tiny", "embed_out.weight", "lm_head.weight"),
    ],
)
def test_two_names_for_one_tensor_are_refused_naming_both(tmp_path, name, stored, other):
    folder = copy_fixture(tmp_path, name)
    rewrite_tensors(folder, lambda t: t.update({other: t[stored].clone()}))
    message = r"holds both '.*' and '.*': two names for one tensor"
    with pytest.raises(CheckpointError, match=message) as refused:
        load(folder)
    assert set(re.findall(r"'([^']+)'", str(refused.value))) == {stored, other}


def put(name, index, value):
    """An edit that sets one element of tensor `name`."""

    def edit(tensors):
        tensors[name][index] = value

    return edit


@pytest.mark.parametrize(
    "edit, dtype, message",
    [
        (
            put("transformer.h.0.attn.c_attn.weight", (3, 5), float("nan")),
            torch.float32,
            r"tensor 'transformer.h.0.attn.c_attn.weight' in .*model.safetensors holds 1 NaN or "
            r"inf value\(s\), first at index \[3, 5\]; expected finite weights",
        ),
        (
            put("transformer.ln_f.bias", 7, -float("inf")),
            torch.float32,
            r"tensor 'transformer.ln_f.bias' .* holds 1 NaN or inf value\(s\), first at index "
            r"\[7\]",
        ),
        (
            put("transformer.wte.weight", (0, 0), 1e6),
            torch.float16,
            r"tensor 'transformer.wte.weight' .* has values up to 1e\+06, beyond torch.float16's "
            r"range",
        ),
    ],
    ids=["nan", "inf", "fp16-overflow"],
)
def test_non_finite_weight_is_named(gpt2_copy, edit, dtype, message):
    rewrite_tensors(gpt2_copy, edit)
    with pytest.raises(CheckpointError, match=message):
        load(gpt2_copy, dtype=dtype)


def test_checkpoint_without_transformer_prefix_loads(gpt2_copy):
    # transformers saves GPT2LMHeadModel with a "transformer." prefix (the fixtures); the hub's
    # gpt2 has none
    rewrite_tensors(
        gpt2_copy, lambda t: t.update({k.removeprefix("transformer."): t.pop(k) for k in list(t)})
    )
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(load(gpt2_copy)(ids), load(FIXTURES / "gpt2-tiny")(ids))


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


GPT2_URLS = [f"https://huggingface.co/openai-community/gpt2/resolve/main/{f}" for f in hub.FILES]


def test_missing_files_lists_direct_urls_and_destinations_without_network(tmp_path, monkeypatch):
    weights = tmp_path / "weights"
    monkeypatch.setattr(hub, "WEIGHTS_DIR", weights)
    # the default endpoint, as when HF_ENDPOINT is unset; no connection is made to it
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
    with pytest.raises(CheckpointError, match=r"hub is unreachable .* by hand") as refused:
        load("gpt2")
    # the same direct file URLs as missing_files, each with where it goes
    for f in hub.FILES:
        url = f"http://127.0.0.1:9/openai-community/gpt2/resolve/main/{f}"
        assert f"\n  {url}\n    -> {weights / 'gpt2' / f}" in str(refused.value)
    assert not any(weights.iterdir()), (
        "a failed download must leave nothing where a checkpoint is expected"
    )
