"""Finding, downloading and reading Hugging Face-layout checkpoints (config.json, model.safetensors,
tokenizer.json) without transformers. Weights are read with safetensors only: nothing is unpickled."""

import hashlib
import json
import os
import shutil
import socket
from pathlib import Path
from urllib.parse import urlsplit

import torch

FILES = ("config.json", "model.safetensors", "tokenizer.json")
HUB_REPOS = {
    "gpt2": "openai-community/gpt2",
    "pythia-70m": "EleutherAI/pythia-70m",
    "pythia-160m": "EleutherAI/pythia-160m",
    "pythia-410m": "EleutherAI/pythia-410m",
    "pythia-1b": "EleutherAI/pythia-1b",
}
# Named models live here; DOFMINI_WEIGHTS moves it (e.g. for a non-editable install).
WEIGHTS_DIR = Path(
    os.environ.get("DOFMINI_WEIGHTS", Path(__file__).resolve().parents[1] / "weights")
)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is: the message names the file, the tensor and what was expected."""


def resolve(path_or_name) -> Path:
    """A checkpoint folder for a local path or a known model name, downloading a named model on first use."""
    path = Path(path_or_name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckpointError(
                f"{path} has no config.json: expected a Hugging Face-layout folder {FILES}"
            )
        return path
    name = str(path_or_name)
    if name not in HUB_REPOS:
        raise CheckpointError(
            f"unknown model {name!r}: not a folder, and not one of {', '.join(HUB_REPOS)}"
        )
    folder = WEIGHTS_DIR / name
    if not all((folder / f).is_file() for f in FILES):
        download(name, folder)
    return folder


def download(name: str, folder: Path) -> None:
    """Fetch the three files into a scratch folder, then move each into place: a file in `folder` is
    always complete, so an interrupted download is simply retried."""
    from huggingface_hub import constants, hf_hub_download  # only the download path needs it

    repo = HUB_REPOS[name]
    advice = (
        f"Download {', '.join(FILES)} from {constants.ENDPOINT}/{repo} and put them in {folder}/"
    )
    url = urlsplit(constants.ENDPOINT)
    try:  # the hub client retries for about 30 s when offline; one quick connect tells us first
        socket.create_connection(
            (url.hostname, url.port or (443 if url.scheme == "https" else 80)), 5
        ).close()
    except OSError as err:
        raise CheckpointError(
            f"{name!r} is not in {folder} and the hub is unreachable ({err}). {advice}"
        ) from None
    scratch = folder.with_name(folder.name + ".partial")
    try:
        for filename in FILES:
            if not (folder / filename).is_file():
                fetched = hf_hub_download(
                    repo, filename, local_dir=scratch
                )  # shows its own progress bar
                folder.mkdir(parents=True, exist_ok=True)
                os.replace(fetched, folder / filename)
    except (
        Exception
    ) as err:  # hub down, file renamed upstream, disk full: all end in the same advice
        raise CheckpointError(
            f"could not download {name!r} ({type(err).__name__}: {err}). {advice}"
        ) from None
    shutil.rmtree(scratch, ignore_errors=True)


def read_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {folder / 'config.json'}: {err}") from None


def fingerprint(folder: Path) -> str:
    """A cheap identity for a checkpoint: hash of its config and its safetensors header (names, shapes, offsets)."""
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    with open(folder / "model.safetensors", "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        digest.update(f.read(min(header_len, 1 << 24)))
    return f"{folder.resolve().name}:{digest.hexdigest()[:16]}"


def read_tensors(
    file: Path, expected: dict, aliases: dict, ignored: tuple, dtype: torch.dtype
) -> dict:
    """Load `file` and check it against `expected` {name: shape}. `aliases` maps other spellings of a name
    (prefixes, renamed heads) to the expected one; names ending in one of `ignored` (mask buffers) are skipped."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not file.is_file():
        raise CheckpointError(f"missing {file}")
    try:
        stored = load_file(str(file))
    except (SafetensorError, OSError, RuntimeError) as err:
        raise CheckpointError(f"{file} is truncated or corrupt: {err}") from None
    tensors = {}
    for name, tensor in stored.items():
        if name.endswith(ignored):
            continue
        key = aliases.get(name, name)
        if key not in expected:
            raise CheckpointError(f"unexpected tensor {name!r} in {file}")
        if tuple(tensor.shape) != tuple(expected[key]):
            raise CheckpointError(
                f"tensor {name!r} in {file} has shape {list(tensor.shape)}, expected {list(expected[key])}"
            )
        if not tensor.is_floating_point():
            raise CheckpointError(
                f"tensor {name!r} in {file} has dtype {tensor.dtype}, expected a float dtype"
            )
        tensors[key] = tensor.to(dtype)
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise CheckpointError(
            f"missing tensor {missing[0]!r} in {file} (expected shape {list(expected[missing[0]])})"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
        )
    return tensors


def load_tokenizer(path_or_name):
    """The checkpoint's own `tokenizer.json`, through the `tokenizers` package."""
    from tokenizers import Tokenizer

    file = resolve(path_or_name) / "tokenizer.json"
    if not file.is_file():
        raise CheckpointError(f"missing {file}: the tokenizer of this checkpoint")
    return Tokenizer.from_file(str(file))
