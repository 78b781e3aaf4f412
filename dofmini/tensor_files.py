"""A file of named tensors and a JSON record: how a student, a layer unit and a training in progress
are saved. safetensors (never unpickled), the record as sorted JSON under the header's "dofmini"
key, written whole or not at all."""

import json

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .checkpoint import CheckpointError
from .files import atomic_write


def _sharing(tensors: dict) -> tuple:
    """Two names whose CPU tensors overlap in memory, or (): safetensors refuses them, deep in
    its own frames (another device's tensors are copied to the CPU apart, and its pointers need
    not be the machine's: a simulated CUDA device's are not)."""
    spans = []
    for name, t in tensors.items():
        if t.numel() and t.device.type == "cpu":
            reach = sum((size - 1) * step for size, step in zip(t.shape, t.stride()))
            end = t.data_ptr() + (reach + 1) * t.element_size()  # past its last element
            spans.append((str(t.device), t.data_ptr(), end, name))
    spans.sort()
    for (device, _, end, name), (other, start, _, second) in zip(spans, spans[1:]):
        if device == other and start < end:  # sorted: an overlap shows in a neighbouring pair
            return name, second
    return ()


def save_tensors(tensors: dict, path, metadata: dict):
    """A safetensors file written atomically, `metadata` sorted JSON under "dofmini"; a dict
    that is not of str names to tensors each in its own memory is refused, by name."""
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            got = f"tensors[{name!r}] is {type(t).__name__}"
            raise TypeError(f"save_tensors: {got}; expected a torch.Tensor under a str name")
    shared = _sharing(tensors)
    if shared:
        both = " and ".join(map(repr, shared))
        raise ValueError(
            f"save_tensors: tensors {both} share memory; expected each its own (clone one)"
        )
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
