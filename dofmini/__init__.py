"""dofmini: softmax attention distilled into positive-random-feature linear attention, with per-layer
feature dimensions chosen from the degrees of freedom of each layer's attention kernel (arXiv 2507.03340)."""
from .checkpoint import CheckpointError, load_tokenizer
from .model import load

__all__ = ["CheckpointError", "load", "load_tokenizer"]
