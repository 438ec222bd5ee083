"""`mod study experiments/round3`: why MoD stops learning where dense learns to look back.

Round 2 found MoD furthest behind dense at 1024 tokens of context and 1.5e14 training FLOPs
(+15.2%), with hints of why: dense's loss keeps falling with the place in the context and drops
suddenly where a model learns to copy from its context (induction heads), MoD's does not; the
gates on chosen tokens shrink as training goes on. This round reruns the pair there (dense XS,
MoD S) with the copy probe and the gates logged at ten evaluations on 256 windows, and one arm
per hypothesis: residual KV and dense attention (does routing isolation block looking back?), a
straight-through gate (do the gates shut the blocks?), capacities 25% and 50% at equal FLOPs,
the learning rate of each architecture, and the MoD model without its routed blocks. Every arm
has two seeds; the reference pair, the two look-back arms and any arm that closes the gap to
dense have three.

`planning`: the settings, the arms and the plan; `running`: `rounds.run` with them; `report`:
the deciding table and the plots; `mechanism`: which hypothesis the arms support, by rule.
Resumable, one process or several (`--workers 2`).
"""

from __future__ import annotations

from .planning import ARMS, FOLDERS, FULL, QUICK, Arm, Round3Settings, plan
from .report import write_report
from .running import ROUND3, run

STUDY = ROUND3

__all__ = [
    "STUDY",
    "ARMS",
    "FOLDERS",
    "FULL",
    "QUICK",
    "ROUND3",
    "Arm",
    "Round3Settings",
    "plan",
    "run",
    "write_report",
]
