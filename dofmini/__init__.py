"""dofmini: softmax attention distilled into positive-random-feature linear attention, each
layer's feature dimension chosen from the degrees of freedom of its kernel (arXiv 2507.03340)."""

from .checkpoint import CheckpointError
from .generate import generate
from .hub import load, load_tokenizer

__version__ = "0.9.0"
__all__ = ["CheckpointError", "generate", "load", "load_tokenizer"]
