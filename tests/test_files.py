"""Every file a run writes goes through files.atomic_write: a write killed half-way leaves the old
file (or none) and no temporary; the content hash is the file's sha256."""

import errno
import hashlib

import numpy as np
import pytest

from dofmini.files import atomic_write, sha256_file, write_text


def test_a_write_killed_half_way_leaves_the_old_file(tmp_path):
    cache = tmp_path / "tokens-train.npy"
    old = np.arange(1000, dtype=np.int64)
    atomic_write(cache, lambda tmp: tmp.write_bytes(old.tobytes()))

    def killed(tmp):
        with open(tmp, "wb") as f:
            f.write(b"\x00" * 4000)  # half of the new array
            raise KeyboardInterrupt  # the kill, mid-write

    with pytest.raises(KeyboardInterrupt):
        atomic_write(cache, killed)
    assert cache.read_bytes() == old.tobytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokens-train.npy"]


def test_a_killed_first_write_leaves_nothing(tmp_path):
    def killed(tmp):
        tmp.write_text("{")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "sub" / "results.json", killed)
    assert list((tmp_path / "sub").iterdir()) == []


def test_write_text_replaces_whole_and_hash_is_sha256(tmp_path):
    path = write_text(tmp_path / "report.md", "first")
    write_text(path, "second")
    assert path.read_text() == "second"
    assert sha256_file(path) == hashlib.sha256(b"second").hexdigest()


def test_a_full_disk_is_named_with_the_file_and_leaves_nothing(tmp_path):
    """/dev/full answers every write with ENOSPC, as a full disk does."""
    target = tmp_path / "results.json"

    def write(tmp):
        tmp.write_bytes(b"partial")
        with open("/dev/full", "wb") as full:
            full.write(b"x" * 4096)

    with pytest.raises(OSError, match=f"cannot write {target}: No space left on device") as err:
        atomic_write(target, write)
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(target)
    assert list(tmp_path.iterdir()) == []


def test_a_student_that_cannot_be_saved_is_named_and_leaves_nothing(tmp_path):
    """safetensors reports a failed write as its own SafetensorError, not an OSError: a run must
    still end in one line naming the file. A folder where its temporary goes makes it fail."""
    import os

    import torch

    from dofmini.tensor_files import save_tensors

    target = tmp_path / "students" / "fix-softmax-b8-s0.safetensors"
    blocker = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    blocker.mkdir(parents=True)
    with pytest.raises(OSError, match=f"cannot write {target}: .*Is a directory") as err:
        save_tensors({"z": torch.zeros(2)}, target, {})
    assert err.value.filename == str(target) and not target.exists()


# (tensors, the error, what it says): a dict save_tensors cannot save as given
BASE = list(range(6))
BAD_TENSORS = [
    (lambda t: {"a": t, "b": t}, ValueError, "tensors 'a' and 'b' share memory"),
    (lambda t: {"a": t, "b": t.view(2, 3)}, ValueError, "tensors 'a' and 'b' share memory"),
    (lambda t: {"a": t[:4], "b": t[3:]}, ValueError, "tensors 'a' and 'b' share memory"),
    (lambda t: {"a": t.view(2, 3).T, "b": t[5:]}, ValueError, "tensors 'a' and 'b' share"),
    (lambda t: {"a": t, "b": [1.0]}, TypeError, r"tensors\['b'\] is list; expected a torch"),
    (lambda t: {1: t}, TypeError, r"tensors\[1\] is Tensor; expected a torch.Tensor under a str"),
]  # fmt: skip


@pytest.mark.parametrize("tensors, error, says", BAD_TENSORS)
def test_tensors_save_tensors_cannot_keep_apart_are_refused_at_entry(
    tmp_path, tensors, error, says
):
    """Tensors sharing memory would part on saving (on the CPU safetensors refused them deep in
    its own frames; from another device they were saved twice): refused in save_tensors."""
    import torch

    from dofmini.tensor_files import read_tensors, save_tensors

    base = torch.tensor(BASE, dtype=torch.float32)
    with pytest.raises(error, match=f"save_tensors: {says}") as err:
        save_tensors(tensors(base), tmp_path / "x.safetensors", {})
    assert err.traceback[-1].name == "save_tensors" and not list(tmp_path.iterdir())
    save_tensors({"a": base[:3], "b": base[3:]}, tmp_path / "x.safetensors", {})  # apart: saved
    assert read_tensors(tmp_path / "x.safetensors")[0]["b"].tolist() == BASE[3:]
