"""MoDE (`mod study experiments/mode`): dense, MoD, MoE, MoE with dropping, staged and
integrated MoDE at equal training FLOPs; README.md has the question, the command and the
answer. The code is `study`."""

from __future__ import annotations

from .study import PLAN as STUDY

__all__ = ["STUDY"]
