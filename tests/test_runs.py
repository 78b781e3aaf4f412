"""A saved stage is reused only for the settings that made it: a changed setting recomputes it and
says which; token caches follow the same rule."""

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from dofmini.distill import distill
from dofmini.students import read_tensors
from dofmini.study import stages
from dofmini.study.plan import Clock
from dofmini.study.runs import stage, token_ids


def test_stage_reuses_only_an_identical_key(tmp_path, capsys):
    path = tmp_path / "allocation.json"
    calls = []

    def compute():
        calls.append(1)
        return {"dims": [len(calls)]}

    key = {"teacher": "t:abc", "lam": 0.0625, "seed": 0}
    assert stage(path, key, compute) == {"dims": [1]}
    assert stage(path, dict(key), compute) == {"dims": [1]} and len(calls) == 1
    assert stage(path, {**key, "lam": 0.5, "seed": 5}, compute) == {"dims": [2]}
    assert f"redo: {path}: lam, seed changed" in capsys.readouterr().out
    assert json.loads(path.read_text())["key"]["lam"] == 0.5  # the file holds what made it


def test_a_damaged_stage_file_is_named_and_computed_again(tmp_path, capsys):
    path, key = tmp_path / "teacher.json", {"teacher": "t:abc"}
    stage(path, key, lambda: {"ppl": 1.5})
    for damage in ['{"key": {"teacher": "t:a', "[1, 2]", "\xff"]:  # cut short, no record, not UTF-8
        path.write_text(damage, encoding="latin-1")
        assert stage(path, key, lambda: {"ppl": 2.5}) == {"ppl": 2.5}
        assert f"redo: {path}: damaged" in capsys.readouterr().out
        assert stage(path, key, lambda: {"ppl": 3.5}) == {"ppl": 2.5}  # whole again


def test_token_cache_is_redone_for_another_tokenizer(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("the cat ran far")
    words = {w: i for i, w in enumerate(["[UNK]", "the", "cat", "ran", "far"])}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    cache = tmp_path / "tokens-train.npy"
    first = token_ids(cache, {"tokenizer": "a", "max_chars": None}, [text], tokenizer, None)
    assert first.tolist() == [1, 2, 3, 4]
    text.write_text("far far")  # a cache with the same key is trusted: the key holds file hashes
    assert token_ids(cache, {"tokenizer": "a", "max_chars": None}, [text], tokenizer, None).equal(
        first
    )
    again = token_ids(cache, {"tokenizer": "b", "max_chars": None}, [text], tokenizer, None)
    assert again.tolist() == [4, 4]
    assert f"redo: {cache}: tokenizer changed" in capsys.readouterr().out


def test_clock_paces_a_resumed_run_on_computed_stages_only(capsys):
    """A stage reloaded as done takes no time; the pace comes from the stage that computed."""
    clock = Clock([("reloaded", 1000.0), ("computed", 40.0), ("next", 12000.0)])
    clock.begin("reloaded")
    clock.begin("computed")
    clock.timed(lambda: time.sleep(0.2))()
    clock.begin("next")
    lines = capsys.readouterr().out.splitlines()
    # pace 0.2 s / 40 s = 0.005, so "next" takes ~60 s; pacing on the reloaded stage too
    # would have said ~2 s
    assert lines[-1].startswith("[3/3] next (~1 min;"), lines[-1]


def test_a_token_cache_replaced_or_cut_is_encoded_again(tmp_path, capsys):
    text, other = tmp_path / "text.txt", tmp_path / "other.txt"
    text.write_text("the cat ran far")
    other.write_text("far far")
    words = {w: i for i, w in enumerate(["[UNK]", "the", "cat", "ran", "far"])}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    cache, other_cache, key = tmp_path / "tokens-train.npy", tmp_path / "tokens-x.npy", {"t": 1}
    token_ids(other_cache, {"t": 2}, [other], tokenizer, None)
    token_ids(cache, key, [text], tokenizer, None)
    for damage in (other_cache.read_bytes(), cache.read_bytes()[:20]):  # another text's, cut
        cache.write_bytes(damage)
        assert token_ids(cache, key, [text], tokenizer, None).tolist() == [1, 2, 3, 4]
        assert f"redo: {cache}: its bytes are not those its record names" in capsys.readouterr().out


def test_a_resumed_training_paces_the_clock_on_its_whole_training(tiny, tiny_ids, tmp_path, capsys):
    """A student's estimate covers its whole training, so a training resumed from its progress file
    counts the seconds before the interruption too: this invocation's share alone made a resumed
    study print a quarter of the time it had left."""
    cfg = SimpleNamespace(out=tmp_path, steps=60, batch=2, lr=0.02, lr_a=0.2, train_chars=None)
    inputs = {"teacher": tiny.identity, "tokenizer": "t", "device": "cpu/float32"}
    run = stages.Run(cfg, tiny, None, 16, 0.0625, (8,), inputs, texts={"train": tiny_ids})
    spec = stages.Student("fix", "softmax", 8, 0, (8, 8))
    path = spec.path(tmp_path)

    def interrupt_after_the_save_at_step_50(line):
        if "54/60" in line:
            raise KeyboardInterrupt

    meta = {"variant": "fix", "key": stages.train_key(run, spec)}
    settings = stages.settings(run, spec.seed)
    with pytest.raises(KeyboardInterrupt):
        distill(tiny, spec.dims, tiny_ids, settings, out_path=path, meta=meta,
                log=interrupt_after_the_save_at_step_50)  # fmt: skip
    before = read_tensors(Path(f"{path}.progress"))[1]["seconds"]
    run.clock = Clock([(spec.name, 100.0), ("next", 1000.0)])
    _, info = stages.train_student(run, spec)
    assert "at step 50/60" in capsys.readouterr().out
    assert info["train_seconds"] > before
    assert run.clock.worked[spec.name] == info["train_seconds"]
