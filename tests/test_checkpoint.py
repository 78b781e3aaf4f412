"""Reading checkpoints: the teacher's identity from its weights' content (and the cache of weight
hashes), and the error each bad config.json, tokenizer.json or model.safetensors gets, built on the
fly from copies of the good fixtures."""

import json
import os
import shutil
import time

import pytest
import torch
from conftest import FIXTURES
from safetensors.torch import load_file, save_file

from dofmini import CheckpointError, checkpoint, load, load_tokenizer
from dofmini.files import sha256_file
from dofmini.students import load_student, make_student, save_student


@pytest.fixture(autouse=True)
def user_cache(tmp_path, monkeypatch):
    """A cache folder of this test's own, so the hashes of its temporary checkpoints neither land
    in the user's cache nor come from it."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder))
    monkeypatch.setattr(checkpoint, "_weights_sha256", {})
    return folder / "dofmini" / "sha256.json"


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


def test_weights_hash_is_remembered_per_path_size_and_mtime(gpt2_copy, user_cache, monkeypatch):
    weights = gpt2_copy / "model.safetensors"
    identity = checkpoint.fingerprint(gpt2_copy)
    stored = json.loads(user_cache.read_text())
    assert stored[str(weights.resolve())]["sha256"] == sha256_file(weights)
    # a new process (an empty in-process memo) takes the hash from the cache file, unread
    stored[str(weights.resolve())]["sha256"] = "0" * 64
    user_cache.write_text(json.dumps(stored))
    monkeypatch.setattr(checkpoint, "_weights_sha256", {})
    assert checkpoint.fingerprint(gpt2_copy) != identity
    # another mtime is another version of the file: hashed again
    mtime_ns = weights.stat().st_mtime_ns
    os.utime(weights, ns=(mtime_ns + 1, mtime_ns + 1))
    assert checkpoint.fingerprint(gpt2_copy) == identity


def test_weights_rewritten_within_one_timestamp_are_hashed_again(gpt2_copy, user_cache):
    weights = gpt2_copy / "model.safetensors"
    now = time.time_ns()
    os.utime(weights, ns=(now, now))
    first = checkpoint.fingerprint(gpt2_copy)
    rewrite_tensors(gpt2_copy, halve)  # same size
    os.utime(weights, ns=(now, now))  # and, as within one coarse timestamp tick, the same mtime
    assert checkpoint.fingerprint(gpt2_copy) != first
    assert not user_cache.exists()


def test_checkpoint_folder_is_never_written_and_an_unusable_cache_is_no_error(
    gpt2_copy, tmp_path, monkeypatch
):
    not_a_folder = tmp_path / "cache-is-a-file"
    not_a_folder.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_folder))
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


def test_offline_download_says_what_to_fetch_and_where(tmp_path, monkeypatch):
    pytest.importorskip(
        "huggingface_hub", reason="tokenizers brings huggingface_hub; it is the download path"
    )
    from huggingface_hub import constants

    # Port 9 on loopback has no listener: the state of a machine without internet, on any machine.
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    weights = tmp_path / "weights"
    weights.mkdir()
    monkeypatch.setattr(checkpoint, "WEIGHTS_DIR", weights)
    with pytest.raises(
        CheckpointError,
        match=r"hub is unreachable .* Download config.json, model.safetensors, "
        r"tokenizer.json from http://127.0.0.1:9/openai-community/gpt2",
    ):
        load("gpt2")
    assert not any(weights.iterdir()), (
        "a failed download must leave nothing where a checkpoint is expected"
    )
