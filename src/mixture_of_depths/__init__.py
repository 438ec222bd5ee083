"""Mixture-of-Depths transformers: top-k and causal routing, training, and the `mod` command.

The face of the library: the model, its config, generation, routing records, and the loaders of
a saved checkpoint (`load_model`, `load_tokenizer`). Training is `mixture_of_depths.train`, the
Hugging Face bridge `mixture_of_depths.hf`; the layout is in docs/layout.md.
"""

from .cache import KVCache
from .config import PRESETS, MoDConfig, capacity_tokens
from .data import load_tokenizer
from .generate import Generation, GenerationOutput, generate, generate_reference, stream
from .model import BLOCKS, MoDOutput, MoDTransformer
from .routing import Route, routing_accuracy, routing_scores
from .runtime.checkpoint import load_model

__all__ = [
    "BLOCKS",
    "PRESETS",
    "Generation",
    "GenerationOutput",
    "KVCache",
    "MoDConfig",
    "MoDOutput",
    "MoDTransformer",
    "Route",
    "capacity_tokens",
    "generate",
    "generate_reference",
    "load_model",
    "load_tokenizer",
    "routing_accuracy",
    "routing_scores",
    "stream",
]
__version__ = "0.1.0"
