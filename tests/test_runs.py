"""A saved stage is reused only for the settings that made it: a changed setting recomputes it and
says which; token caches follow the same rule. A training interrupted and resumed from its progress
file gives bit-identical tensors to an uninterrupted one and counts its whole time; progress of
other settings, or that cannot be read, is named and set aside."""

import dataclasses
import functools
import json
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import char_tokenizer
from tokenizers import Tokenizer, models, pre_tokenizers

from dofmini.distill import TrainSettings, distill, train_direct
from dofmini.students import load_student, make_student
from dofmini.study import bank, compute, evaluate, guard, store
from dofmini.study.compute import valid_allocation
from dofmini.study.run import ALLOCATIONS, Run, check_texts
from dofmini.study.runner import Runner
from dofmini.study.store import load_or_compute as stage
from dofmini.study.store import peak_memory, token_ids, train_into
from dofmini.tensor_files import read_tensors


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
    assert f"redo: {cache.with_suffix('.json')}: tokenizer changed" in capsys.readouterr().out


def test_a_stage_gets_one_progress_line(tmp_path, capsys):
    """Which stage of how many; a stage's later files add no line."""
    names = ["teacher evaluation", "fix/softmax/b8/s0"]
    runner = Runner([SimpleNamespace(name=name) for name in names])
    for name, file in zip((*names, names[1]), ("a", "b", "c")):
        runner.stage(name, tmp_path / f"{file}.json", {}, lambda: {"x": 1})
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    elapsed = " (run: 0 s elapsed)"  # no estimates: the wall time since the run began alone
    assert lines == [f"[1/2] teacher evaluation{elapsed}", f"[2/2] fix/softmax/b8/s0{elapsed}"]


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


def progress_seconds(path: Path) -> float:
    """The seconds a progress file (store.save_progress's) has counted so far."""
    return torch.load(path, weights_only=True)["meta"]["seconds"]


def test_a_resumed_training_counts_its_whole_training(tiny, tiny_ids, tmp_path, capsys):
    """A training resumed from its progress file counts the seconds before the interruption too."""
    cfg = SimpleNamespace(
        out=tmp_path, steps=60, batch=2, lr=0.02, lr_a=0.2, train_chars=None, per_device=1
    )
    inputs = {"teacher": tiny.identity, "tokenizer": "t", "device": "cpu/float32"}
    run = Run(cfg, tiny, None, 16, 0.0625, (8,), inputs, texts={"train": tiny_ids})
    spec = run.student("fix", "softmax", 8, 0, (8, 8))

    def interrupt_after_the_save_at_step_50(line):
        if "54/60" in line:
            raise KeyboardInterrupt

    units = bank.units_of(run, spec)  # its layers' units, trained together
    with pytest.raises(KeyboardInterrupt):
        bank.train_units(run, units, log=interrupt_after_the_save_at_step_50)
    [progress] = (tmp_path / "units").glob("*.progress")
    before = progress_seconds(progress)
    compute.train_student(run, spec)
    info = store.saved(spec.path(tmp_path), spec.key)["info"]
    assert "at step 50/60" in capsys.readouterr().out
    assert info["train_seconds"] > before


# --- a training kept on disk ---

S, quiet = TrainSettings, lambda line: None


def trainable(student) -> dict:
    return {n: p.detach().clone() for n, p in student.named_parameters() if p.requires_grad}


def kept(tiny, tiny_ids, path, settings, log, loss="softmax", dims=(4, 4), seed=0, **options):
    """train_into's record of a student trained into `path`, as compute.train_student runs it."""
    if loss == "direct":
        start = make_student(tiny, "prf", dims, seed)
        train = functools.partial(train_direct, start, tiny_ids, settings)
    else:
        common = dict(loss=loss, feature_seed=seed)
        train = functools.partial(distill, tiny, dims, tiny_ids, settings, **common)
    record = options.get("record", {"loss": loss})
    every = options.get("save_every", 50)
    return train_into(path, record, settings, tiny_ids, train, log, every)


def interrupt_at(step):
    def log(line):
        if f" {step}/" in line:
            raise KeyboardInterrupt(line)

    return log


@pytest.mark.parametrize("loss", ["softmax", "direct"])
def test_resume_after_interruption_equals_an_uninterrupted_run(tiny, tiny_ids, tmp_path, loss):
    settings = S(steps=6, batch=2, ctx=32, data_seed=1, log_every=2)
    # a tuple, as a stage key holds, comes back as a list
    record = {"loss": loss, "key": {"dims": (5, 7)}}
    options = dict(settings=settings, loss=loss, dims=[5, 7], seed=1, record=record, save_every=2)
    run = functools.partial(kept, tiny, tiny_ids, **options)
    run(tmp_path / "whole.safetensors", log=quiet)
    whole = trainable(load_student(tiny, tmp_path / "whole.safetensors")[0])
    path = tmp_path / "resumed.safetensors"
    with pytest.raises(KeyboardInterrupt):
        run(path, log=interrupt_at(4))
    assert not path.exists() and (tmp_path / "resumed.safetensors.progress").exists()
    interrupted = progress_seconds(path.with_name(path.name + ".progress"))
    lines = []
    info = run(path, log=lines.append)
    assert "at step 4/6" in lines[0] and len(lines) == 2  # then 6/6: steps 1-4 are not redone
    assert info["train_seconds"] > interrupted > 0  # the time before the interruption counts
    assert read_tensors(path)[1]["info"] == info
    resumed = trainable(load_student(tiny, path)[0])
    assert all(torch.equal(whole[n], resumed[n]) for n in whole)
    assert not (tmp_path / "resumed.safetensors.progress").exists()


def test_the_first_step_logs_the_peak_memory(tiny, tiny_ids, tmp_path):
    lines = []
    kept(tiny, tiny_ids, tmp_path / "s.safetensors", S(steps=2, batch=2, ctx=32), lines.append)
    logged = [line for line in lines if line.startswith("peak memory after the first step: ")]
    assert len(logged) == 1 and logged[0].endswith(" (each rank)")
    if not Path("/proc/self/status").exists():  # not Linux
        assert "not readable on this system" in logged[0]
        return
    gib = float(logged[0].split(": ")[1].split(" GiB resident")[0])
    assert 0 < gib <= float(peak_memory(torch.device("cpu")).split()[0])  # a peak never falls


def test_progress_of_other_settings_is_set_aside_and_training_starts_over(tiny, tiny_ids, tmp_path):
    path = tmp_path / "s.safetensors"
    first = S(steps=4, batch=2, ctx=32, log_every=2)
    with pytest.raises(KeyboardInterrupt):
        kept(tiny, tiny_ids, path, first, interrupt_at(2), loss="l2", save_every=2)
    assert path.with_name(path.name + ".progress").exists()
    lines, other = [], dataclasses.replace(first, lr=0.01, dtype="float64")
    kept(tiny, tiny_ids, path, other, lines.append, loss="l2")
    assert "(dtype, lr changed)" in lines[0] and "starting over" in lines[0], lines
    assert not any("resuming" in line for line in lines)
    fresh = trainable(distill(tiny, [4, 4], tiny_ids, other, loss="l2", log=quiet)[0])
    student = trainable(load_student(tiny, path)[0])
    assert all(torch.equal(t, fresh[n]) for n, t in student.items())


def test_an_unreadable_progress_file_is_named_and_training_starts_over(tiny, tiny_ids, tmp_path):
    path, settings = tmp_path / "s.safetensors", S(steps=2, batch=2, ctx=32, log_every=1)
    path.with_name(path.name + ".progress").write_bytes(b"garbage")
    lines = []
    kept(tiny, tiny_ids, path, settings, lines.append)
    assert f"{path}.progress: unreadable (cannot read {path}.progress" in lines[0], lines
    assert "starting over" in lines[0] and not path.with_name(path.name + ".progress").exists()
    fresh = trainable(distill(tiny, [4, 4], tiny_ids, settings, log=quiet)[0])
    student = trainable(load_student(tiny, path)[0])
    assert all(torch.equal(t, fresh[n]) for n, t in student.items())


# --- what a rerun, a shared --out or a short text meets ---


def refuse(message):
    raise SystemExit(message)


def test_a_lock_that_is_a_link_is_refused_and_its_target_kept(tmp_path):
    (tmp_path / "target").write_text("precious")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / ".lock").symlink_to(tmp_path / "target")
    with pytest.raises(SystemExit, match=r"out/.lock is a symbolic link; expected the run's own"):
        with guard.locked(tmp_path / "out", refuse):
            pass
    assert (tmp_path / "target").read_text() == "precious"


def small_run(tiny, tmp_path, ctx=16, **texts) -> Run:
    cfg = SimpleNamespace(out=tmp_path, data=tmp_path / "store", J=64, variants=("fix",), limit=0)
    cfg.__dict__.update(error_windows=2, curve_windows=2, e2e_windows=2, batch=2, steps=1)
    cfg.heldout_skip = 0
    cfg.__dict__.update(lr=0.02, lr_a=0.2, per_device=1)
    texts = {name: torch.zeros(1000, dtype=torch.long) for name in ("calib", "train")} | texts
    texts = {"wikitext2": torch.zeros(100, dtype=torch.long), "heldout": texts["calib"]} | texts
    return Run(cfg, tiny, None, ctx, 0.0625, (8,), {}, texts=texts)


@pytest.mark.parametrize("result", [{}, "x", {"per_head": [[1.0], [1.0]], "dims": {"8": {}}}])
def test_a_saved_result_of_another_shape_is_named_and_redone(tiny, tmp_path, capsys, result):
    run, path = small_run(tiny, tmp_path), tmp_path / "allocation.json"
    key, valid = {"lam": 0.0625}, functools.partial(valid_allocation, run)  # the DoF stage's own
    dims = {v: [4, 4] for v in ("fix", *ALLOCATIONS)}
    good = {"per_head": [[1.0], [1.0]], "dims": {"8": dims}, "seconds": 1.0}
    path.write_text(json.dumps({"key": key, "result": result}))
    assert store.saved(path, key) == result and store.saved(path, key, valid) is None
    assert stage(path, key, lambda: good, valid=valid) == good
    assert (
        f"redo: {path}: its result is not of the shape this stage writes" in capsys.readouterr().out
    )
    for bad in ([4, 0], [4]):  # a 0 dim, a short list
        assert not valid({**good, "dims": {"8": {**dims, "dof": bad}}})


def test_the_held_out_roles_are_disjoint_and_each_window_knows_its_article(tiny, tmp_path):
    """20 articles of 8 windows of 16 characters, each opening on its title line: each role's
    windows are apart from every other role's, the end-to-end KL's spread over many articles, and
    a window's article is the one whose title comes last before its first token."""
    ctx, per_article = 16, 8  # small_run's context: one character a token
    articles = []
    for number in range(20):
        title = f"= Article {number:02d} =\n"
        articles.append(title + "x" * (per_article * ctx - len(title) - 1) + "\n")
    text = "".join(articles)  # 2,560 characters: 160 windows
    held_out = tmp_path / "store" / evaluate.PPL_TEXTS["heldout"]
    held_out.parent.mkdir(parents=True)
    held_out.write_text(text, encoding="utf-8")
    run = small_run(tiny, tmp_path, ctx, heldout=torch.zeros(len(text), dtype=torch.long))
    run.tokenizer = char_tokenizer()
    sizes = dict(errors=10, curves=10, e2e=20, swaps=20)  # the swaps' count is e2e_windows too
    counts = dict(error_windows=sizes["errors"], curve_windows=sizes["curves"])
    run.cfg.__dict__.update(counts, e2e_windows=sizes["e2e"])  # before the draw, made at first use
    windows, found = run.windows, run.articles()
    assert {role: len(set(drawn)) for role, drawn in windows.items()} == sizes
    assert len(set().union(*windows.values())) == sum(sizes.values())  # no window in two roles
    assert found == {role: [w // per_article for w in drawn] for role, drawn in windows.items()}
    assert len(set(found["e2e"])) >= 10 and len(set(found["swaps"])) >= 10


def test_a_text_too_short_for_the_run_is_one_error_naming_its_file(tiny, tmp_path):
    held_out = torch.zeros(50, dtype=torch.long)  # the four roles need 8 windows of 16
    with pytest.raises(store.RunError, match=r"wikipedia-heldout.txt: 50 tokens; 128 needed \(the"):
        check_texts(small_run(tiny, tmp_path, heldout=held_out))
    with pytest.raises(store.RunError, match=r"wiki.test.raw: 10 tokens; 16 needed \(a window"):
        check_texts(small_run(tiny, tmp_path, wikitext2=torch.zeros(10)))
    with pytest.raises(store.RunError, match=r"ctx 1 \(64 positions in the model\): expected 2"):
        small_run(tiny, tmp_path, ctx=1).settings(0)
    check_texts(small_run(tiny, tmp_path))


def test_after_a_failure_further_signals_are_ignored():
    before = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit, match="boom"):
            with guard.one_line_errors(refuse):
                raise store.RunError("boom")
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # torchrun's to the others
    finally:
        signal.signal(signal.SIGTERM, before)
