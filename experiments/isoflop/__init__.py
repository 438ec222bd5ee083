"""Round 1, the isoFLOP study (`mod study experiments/isoflop`): does MoD beat dense at equal
training FLOPs? Dense and MoD models of several sizes at three budgets on byte tokens, with
ablations (capacity, every block routed, random routing, raw gate, predictor); README.md has the
question, the command and the answer. The code is `study`."""

from __future__ import annotations

from .study import ISOFLOP as STUDY

__all__ = ["STUDY"]
