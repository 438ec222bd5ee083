"""Mixture-of-Recursions (`mod study experiments/mor`): expert and token choice, recursion-wise
and shared KV, the plain recursive model, beside dense and MoD, and at equal unique
parameters; README.md has the question, the command and the answer. The code is `study`."""

from __future__ import annotations

from .study import PLAN as STUDY

__all__ = ["STUDY"]
