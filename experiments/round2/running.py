"""Running the second round: `rounds.run` with round 2's settings, plan and report, and what
it measures of each trained model (`profile`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mixture_of_depths.studies import rounds
from mixture_of_depths.studies.profiles import position_profile
from mixture_of_depths.studies.runner import RunSpec

from .planning import FOLDERS, FULL, QUICK, Round2Settings, plan
from .profiles import routing_profile
from .report import write_report


def profile(spec: RunSpec, s: Round2Settings, folder: Path, data: str | None) -> dict[str, Any]:
    """What a round-2 row holds of its trained model: the ablations' routing profile, and every
    run's held-out loss by place in the context (so that a grid row reusing it, a twin, has one
    too)."""
    row: dict[str, Any] = {}
    if spec.group == "ablation" and spec.model.get("layer_pattern", "D") != "D":
        row["profile"] = routing_profile(folder / "checkpoint", data, s.profile_rows)
    batch = s.grid.batch_size if spec.batch_size is None else spec.batch_size
    seq_len = s.grid.seq_len if spec.seq_len is None else spec.seq_len
    row["loss_by_position"] = position_profile(
        folder / "checkpoint", data, batch, seq_len, s.grid.eval_batches
    )
    return row


# Each looks its parts up here when called, so that tests can replace them in this module.
ROUND2 = rounds.Round(
    name="round 2",
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
    """Run (or resume) the second round (`rounds.run`): one process, or one of several at once
    (`mod study experiments/round2 --workers N`)."""
    return rounds.run(ROUND2, out, work, quick, data, progress, max_runs, worker, poll_s)
