"""The KV strategies (`mod study experiments/kv`): what a routed layer keeps of the tokens that
skip it (skipped_kv "none" and "residual") at two capacities and two lengths: loss, FLOPs,
cache bytes and decode speed; README.md has the question, the command and the answer. The
code is `study`."""

from __future__ import annotations

from .study import PLAN as STUDY

__all__ = ["STUDY"]
