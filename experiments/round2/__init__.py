"""`mod study experiments/round2`: the isoFLOP study again, with fair baselines, on BPE tokens.

Phase 1, the routing ablations (one size, one budget, 256 tokens of context, two seeds each):
learned routing with the aux loss at weights 0.01, 0.1 (round 1's default) and 1.0, the
predictor, each causal router with the straight-through gate (1 forward, sigmoid's gradient) in
place of the sigmoid, the aux-loss router with no gradient from the LM loss, random routing
compute-matched in causal mode (each token takes a block with probability = the capacity) and
random routing at the aux-loss model's own measured
per-router take-rates, the dense model of that size, and the winning learned router with a
capacity warm-up over the first 10% of steps (its extra FLOPs charged to the budget); then the
winner (with the warm-up where its mean was lower), random routing and dense trained 3.3x
longer, and the MoD model without its routed blocks (its unrouted layers alone, dense) at both
budgets: does the routed compute do anything at this size? Every run logs the routing
diagnostics at ten evaluations (`routing_diag` in its metrics, copied to ``<out>/metrics/``),
and its checkpoint is profiled with `inspect.analyse` before it is deleted: blocks taken per
token, the share of takes that go to newline tokens, and Spearman's rho of blocks taken against
the predictive entropy.

Phase 2, the isoFLOP grid: dense against MoD with the winning causal router (lowest mean causal
loss over the two seeds among the learned variants), BPE tokens (vocabulary 4096, trained once
and cached), at 256 and 1024 tokens of context with 4096 tokens per step, three budgets up to
1.5e14 training FLOPs, three sizes at each (and the next size out wherever an architecture's best
lands on an edge, so each curve shows its minimum); the best two sizes of each architecture at
each budget train again with a second seed. Each run's checkpoint is profiled before it is
deleted: its held-out loss by place in the context (`position_profile`), which tells what a
model learns from its context apart from the rest (runs finished before this profile existed
have none). About 20 hours on 2 CPU cores (~90 GFLOP/s),
so it runs over several sessions: rerun to resume.

Runs, resumption and FLOP accounting are `runner`'s: an interrupted study resumes where it
stopped. The report is rewritten after every run; `notes.md` in the output folder, if present
(the diagnosis in words), is included in it, its verdict quotes filled from the results. Every
verdict is the verdict module's (`verdicts`; README.md has the question and the answer).

`planning`: the settings, the variants and the plan that follows the results; `running`: the
resumable run, one process or several (`studies.workers`); `profiles`: what is measured of each
trained model; `verdicts`: every comparison's verdict; `report` and `plots`: the report and
its figures.
"""

from __future__ import annotations

from .planning import DENSE, FOLDERS, FULL, MOD, WARMUP, Round2Settings, mod_arm, plan
from .report import write_report
from .running import ROUND2, run

STUDY = ROUND2

__all__ = [
    "STUDY",
    "DENSE",
    "FOLDERS",
    "FULL",
    "MOD",
    "WARMUP",
    "Round2Settings",
    "mod_arm",
    "plan",
    "run",
    "write_report",
]
