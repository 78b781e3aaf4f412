"""Checkpoints by name or folder: where the known models live, their download from the Hugging Face
hub on first use, the teacher's identity, and the checkpoint's own tokenizer, checked against it."""

import hashlib
import os
import shutil
import socket
from pathlib import Path
from urllib.parse import urlsplit

import torch

from .checkpoint import CheckpointError, load_folder, read_config
from .files import sha256_file
from .model import Config, Model

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
    if str(path_or_name) not in HUB_REPOS:
        raise CheckpointError(
            f"unknown model {str(path_or_name)!r}: not a folder, and not one of "
            f"{', '.join(HUB_REPOS)}"
        )
    return WEIGHTS_DIR / str(path_or_name)


def missing_files(path_or_name) -> list:
    """[(direct URL, destination file)] of the files a named checkpoint still lacks, without
    network: what to fetch by hand on a machine without internet. Empty for a folder (nothing to
    download) and for a named model already in place. The host is huggingface_hub's ENDPOINT
    (https://huggingface.co unless HF_ENDPOINT says otherwise)."""
    folder = locate(path_or_name)
    if Path(path_or_name).is_dir():
        return []
    from huggingface_hub import constants  # only named models need it

    base = f"{constants.ENDPOINT}/{HUB_REPOS[str(path_or_name)]}/resolve/main"
    return [(f"{base}/{f}", folder / f) for f in FILES if not (folder / f).is_file()]


def resolve(path_or_name) -> Path:
    """A checkpoint folder for a local path or a known model name, downloading what a named model
    lacks on first use."""
    needed = missing_files(path_or_name)
    if needed:
        download(str(path_or_name), needed)
    return locate(path_or_name)


def download(name: str, needed: list) -> None:
    """Fetch `needed` (from missing_files) into a scratch folder, moving each file into place: a
    file in the checkpoint folder is always complete, so an interrupted download is simply
    retried. Any failure names the files to fetch by hand."""
    from huggingface_hub import constants, hf_hub_download

    folder = needed[0][1].parent
    advice = "Download each file by hand and put it at its path:" + "".join(
        f"\n  {url}\n    -> {file}" for url, file in needed
    )
    url = urlsplit(constants.ENDPOINT)
    # the hub client retries for about 30 s when offline; one quick connect tells us first
    try:
        port = url.port or (443 if url.scheme == "https" else 80)
        socket.create_connection((url.hostname, port), 5).close()
    except OSError as err:
        raise CheckpointError(
            f"{name!r} is not in {folder} and the hub is unreachable ({err}). {advice}"
        ) from None
    scratch = folder.with_name(folder.name + ".partial")
    try:
        for _, file in needed:
            fetched = hf_hub_download(HUB_REPOS[name], file.name, local_dir=scratch)
            folder.mkdir(parents=True, exist_ok=True)
            os.replace(fetched, file)
    # hub down, file renamed upstream, disk full: all end in the same advice
    except Exception as err:
        raise CheckpointError(
            f"could not download {name!r} ({type(err).__name__}: {err}). {advice}"
        ) from None
    shutil.rmtree(scratch, ignore_errors=True)


def fingerprint(folder: Path) -> str:
    """The checkpoint's identity, `<folder name>:<16 hex>`: the hex is a sha256 over config.json
    and the sha256 of model.safetensors, so a copy anywhere with the same bytes has the same
    identity and any change to a weight's value gives another. The weights are hashed on every
    load (about 1 s per 500 MB): a remembered hash keyed by path, size and mtime would miss a file
    rewritten in place within one timestamp tick, or with its mtime restored. The folder name is
    only there to be read: a renamed copy reads differently."""
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    digest.update(sha256_file(folder / "model.safetensors").encode())
    return f"{folder.resolve().name}:{digest.hexdigest()[:16]}"


def load(path_or_name, dtype: torch.dtype = torch.float32) -> Model:
    """A frozen teacher from a checkpoint folder or a known name (`gpt2`, `pythia-70m`, ...), with
    its content fingerprint as `.identity`."""
    folder = resolve(path_or_name)
    model = load_folder(folder, dtype)
    model.identity = fingerprint(folder)
    return model


def load_tokenizer(path_or_name):
    """The checkpoint's own tokenizer.json, through the `tokenizers` package, refused unless it
    fits the checkpoint's config.json: every token id below vocab_size, and bos_token_id and
    eos_token_id (where given) ids of the tokenizer's special tokens. A tokenizer of another
    family (GPT-2's <|endoftext|> is 50256, NeoX's is 0) would otherwise run, silently wrong."""
    from tokenizers import Tokenizer

    folder = resolve(path_or_name)
    cfg, file = read_config(folder), folder / "tokenizer.json"
    if not file.is_file():
        raise CheckpointError(f"missing {file}: the tokenizer of this checkpoint")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    # the tokenizers package raises a bare Exception for unreadable, malformed or foreign files
    except Exception as err:
        raise CheckpointError(
            f"{file} is not a valid tokenizer.json ({err}); expected the file saved by the "
            f"`tokenizers` package"
        ) from None
    check_tokenizer(tokenizer, file, cfg, folder / "config.json")
    return tokenizer


def check_tokenizer(tokenizer, file: Path, cfg: Config, config_file: Path) -> None:
    """Refuse `tokenizer` (read from `file`) unless it fits `cfg` (read from `config_file`)."""
    largest = max(tokenizer.get_vocab(with_added_tokens=True).values())
    if largest >= cfg.vocab_size:
        raise CheckpointError(
            f"{file} has token ids up to {largest}, but {config_file} has vocab_size "
            f"{cfg.vocab_size}; expected every id below it (the tokenizer of this checkpoint)"
        )
    special = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    for key in ("bos_token_id", "eos_token_id"):
        value = getattr(cfg, key)
        if value is not None and value not in special:
            raise CheckpointError(
                f"{config_file} has {key} {value}, but the special tokens of {file} are "
                f"{', '.join(f'{t} = {i}' for i, t in special.items()) or 'none'}; expected "
                f"the tokenizer of this checkpoint"
            )
