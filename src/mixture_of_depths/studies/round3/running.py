"""Running the third round: `rounds.run` with round 3's settings, plan and report, and what it
measures of each trained model before its folder is deleted (`profile`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import rounds
from ..round2.profiles import position_profile
from ..runner import RunSpec
from .planning import FOLDERS, FULL, QUICK, Round3Settings, plan
from .report import write_report


def place_edges(seq_len: int) -> list[int]:
    """Edges of the places the loss is profiled over: the first 8 tokens, then doubling
    buckets (8-15, 16-31, ...) up to the end of the context."""
    edges, e = [0], 8
    while e < seq_len:
        edges.append(e)
        e *= 2
    return [*edges, seq_len]


def profile(spec: RunSpec, s: Round3Settings, folder: Path, data: str | None) -> dict[str, Any]:
    """The held-out loss by place in the context, on every validation window the run used."""
    g = s.grid
    seq_len = spec.seq_len or g.seq_len
    return {
        "loss_by_position": position_profile(
            folder / "checkpoint",
            data,
            spec.batch_size or g.batch_size,
            seq_len,
            g.eval_batches,
            edges=place_edges(seq_len),
        )
    }


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
    (`mod study --plan round3 --workers N`)."""
    return rounds.run(ROUND3, out, work, quick, data, progress, max_runs, worker, poll_s)
