"""Mixture-of-Depths transformers: top-k and causal routing, training, and the `mod` command."""

from .cache import KVCache
from .config import PRESETS, MoDConfig, capacity_tokens
from .generate import Generation, GenerationOutput, generate, generate_reference, stream
from .model import BLOCKS, MoDOutput, MoDTransformer
from .routing import Route, routing_accuracy

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
    "routing_accuracy",
    "stream",
]
__version__ = "0.1.0"
