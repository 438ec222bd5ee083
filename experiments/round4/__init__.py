"""Study round 4 (`mod study experiments/round4 --workers 2`): the largest budget (1024 tokens,
1.5e14 training FLOPs) against a bracketed dense baseline, and the MoD variants that could win
there. README.md has the question, the rule and the answer; `plan` the runs, `report` the
report."""

from __future__ import annotations

from pathlib import Path

from mixture_of_depths.studies.profiles import long_context_profile
from mixture_of_depths.studies.rounds import Round
from mixture_of_depths.studies.runner import Folders

from . import plan, report

STUDY = Round(
    name="round 4",
    folders=Folders(str(Path(__file__).resolve().parent)),
    settings=lambda quick: plan.QUICK if quick else plan.FULL,
    plan=lambda s, results: plan.plan(s, results),
    report=lambda results, out, s: report.write_report(results, out, s),
    profile=lambda spec, s, folder, data: long_context_profile(spec, s.grid, folder, data),
)
