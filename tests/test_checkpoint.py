"""Reading checkpoints: the teacher's identity from its weights' content, and the error each bad
config.json or model.safetensors gets, built on the fly from copies of the good fixtures. The
tokenizer's checks and what a first run without internet is told are in test_model.py."""

import json
import os
import re
import shutil
import struct

import pytest
import torch
from conftest import FIXTURES
from safetensors.torch import load_file, save_file

from dofmini import CheckpointError, load
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
    with pytest.raises(CheckpointError, match="teacher is 'gpt2-tiny:"):
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


# (fixture, config.json edit {key: value}: None removes the key, "a.b" is key b of the object at a,
# the error's text after "config.json")
BAD_CONFIGS = [
    ("gpt2-tiny", {"n_embd": None}, r": missing 'n_embd'; expected a positive integer"),
    ("gpt2-tiny", {"n_layer": "2"}, r": 'n_layer' is '2'; expected a positive integer"),
    ("gpt2-tiny", {"n_head": True}, r": 'n_head' is True; expected a positive integer"),
    ("gpt2-tiny", {"n_positions": 0}, r": 'n_positions' is 0; expected a positive integer"),
    (
        "gpt2-tiny",
        {"layer_norm_epsilon": -1e-5},
        r": 'layer_norm_epsilon' is -1e-05; expected a positive number",
    ),
    ("gpt2-tiny", {"n_embd": 30}, r": 'n_embd' = 30 is not divisible by 'n_head' = 4"),
    (
        "gpt2-tiny",
        {"activation_function": "relu"},
        r": 'activation_function' is 'relu'; expected one of gelu, gelu_new",
    ),
    (
        "neox-tiny",
        {"num_attention_heads": 3},
        r": 'hidden_size' = 32 is not divisible by 'num_attention_heads' = 3",
    ),
    (
        "neox-tiny",
        {"rope_parameters.partial_rotary_factor": 0},
        r": 'rope_parameters.partial_rotary_factor' is 0; expected a number in \(0, 1\]",
    ),
    ("neox-tiny", {"rotary_pct": 1.5}, r": 'rotary_pct' is 1.5; expected a number in \(0, 1\]"),
    (
        "neox-tiny",
        {"rope_parameters.partial_rotary_factor": 0.375},
        r": rotary fraction 0.375 of 8 dims per head rotates 3; expected an even number",
    ),
    (
        "neox-tiny",
        {"rope_parameters": "default"},
        r": 'rope_parameters' is 'default'; expected a JSON object",
    ),
    (
        "neox-tiny",
        {"use_parallel_residual": "yes"},
        r": 'use_parallel_residual' is 'yes'; expected true or false",
    ),
    (
        "neox-tiny",
        {"model_type": "llama"},
        r": 'model_type' is 'llama'; expected 'gpt2' or 'gpt_neox'",
    ),
    # settings that change the model and are not implemented: refused by name, never ignored
    (
        "gpt2-tiny",
        {"scale_attn_by_inverse_layer_idx": True},
        r": 'scale_attn_by_inverse_layer_idx' is True; expected false, the only setting",
    ),
    ("gpt2-tiny", {"scale_attn_weights": False}, r": 'scale_attn_weights' is False; expected true"),
    (
        "neox-tiny",
        {"rope_scaling": {"type": "linear", "factor": 4.0}},
        r": 'rope_scaling' is \{'type': 'linear', 'factor': 4.0\}; expected null, the only",
    ),
    (
        "neox-tiny",
        {"rope_parameters.rope_type": "linear"},
        r": 'rope_parameters.rope_type' is 'linear'; expected \"default\"",
    ),
    ("neox-tiny", {"attention_bias": False}, r": 'attention_bias' is False; expected true"),
    (
        "neox-tiny",
        {"rotary_pct": 1.0},
        r": 'rotary_pct' is 1.0 but 'rope_parameters.partial_rotary_factor' is 0.25; expected one",
    ),
    ("gpt2-tiny", {"tie_word_embeddings": "no"}, r": 'tie_word_embeddings' is 'no'; expected true"),
]


@pytest.mark.parametrize("name, edit, message", BAD_CONFIGS)
def test_bad_config_field_is_named(tmp_path, name, edit, message):
    folder = copy_fixture(tmp_path, name)
    config = json.loads((folder / "config.json").read_text())
    for key, value in edit.items():
        parent, _, leaf = key.rpartition(".")
        fields = config[parent] if parent else config
        if value is None:
            fields.pop(leaf)
        else:
            fields[leaf] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="config.json" + message):
        load(folder)


def test_agreeing_spellings_of_one_setting_load():
    folder = FIXTURES / "neox-tiny"
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert load(folder).config.rotary_dim == 2  # 0.25 of 8 dims per head


def test_an_untied_gpt2_head_is_its_own_lm_head(gpt2_copy):
    """tie_word_embeddings false: logits are the final hidden state times the stored lm_head,
    computed here directly from the tied model's final norm (it was wte before)."""
    ids = torch.tensor([[1, 5, 9, 33, 70, 2]])
    tied = load(gpt2_copy)
    final = []
    tied.ln_f.register_forward_hook(lambda module, args, out: final.append(out))
    tied_logits = tied(ids)  # [1, T, V]
    own_head = torch.randn(96, 32, generator=torch.Generator().manual_seed(0))  # [V, D]
    rewrite_tensors(gpt2_copy, lambda t: t.update({"lm_head.weight": own_head}))
    assert torch.equal(load(gpt2_copy)(ids), tied_logits)  # tied: a stored lm_head is not used
    config = json.loads((gpt2_copy / "config.json").read_text())
    (gpt2_copy / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    untied = load(gpt2_copy)
    assert untied.head is not untied.wte
    torch.testing.assert_close(untied(ids), final[0] @ own_head.T, rtol=0, atol=1e-5)
    assert (untied(ids) - tied_logits).abs().max() > 1
    rewrite_tensors(gpt2_copy, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'lm_head.weight' .*\[96, 32\]"):
        load(gpt2_copy)


@pytest.mark.parametrize("n_layer", [3, 1, 1_000_000])
def test_a_layer_count_unlike_the_weights_is_refused_before_building(gpt2_copy, n_layer):
    config = json.loads((gpt2_copy / "config.json").read_text())
    (gpt2_copy / "config.json").write_text(json.dumps({**config, "n_layer": n_layer}))
    message = rf"model.safetensors holds 2 layers; config.json's 'n_layer' says {n_layer}$"
    with pytest.raises(CheckpointError, match=message):
        load(gpt2_copy)


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
            r"range; expected them to fit, or load in float32",
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


def test_a_dtype_that_is_not_a_torch_dtype_is_named():
    """load(dtype="float32") answered "Invalid device string" (Module.to took it for a device)."""
    with pytest.raises(ValueError, match=r"load: dtype='float32'; expected a floating torch.dtype"):
        load(FIXTURES / "gpt2-tiny", dtype="float32")
    with pytest.raises(ValueError, match=r"load: dtype=torch.int64; expected a floating"):
        load(FIXTURES / "gpt2-tiny", dtype=torch.int64)
