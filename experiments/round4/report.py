"""Round 4's report: every arm (round 3's anchors and this round's runs) with its seeds, and
the runs as they finish. The verdicts come from the harness's verdict module."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from mixture_of_depths.fileio import atomic_write_text

from .plan import Arm, Settings, anchors, arm_key, rate_tag, seeds_of


def arms_of(rows: list[dict[str, Any]]) -> list[Arm]:
    """The arms of `rows`, by family, size and rate."""
    arms = {a for r in rows if (a := arm_key(r)) is not None}
    return sorted(arms, key=lambda a: (a.family, a.size, a.lr, a.lr_warmup or 0.0))


def arm_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| arm | seeds | causal loss (each seed) | mean | range |", "|---|---|---|---|---|"]
    for arm in arms_of(rows):
        by_seed = seeds_of(rows, arm)
        vals = [by_seed[k] for k in sorted(by_seed)]
        rng = max(vals) - min(vals) if len(vals) > 1 else None
        lines.append(
            f"| {arm.label} | {len(vals)} | {', '.join(f'{v:.4f}' for v in vals)} | "
            f"{statistics.fmean(vals):.4f} | {'' if rng is None else f'{rng:.3f}'} |"
        )
    return lines


def write_report(results: list[dict[str, Any]], out: Path, s: Settings) -> None:
    rows = anchors(s) + results
    lines = [
        "# Study round 4: the largest budget against a bracketed dense baseline",
        "",
        f"{s.grid.seq_len} tokens of context, {s.budget:.1e} training FLOPs, BPE; round 3's "
        "rows at this budget are read beside this round's (README.md states the rule that "
        "reads them).",
        "",
        "## Every arm",
        "",
        *arm_table(rows),
        "",
        "## This round's runs",
        "",
        "| run | causal loss | steps | tokens | minutes |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['name']} | {r['val_loss_causal']:.4f} | {r['steps']} | "
                     f"{r['tokens'] / 1e6:.1f}M | {r['wall_s'] / 60:.0f} |")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")


__all__ = ["write_report", "rate_tag"]
