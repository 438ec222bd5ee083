"""The GPU plan's report: round 3's deciding table (`round3.report.deciding_table`) over the GPU
rows alone, with the plan that made them; compared only with each other, every comparison a
verdict of the verdict module (`mixture_of_depths.studies.verdict`), each arm's grids read as
round 3 reads them (`experiments/round3/verdicts.py`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from mixture_of_depths.fileio import atomic_write_text, json_text
from mixture_of_depths.studies.verdict import Arm, Verdict, compare

from ..round3 import planning as r3
from ..round3.mechanism import DENSE_LABEL, MOD_LABEL
from ..round3.report import by_arm, deciding_table, learning_rates, run_table
from ..round3.verdicts import Grids, keyed


def write_report(results: list[dict[str, Any]], out: Path, plan: dict[str, Any]) -> None:
    """report.md and findings.json in `out`, from the rows of `plan`'s runs."""
    names = set(plan["runs"])
    rows = [r for r in results if r["name"] in names]
    table, arms = deciding_table(out, rows)
    verdicts: dict[str, Verdict] = {}
    missing = sorted(names - {r["name"] for r in rows})
    lines = [*intro(plan, rows), "## The deciding table", "", *table, ""]
    lines += reading(arms, rows, plan["budget"], verdicts)
    lines += ["## Every run", "", *run_table(out, rows), ""]
    left = f"; not yet: {', '.join(missing)} (rerun the script to resume them)" if missing else ""
    lines.append(f"{len(rows)} of {len(names)} planned runs done{left}.")
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    findings = {**arms, "verdicts": keyed(verdicts)}
    atomic_write_text(out / "findings.json", json_text(findings, indent=1) + "\n")


def intro(plan: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    c = plan["corpus"]
    device = rows[0]["device"] if rows else plan["device"]
    dtype = rows[0]["dtype"] if rows else "bfloat16 autocast"
    limit = {
        "corpus": "the corpus: no run reads more tokens than its training split holds (one "
        "epoch's worth, windows drawn at random; the cheapest run per token, dense XS, reads "
        "nearly all of it)",
        "time": "the time the lease left for training",
        "ceiling": "the dry run's ceiling",
    }[plan["limit"]]
    where = "the one GPU" if device != "cpu" else "the CPU (a dry run)"
    return [
        "# Round 3 on a GPU: the deciding arms",
        "",
        f"From `mod study experiments/gpu` on {device}, {dtype}: round 3's arms "
        f"(`experiments/round3/planning.py`: the same models, evaluations and windows), "
        f"{plan['seq_len']} tokens of context, batch {plan['batch_size']}, "
        f"{len(plan['runs'])} runs at once on {where}, each trained to {plan['budget']:.2g} "
        f"FLOPs (`estimate_flops`, as the CPU study counts them). The budget is set by {limit}. "
        f"The corpus: {c['data']} (Python {c['python']}), {c['train_tokens']:,} BPE training "
        f"tokens, {c['val_tokens']:,} held out.",
        "",
        "**Compared only with each other.** A different device, dtype (bf16 autocast against the "
        "CPU's float32), budget (the CPU round's 1.5e14 has dense XS read "
        f"{plan['cpu_round_epochs']:.1f} epochs of this corpus) and possibly corpus (another "
        "Python's standard library) than the CPU rows in `experiments/round3/`: these numbers "
        "are not comparable with those digit for digit; only the differences between arms "
        "here are.",
        "",
    ]


def reading(
    arms: dict[str, dict[str, Any]],
    rows: list[dict[str, Any]],
    budget: float,
    verdicts: dict[str, Verdict],
) -> list[str]:
    """The gap and each arm's share of it closed, in numbers, and each arm against dense and
    the learning rates as verdicts (added to `verdicts`): measured on this GPU, so testable."""
    if DENSE_LABEL not in arms or MOD_LABEL not in arms:
        return ["The reference pair is not in yet.", ""]
    dense, mod = arms[DENSE_LABEL], arms[MOD_LABEL]
    s = dataclasses.replace(r3.FULL, budget=budget)  # round 3's sizes and arms at this budget
    grids, by = Grids(rows, s), by_arm(rows)

    def arm(label: str) -> Arm:
        return grids.arm_of_rows(by[label], s, label)

    gap = mod["loss"] - dense["loss"]
    v = verdicts["mod-vs-dense"] = compare(arm(MOD_LABEL), arm(DENSE_LABEL))
    lines = [
        f"MoD S against dense XS: {mod['loss']:.4f} against {dense['loss']:.4f} ({gap:+.4f} "
        f"nats, {mod['vs_dense']:+.1%}); seed spreads {mod['spread']:.3f} (MoD, {mod['seeds']} "
        f"seeds) and {dense['spread']:.3f} (dense, {dense['seeds']}).",
        "",
        f"- {v.text()}",
    ]
    for lab, a in arms.items():
        if a.get("gap_closed") is not None:
            tag = next(x.tag for x in r3.ARMS if x.label == lab)
            v = verdicts[f"{tag}-vs-dense"] = compare(arm(lab), arm(DENSE_LABEL))
            lines.append(
                f"- {lab}: closes {a['gap_closed']:.0%} of the gap on the {a['gap_seeds']} "
                f"seed(s) it shares with MoD and dense (its own: {a['loss']:.4f} over "
                f"{a['seeds']} seeds, spread {a['spread']:.3f}); {v.text()}"
            )
    return [*lines, *learning_rates(grids, by, s, verdicts), ""]
