"""Finding, downloading and reading Hugging Face-layout checkpoints (config.json,
model.safetensors, tokenizer.json) without transformers. Weights are read with safetensors only:
nothing is unpickled."""

import hashlib
import json
import os
import shutil
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import torch

from .files import cache_dir, sha256_file, write_text

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


# A weights file modified less than this long ago may still be written to within the same
# timestamp tick, so that same (size, mtime) could later stand for other bytes: its hash is not
# remembered.
SETTLED_NS = 2_000_000_000
_weights_sha256 = {}  # (resolved path, size, mtime_ns) -> sha256 hex, for this process


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is: the message names the file, the field or tensor,
    and what was expected."""


def locate(path_or_name) -> Path:
    """The checkpoint folder a local path or a known model name stands for, without downloading: a
    CheckpointError for a folder without config.json or an unknown name."""
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
    return WEIGHTS_DIR / name


def resolve(path_or_name) -> Path:
    """A checkpoint folder for a local path or a known model name, downloading a named model on
    first use."""
    folder = locate(path_or_name)
    if not Path(path_or_name).is_dir() and not all((folder / f).is_file() for f in FILES):
        download(str(path_or_name), folder)
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
    port = url.port or (443 if url.scheme == "https" else 80)
    # the hub client retries for about 30 s when offline; one quick connect tells us first
    try:
        socket.create_connection((url.hostname, port), 5).close()
    except OSError as err:
        raise CheckpointError(
            f"{name!r} is not in {folder} and the hub is unreachable ({err}). {advice}"
        ) from None
    scratch = folder.with_name(folder.name + ".partial")
    try:
        for filename in FILES:
            if not (folder / filename).is_file():
                fetched = hf_hub_download(repo, filename, local_dir=scratch)
                folder.mkdir(parents=True, exist_ok=True)
                os.replace(fetched, folder / filename)
    # hub down, file renamed upstream, disk full: all end in the same advice
    except Exception as err:
        raise CheckpointError(
            f"could not download {name!r} ({type(err).__name__}: {err}). {advice}"
        ) from None
    shutil.rmtree(scratch, ignore_errors=True)


def read_config(folder: Path) -> dict:
    """config.json as a dict; its fields are checked by the model's Config.from_hf."""
    file = folder / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {file}: {err}") from None
    if not isinstance(config, dict):
        raise CheckpointError(
            f"{file} holds a JSON {type(config).__name__}; expected an object of settings"
        )
    return config


def fingerprint(folder: Path) -> str:
    """The checkpoint's identity, `<folder name>:<16 hex>`: the hex is a sha256 over config.json
    and the sha256 of model.safetensors, so a copy anywhere with the same bytes has the same
    identity and any change to a weight's value gives another. The folder name is only there to
    be read: a renamed copy reads differently."""
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    digest.update(weights_sha256(folder / "model.safetensors").encode())
    return f"{folder.resolve().name}:{digest.hexdigest()[:16]}"


def weights_sha256(file: Path) -> str:
    """sha256 of a weights file, read in full once per version of the file (about 1 s per 500 MB).

    A version is (resolved path, size, mtime_ns): its hash is remembered in this process and in
    `sha256.json` under the user's cache folder, so reloading a checkpoint, even from a new
    process, reads no weights for the hash. A file changed in place gets a new mtime and is hashed
    again; one modified within the last SETTLED_NS is hashed every time. Nothing is written beside
    the checkpoint (its folder may be read-only), and a cache that cannot be read or written only
    costs a re-hash."""
    path = file.resolve()
    stat = path.stat()
    version = (str(path), stat.st_size, stat.st_mtime_ns)
    if version in _weights_sha256:
        return _weights_sha256[version]
    cache = cache_dir() / "sha256.json"
    known = _read_hash_cache(cache)
    if _is_current(str(path), known.get(str(path))):
        _weights_sha256[version] = known[str(path)]["sha256"]
        return _weights_sha256[version]
    digest = sha256_file(path)
    if time.time_ns() - stat.st_mtime_ns < SETTLED_NS:
        return digest
    _weights_sha256[version] = digest
    known = {p: entry for p, entry in known.items() if _is_current(p, entry)}
    known[str(path)] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
    try:
        write_text(cache, json.dumps(known, indent=1, sort_keys=True))
    except OSError:
        pass  # a read-only or full cache folder: the next process hashes again
    return digest


def _read_hash_cache(file: Path) -> dict:
    """{resolved path: {"size", "mtime_ns", "sha256"}}; empty when absent or unreadable."""
    try:
        known = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return known if isinstance(known, dict) else {}


def _is_current(path: str, entry) -> bool:
    """Whether a cache entry still describes the file at `path`, unchanged since it was hashed."""
    if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
        return False
    try:
        stat = os.stat(path)
    except OSError:
        return False
    return entry.get("size") == stat.st_size and entry.get("mtime_ns") == stat.st_mtime_ns


def read_tensors(
    file: Path, expected: dict, aliases: dict, ignored: tuple, dtype: torch.dtype
) -> dict:
    """Load `file` and check it against `expected` {name: shape}, converting each tensor to
    `dtype`. `aliases` maps other spellings of a name (prefixes, renamed heads) to the expected
    one; names ending in one of `ignored` (mask buffers) are skipped. A NaN or inf, stored or made
    by the conversion to `dtype`, is refused: it would spread through every forward pass."""
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
                f"tensor {name!r} in {file} has shape {list(tensor.shape)}, "
                f"expected {list(expected[key])}"
            )
        if not tensor.is_floating_point():
            raise CheckpointError(
                f"tensor {name!r} in {file} has dtype {tensor.dtype}, expected a float dtype"
            )
        tensors[key] = tensor.to(dtype)
        _check_finite(tensors[key], tensor, f"tensor {name!r} in {file}")
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise CheckpointError(
            f"missing tensor {missing[0]!r} in {file} (expected shape {list(expected[missing[0]])})"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
        )
    return tensors


def _check_finite(converted: torch.Tensor, stored: torch.Tensor, what: str) -> None:
    """Refuse NaN or inf in `converted`, saying whether the file holds them or the conversion
    from the stored dtype made them."""
    if torch.isfinite(converted).all():
        return
    bad = stored.isnan() | stored.isinf()
    if bad.any():
        raise CheckpointError(
            f"{what} holds {int(bad.sum())} NaN or inf value(s), first at index "
            f"{bad.nonzero()[0].tolist()}; expected finite weights"
        )
    raise CheckpointError(
        f"{what} has values up to {stored.abs().max().item():.4g}, beyond {converted.dtype}'s "
        f"range; expected them to fit, or load in a wider dtype (e.g. float32)"
    )


def load_tokenizer(path_or_name):
    """The checkpoint's own `tokenizer.json`, through the `tokenizers` package."""
    from tokenizers import Tokenizer

    file = resolve(path_or_name) / "tokenizer.json"
    if not file.is_file():
        raise CheckpointError(f"missing {file}: the tokenizer of this checkpoint")
    try:
        return Tokenizer.from_file(str(file))
    # the tokenizers package raises a bare Exception for unreadable, malformed or foreign files
    except Exception as err:
        raise CheckpointError(
            f"{file} is not a valid tokenizer.json ({err}); expected the file saved by the "
            f"`tokenizers` package"
        ) from None
