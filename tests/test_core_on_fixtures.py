"""The core claims on the checkpoints and task files in tests/fixtures, so they hold in a user's
fresh clone without ../shared: every task's framing, DoF and allocation on a real forward pass,
distillation that lowers the held-out error of the draw it starts from, and student files that are
reproducible byte for byte and reload exactly. The stand-in versions in the other test files stay
the stronger checks where ../shared exists."""

import functools
import json
import re

import pytest
import torch
from conftest import FIXTURES
from safetensors.torch import save

from dofmini import CheckpointError, load
from dofmini.distill import TrainSettings, distill
from dofmini.dof import allocate, estimate_dof
from dofmini.students import load_student, make_student, save_student, trainable
from dofmini.study.evaluate import layer_errors
from dofmini.study.store import train_into
from dofmini.study.tasks import TASKS, load_task
from dofmini.tensor_files import read_tensors, save_tensors

TASK_FILES = FIXTURES / "tasks"  # two or three hand-written examples in each task's own format
S, quiet = TrainSettings, lambda line: None


def test_every_task_frames_its_examples_as_the_harness_does():
    framed = {name: load_task(name, TASK_FILES) for name in TASKS}
    piqa = framed["piqa"]
    assert piqa[0].contexts == ["Question: How do I keep bread fresh?\nAnswer:"] * 2
    assert piqa[0].continuations == [" Store it in a sealed bag.", " Store it in a bowl of water."]
    assert [e.label for e in piqa] == [0, 1]
    arc = framed["arc_easy"][0]
    assert arc.contexts == ["Question: Which gas do plants take in?\nAnswer:"] * 3
    assert arc.continuations == [" oxygen", " carbon dioxide", " helium"] and arc.label == 1
    assert framed["arc_challenge"][0].label == 0  # numeric answer keys work too
    wino = framed["winogrande"][
        0
    ]  # partial scoring: the option fills the blank, the suffix is scored
    assert wino.contexts == [
        "The cup did not fit in the box because the cup",
        "The cup did not fit in the box because the box",
    ]
    assert wino.continuations == [" was too big."] * 2 and wino.label == 0
    trophy, thanks = framed["wsc273"]
    assert trophy.contexts == [
        "The trophy would not fit in the suitcase because the trophy",
        "The trophy would not fit in the suitcase because the suitcase",
    ]
    assert trophy.continuations == [" was too big."] * 2 and trophy.label == 0
    assert thanks.contexts[1] == "Anna thanked Beth because Beth's" and thanks.label == 1
    mmlu = framed["mmlu"]
    assert [e.group for e in mmlu] == ["abstract_algebra"] * 2 + ["astronomy"]
    assert mmlu[0].contexts[0] == (
        "The following are multiple choice questions (with answers) about"
        " abstract algebra.\n\nWhat is 2 + 2?\nA. 3\nB. 4\nC. 5\nD. 6\n"
        "Answer:"
    )
    assert mmlu[0].continuations == [" A", " B", " C", " D"] and mmlu[2].label == 2
    logiqa = framed["logiqa"][0]
    assert logiqa.contexts[0] == (
        "Passage: All cats are animals. Tom is a cat.\nQuestion: Which "
        "follows?\nChoices:\nA. Tom is a dog.\nB. Tom is a plant.\nC. Tom "
        "is an animal.\nD. Tom is a fish.\nAnswer:"
    )
    assert logiqa.continuations[2] == " Tom is an animal." and logiqa.label == 2
    lambada = framed["lambada"][0]
    assert lambada.continuations == [" Rex"] and lambada.label == 0
    assert len(load_task("mmlu", TASK_FILES, limit=2)) == 2


@pytest.mark.parametrize("name", ["gpt2-tiny", "neox-tiny"])
def test_dof_on_a_model_is_seeded_bounded_and_allocates_the_budget(name):
    model = load(FIXTURES / name)
    ids = torch.randint(
        0, model.config.vocab_size, (512,), generator=torch.Generator().manual_seed(0)
    )
    dof = estimate_dof(model, ids, 2**-4, J=64, seed=3, ctx=32)  # [L, H]
    assert dof.shape == (model.config.n_layer, model.config.n_head)
    assert ((dof > 0) & (dof < 64)).all()
    assert torch.equal(dof, estimate_dof(model, ids, 2**-4, J=64, seed=3, ctx=32))
    assert not torch.equal(dof, estimate_dof(model, ids, 2**-4, J=64, seed=4, ctx=32))
    for rule in ("proportional", "power:0.5"):
        dims = allocate(dof, 8, rule)  # max over heads
        assert sum(dims) == 8 * model.config.n_layer and min(dims) >= 1


@pytest.mark.parametrize("loss", ["l2", "softmax"])
def test_distillation_lowers_the_heldout_error_of_its_starting_draw(loss):
    teacher = load(FIXTURES / "gpt2-tiny")
    gen = torch.Generator().manual_seed(0)
    train = torch.randint(0, teacher.config.vocab_size, (4096,), generator=gen)
    held = torch.randint(0, teacher.config.vocab_size, (1024,), generator=gen)
    dims = [8] * teacher.config.n_layer
    before = layer_errors(teacher, make_student(teacher, "prf", dims, 0), held, 32, windows=8)
    settings = TrainSettings(steps=40, batch=4, ctx=32)
    student, _ = distill(teacher, dims, train, settings, loss=loss, log=lambda _: None)
    after = layer_errors(teacher, student, held, 32, windows=8)
    metric = "kernel_l2" if loss == "l2" else "kl"
    assert all(a < b for a, b in zip(after[metric], before[metric])), (before, after)
    assert all(a < b for a, b in zip(after["output_rel"], before["output_rel"]))


def test_ten_repeats_of_one_seed_give_bit_identical_students_and_files(tiny, tiny_ids, tmp_path):
    files, settings = [], S(steps=3, batch=2, ctx=32, data_seed=4)
    for i in range(10):
        path = tmp_path / f"s{i}.safetensors"
        train = functools.partial(distill, tiny, [6, 6], tiny_ids, settings, feature_seed=4)
        train_into(path, {"loss": "softmax"}, settings, tiny_ids, train, quiet)
        # the same tensors and record byte for byte, but for the seconds it took
        stored, meta = read_tensors(path)
        del meta["info"]["train_seconds"]
        files.append((save(stored), json.dumps(meta, sort_keys=True)))
    assert len(set(files)) == 1  # tensors and metadata, byte for byte
    other = trainable(distill(tiny, [6, 6], tiny_ids, settings, feature_seed=5, log=quiet)[0])
    first = trainable(load_student(tiny, tmp_path / "s0.safetensors")[0])
    assert not torch.equal(first["blocks.0.attn.features.z"], other["blocks.0.attn.features.z"])


def test_saved_student_reloads_with_bit_identical_logits(tiny, tiny_ids, tmp_path):
    path = tmp_path / "student.safetensors"
    settings = S(steps=3, batch=2, ctx=32)
    train = functools.partial(distill, tiny, [6, 10], tiny_ids, settings, loss="l2", feature_seed=3)
    train_into(path, {"lam": 0.0625, "loss": "l2"}, settings, tiny_ids, train, quiet)
    student = distill(tiny, [6, 10], tiny_ids, settings, loss="l2", feature_seed=3, log=quiet)[0]
    expect = {"dims": (6, 10), "feature_seed": 3, "loss": "l2"}
    loaded, meta = load_student(tiny, path, expect)
    assert set(loaded.state_dict()) == set(student.state_dict())
    record = [meta[k] for k in ("dims", "lam", "loss", "feature_seed", "kind")]
    assert record == [[6, 10], 0.0625, "l2", 3, "prf"]
    assert set(meta["info"]) == {"loss_curve", "train_seconds"}
    ids = tiny_ids[:64].view(2, 32)
    with torch.no_grad():
        assert torch.equal(loaded(ids), student(ids))
    # only z and a: (6 + 10) features of 4 heads x (8 + 1) floats + header
    assert path.stat().st_size < 4096
    for field, value, stored in [("dims", [6, 9], "[6, 10]"), ("loss", "softmax", "'l2'")]:
        with pytest.raises(CheckpointError, match=rf"{field} is {re.escape(stored)}.*{value!r}"):
            load_student(tiny, path, expect={"feature_seed": 3, field: value})


def test_load_refuses_a_file_of_another_teacher(tiny, tmp_path):
    path = tmp_path / "student.safetensors"
    save_student(make_student(tiny, "prf", [4, 4], 0), path)
    other = load(FIXTURES / "neox-tiny")
    with pytest.raises(CheckpointError) as err:
        load_student(other, path)
    assert all(part in str(err.value) for part in (str(path), tiny.identity, other.identity))
    save_tensors({}, path, {"teacher": tiny.identity, "kind": "prf2", "dims": [4, 4]})
    with pytest.raises(CheckpointError, match="kind is 'prf2'; expected one of"):
        load_student(tiny, path)
