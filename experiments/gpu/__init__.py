"""The round-3 GPU plan (issue 36, item 6): round 3's deciding arms on one GPU inside a lease.

    mod study experiments/gpu              # into experiments/gpu/, <= 8 min
    mod study experiments/gpu --quick      # --dry-run: every part on the CPU, tiny, < 60 s
    mod study experiments/gpu --report     # the report again from plan.json and the results
    python -m experiments.gpu --minutes 6 --out /tmp/gpu    # (from the repository root)

Dense XS, MoD S (round 2's arm), MoD S with residual KV and with only the MLP routed, three
seeds each; then, if time allows, the straight-through gate (three seeds) and MoD S without its
routed blocks (two), then dense XS at 4e-3 and MoD S at 1e-3 and 4e-3 (two each): round 3's
models at 1024 tokens, in bf16 autocast. The corpus is prepared once (the BPE
tokenizer, the token cache) and a timing pass (~30 s) times every run's model at once, sharing
the GPU as the runs will; from it and the time left comes one training budget for every run,
capped so that no run reads more tokens than the corpus's training split holds (one epoch;
round 2's GPU script would have read 75-230M tokens of a ~9M-token corpus). The runs then train
at once, each in its own process under a hard timeout (a SIGTERM: it stops after its step with a
checkpoint; a SIGKILL after a grace), and append their rows to ``results.jsonl`` in the study's
format, with the copy probe, the loss by place, the device, the dtype and the wall time. A rerun
resumes ``plan.json``: finished runs are skipped, stopped ones continue from their checkpoints.
The report compares the GPU rows only with each other. Without CUDA (and no ``--dry-run``) it
says so and exits 0 with ``{"gpu": false}``; the last line printed is JSON.

`planning`: the arms, the budget arithmetic, the corpus cap (pure functions); `parts`: what each
process does; `running`: the processes, their timeouts, `main`; `report`: report.md.
"""

from __future__ import annotations

import json
from pathlib import Path

from mixture_of_depths.studies.runner import Loop, load_results

from .planning import DRY, FOLDERS, FULL, Choice, GpuSettings, Timing, choose, corpus_budget, specs
from .report import write_report
from .running import main


def _run(out: Path, work: Path, quick: bool, data: str | None, progress: bool) -> int:
    """`main` with `mod study`'s folders: ``--quick`` is the dry run."""
    args = ["--out", str(out), "--work", str(work)] + (["--dry-run"] if quick else [])
    return main(args + ([] if data is None else ["--data", data]))


def _report(out: Path, quick: bool) -> None:
    """`mod study experiments/gpu --report`: the report again from ``plan.json`` and the
    results, training nothing."""
    plan = json.loads((out / "plan.json").read_text())
    write_report(load_results(out / "results.jsonl"), out, plan)


STUDY = Loop("gpu", FOLDERS, _run, _report)

__all__ = [
    "DRY",
    "STUDY",
    "FULL",
    "Choice",
    "GpuSettings",
    "Timing",
    "choose",
    "corpus_budget",
    "main",
    "specs",
]
