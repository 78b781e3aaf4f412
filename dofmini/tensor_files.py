"""A file of named tensors and a JSON record: how a student, a layer unit and a training in progress
are saved. safetensors (never unpickled), the record as sorted JSON under the header's "dofmini"
key, written whole or not at all."""

import json

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .checkpoint import CheckpointError
from .files import atomic_write


def save_tensors(tensors: dict, path, metadata: dict):
    """A safetensors file written atomically, `metadata` sorted JSON under "dofmini"."""
    ordered = sorted(tensors.items())
    on_cpu = {name: t.detach().cpu().contiguous() for name, t in ordered}
    header = {"dofmini": json.dumps(metadata, sort_keys=True)}
    atomic_write(path, lambda tmp: save_file(on_cpu, str(tmp), header))


def read_tensors(path, tensors=True):
    """(tensors, metadata) of a file save_tensors wrote; with tensors=False, ({}, metadata) from
    its header alone (opening still checks that the header covers the whole file)."""
    try:
        with safe_open(str(path), "pt") as f:
            names = f.keys() if tensors else []
            stored = {n: f.get_tensor(n) for n in names}
            return stored, json.loads(f.metadata()["dofmini"])
    except (SafetensorError, OSError, KeyError, TypeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {path}: {type(err).__name__}: {err}") from None
