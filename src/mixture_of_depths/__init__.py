"""Mixture-of-Depths transformers: top-k and causal routing, training, and the `mod` command."""

from .config import PRESETS, MoDConfig, capacity_tokens
from .model import MoDOutput, MoDTransformer, Route, routing_accuracy

__all__ = [
    "PRESETS",
    "MoDConfig",
    "MoDOutput",
    "MoDTransformer",
    "Route",
    "capacity_tokens",
    "routing_accuracy",
]
__version__ = "0.1.0"
