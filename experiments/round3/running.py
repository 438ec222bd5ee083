"""Running the third round: `rounds.run` with round 3's settings, plan and report, and what it
measures of each trained model before its folder is deleted (`profile`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mixture_of_depths.studies import rounds
from mixture_of_depths.studies.profiles import long_context_profile
from mixture_of_depths.studies.runner import RunSpec

from .planning import FOLDERS, FULL, QUICK, Round3Settings, plan
from .report import write_report


def profile(spec: RunSpec, s: Round3Settings, folder: Path, data: str | None) -> dict[str, Any]:
    """The held-out loss by place in the context, on every validation window the run used; for a
    MoD model, its causal thresholds calibrated; how far back its attention looks; and a copy
    of the model, kept beside the work folder (``<work>-kept/<name>``) for decode timings at a
    quiet moment (`profiles.long_context_profile`)."""
    return long_context_profile(spec, s.grid, folder, data)


# Each looks its parts up here when called, so that tests can replace them in this module.
ROUND3 = rounds.Round(
    name="round 3",
    folders=FOLDERS,
    settings=lambda quick: QUICK if quick else FULL,
    plan=lambda s, results: plan(s, results),
    report=lambda results, out, s: write_report(results, out, s),
    profile=lambda spec, s, folder, data: profile(spec, s, folder, data),
)


def run(
    out: str | Path | None = None,
    work: str | Path | None = None,
    quick: bool = False,
    data: str | None = None,
    progress: bool = True,
    max_runs: int | None = None,
    worker: int | None = None,
    poll_s: float = 10.0,
) -> list[dict[str, Any]]:
    """Run (or resume) the third round (`rounds.run`): one process, or one of several at once
    (`mod study experiments/round3 --workers N`)."""
    return rounds.run(ROUND3, out, work, quick, data, progress, max_runs, worker, poll_s)
