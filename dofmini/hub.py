"""Checkpoints by name or folder: where the known models live, their download from the Hugging Face
hub on first use, the teacher's identity, and the checkpoint's own tokenizer, checked against it."""

import hashlib
import logging
import os
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import torch

from .checkpoint import CheckpointError, check_dtype, load_folder, read_config
from .files import by_hand, sha256_file
from .model import Model

FILES = ("config.json", "model.safetensors", "tokenizer.json")
HUB_REPOS = {"gpt2": "openai-community/gpt2"} | {
    f"pythia-{size}": f"EleutherAI/pythia-{size}" for size in ("70m", "160m", "410m", "1b")
}
# Named models live here; DOFMINI_WEIGHTS moves it (e.g. for a non-editable install).
WEIGHTS_DIR = Path(os.getenv("DOFMINI_WEIGHTS") or Path(__file__).resolve().parents[1] / "weights")
PROBE_SECONDS = 10  # how long a host may take to answer before it counts as unreachable


def locate(path_or_name) -> Path:
    """The checkpoint folder a local path or a known model name stands for, without downloading."""
    path, name = Path(path_or_name), str(path_or_name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path} has no config.json: expected a folder holding {FILES}")
        return path
    if name not in HUB_REPOS:
        known = ", ".join(HUB_REPOS)
        raise CheckpointError(f"unknown model {name!r}: not a folder, and not one of {known}")
    return WEIGHTS_DIR / name


def missing_files(path_or_name) -> list:
    """[(direct URL, destination file)] a named checkpoint lacks, without network (what to fetch
    by hand offline); empty for a folder. The host is huggingface_hub's ENDPOINT (HF_ENDPOINT)."""
    folder = locate(path_or_name)
    if Path(path_or_name).is_dir():
        return []
    from huggingface_hub import constants  # only named models need it

    base = f"{constants.ENDPOINT}/{HUB_REPOS[str(path_or_name)]}/resolve/main"
    return [(f"{base}/{f}", folder / f) for f in FILES if not (folder / f).is_file()]


def unreachable(url: str) -> str:
    """Why `url`'s host cannot be reached ("" when it answers, with any HTTP status), by one
    HEAD request that honours the proxy settings: a download tried on an unreachable host would
    wait through huggingface_hub's five retries (about 25 s) before failing."""
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        return ""  # a local folder (file://): its own read names a missing file
    try:
        request = urllib.request.Request(url, method="HEAD")
        urllib.request.urlopen(request, timeout=PROBE_SECONDS).close()
    except urllib.error.HTTPError:  # an answer: the host is there
        return ""
    except (OSError, ValueError) as err:  # URLError (no connection), a timeout, not a URL
        return f"unreachable: {getattr(err, 'reason', err)}"
    return ""


def resolve(path_or_name) -> Path:
    """locate's folder, after downloading what a named model lacks; a failure says what to fetch."""
    folder = locate(path_or_name)
    needed = missing_files(path_or_name)
    name = str(path_or_name)
    if not needed:
        return folder
    from huggingface_hub import hf_hub_download

    host = urllib.parse.urlsplit(needed[0][0]).netloc
    advice = (
        f"Download each file by hand and put it at its path, or set DOFMINI_WEIGHTS to a folder "
        f"holding {name}/ already:{by_hand(needed)}"
    )
    failed = f"could not be downloaded from {host}"
    if why := unreachable(needed[0][0]):
        raise CheckpointError(f"{name!r} is not in {folder} and {failed} ({why}). {advice}")
    folder.parent.mkdir(parents=True, exist_ok=True)
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)  # its retry warnings: the error below says it all
    try:
        # a file enters the folder only by a rename once whole: huggingface_hub writes in place
        # into local_dir (a fresh scratch folder) when it copies from its own cache
        with tempfile.TemporaryDirectory(prefix=f".{folder.name}.", dir=folder.parent) as scratch:
            for _, file in needed:
                fetched = hf_hub_download(HUB_REPOS[name], file.name, local_dir=scratch)
                folder.mkdir(exist_ok=True)
                os.replace(fetched, file)
    except Exception as err:  # hub down, file renamed upstream, disk full: one advice
        why = f"{type(err).__name__}: {err}"
        raise CheckpointError(
            f"{name!r} is not in {folder} and {failed} ({why}). {advice}"
        ) from None
    finally:
        hub_log.setLevel(level)
    return folder


def fingerprint(folder: Path) -> str:
    """`<folder name>:<16 hex of a sha256 over config.json and model.safetensors' sha256>`: equal
    bytes anywhere, equal identity; any changed weight, another. Hashed on every load (1 s per
    500 MB): a hash remembered by path, size and mtime misses a rewrite with the mtime restored."""
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    digest.update(sha256_file(folder / "model.safetensors").encode())
    return f"{folder.resolve().name}:{digest.hexdigest()[:16]}"


def load(path_or_name, dtype: torch.dtype = torch.float32) -> Model:
    """A frozen teacher from a checkpoint folder or a known name (`gpt2`, `pythia-70m`, ...), with
    its content fingerprint as `.identity`."""
    check_dtype(dtype)  # before a download
    folder = resolve(path_or_name)
    model = load_folder(folder, dtype)
    model.identity = fingerprint(folder)
    return model


def load_tokenizer(path_or_name):
    """The checkpoint's tokenizer.json (a `tokenizers.Tokenizer`), refused unless its ids fit
    vocab_size and bos/eos_token_id are its special tokens: another family's tokenizer (GPT-2's
    <|endoftext|> is 50256, NeoX's 0) would otherwise run, silently wrong."""
    from tokenizers import Tokenizer

    folder = resolve(path_or_name)
    cfg = read_config(folder)
    config = folder / "config.json"
    file = folder / "tokenizer.json"
    if not file.is_file():
        raise CheckpointError(f"missing {file}: the tokenizer of this checkpoint")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises a bare Exception for any file it cannot read
        expected = "expected the file saved by the `tokenizers` package"
        raise CheckpointError(f"{file} is not a valid tokenizer.json ({err}); {expected}") from None
    largest = max(tokenizer.get_vocab(with_added_tokens=True).values())
    if largest >= cfg.vocab_size:
        vocab = f"{config} has vocab_size {cfg.vocab_size}"
        expected = "expected every id below it (the tokenizer of this checkpoint)"
        raise CheckpointError(f"{file} has token ids up to {largest}, but {vocab}; {expected}")
    special = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    for key in ("bos_token_id", "eos_token_id"):
        if getattr(cfg, key) not in (None, *special):
            listed = ", ".join(f"{t} = {i}" for i, t in special.items()) or "none"
            has = f"{config} has {key} {getattr(cfg, key)}"
            theirs = f"the special tokens of {file} are {listed}"
            raise CheckpointError(f"{has}, but {theirs}; expected the tokenizer of this checkpoint")
    return tokenizer
