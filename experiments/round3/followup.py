"""The report's isoFLOP section: the variant the plan followed up (`planning.follow_up`) at round
2's 1024-token budgets beside dense and round 2's MoD arm, each side at its best rate and size
(`verdicts.Grids`, by `best_of`) and judged by the verdict module."""

from __future__ import annotations

import statistics
from collections.abc import MutableMapping
from typing import Any

from mixture_of_depths.studies.runner import budget_tag
from mixture_of_depths.studies.verdict import Verdict, best_of, compare

from .mechanism import DENSE_LABEL, MOD_LABEL
from .planning import ARMS, FULL, Round3Settings, arm_of_run, best_dense, over_text, own_rows
from .verdicts import (
    BASE_LR,
    RATE,
    Grids,
    Point,
    family_of,
    pick,
    point_of,
    rate_text,
    tag_of,
)

INTRO = (
    "The variant the plan followed up (`planning.winner`: the first MoD variant whose mean came "
    "within dense's seed spread of dense's, or below it, on two seeds or more; the plan's rule "
    "for what to train next, not a verdict), at several sizes and at both of round 2's larger "
    "budgets, beside dense and round 2's MoD arm (rerun here at 5e13 with this round's "
    "evaluation, dense at round 2's learning rate and at the rate with the lowest mean on the "
    "seeds it trained, `planning.best_dense`; at 1.5e14 the round's dense XS and MoD S arms). "
    "Each side is taken at its best rate and size by `best_of` (on the seeds every point of "
    "its grid trained; `experiments/round3/verdicts.py`) and judged by the verdict module."
)


def side_of(row: dict[str, Any]) -> str:
    """Which side of the isoFLOP points a row is on: dense, round 2's MoD arm (joint routing),
    or the variant followed up ("winner", the plan's word); known by its run's arm
    (`planning.arm_of_run`: a reused twin keeps its own)."""
    arm = arm_of_run(row["name"])
    if arm.arch == "dense":
        return "dense"
    return "joint" if arm is ARMS[1] else "winner"


def _twin_seeds(here: list[dict[str, Any]], results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A point the round had trained (the winner at its own size and budget) is planned with
    the points' two seeds and reused (``same_run_as``); the round's arm has every seed it
    trained: those it lacks, under the point's label, so a verdict uses them all."""
    by_name = {r["name"]: r for r in results}
    twins = {r["label"]: by_name[r["same_run_as"]]["label"] for r in here
             if r.get("same_run_as") in by_name}  # fmt: skip
    seen = {(r["label"], r["seed"]) for r in here}
    return [{**r, "label": point} for point, arm in twins.items() for r in own_rows(results)
            if r["label"] == arm and (point, r["seed"]) not in seen]  # fmt: skip


def arm_summary_losses(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Seeds, losses, their mean and range, of one group of rows."""
    losses = [r["val_loss_causal"] for r in sorted(rows, key=lambda r: r["seed"])]
    return {"seeds": len(losses), "losses": losses, "loss": statistics.fmean(losses),
            "spread": max(losses) - min(losses)}  # fmt: skip


def follow_up_table(
    results: list[dict[str, Any]],
    s: Round3Settings = FULL,
    verdicts: MutableMapping[str, Verdict] | None = None,
) -> list[str]:
    """Per budget, every size of each side with its seeds; then each side's best and the
    verdicts between them (added to `verdicts` under "iso-<budget>-..." keys)."""
    rows = [r for r in results if r["name"].startswith("r3-iso-")]
    if not rows:
        return []
    grids = Grids(results, s)
    verdicts = {} if verdicts is None else verdicts
    lines = [
        "## The followed-up variant at round 2's 1024-token isoFLOP points",
        "",
        INTRO,
        "",
        "| budget | model, size | seeds | causal loss (each seed) | mean |",
        "|---|---|---|---|---|",
    ]
    judged: list[str] = []
    for budget in sorted({r["budget"] for r in rows}):
        here = [r for r in rows if r["budget"] == budget]
        if budget == FULL.budget:  # the round's own dense and MoD arms are their points here
            own = {DENSE_LABEL, best_dense(results).label, MOD_LABEL}
            here += [r for r in own_rows(results) if r["label"] in own]
        here += _twin_seeds(here, results)
        groups: dict[str, list[dict[str, Any]]] = {}
        for r in here:
            groups.setdefault(r["label"], []).append(r)
        for label, rs in sorted(groups.items()):
            a = arm_summary_losses(rs)
            each = ", ".join(f"{v:.4f}" for v in a["losses"])
            lines.append(f"| {budget:.1e} | {label} | {a['seeds']} | {each} | {a['loss']:.4f} |")
        judged += _judged(grids, s, budget, groups, verdicts)
    return [*lines, "", *judged, ""]


def _judged(
    grids: Grids,
    s: Round3Settings,
    budget: float,
    groups: dict[str, list[dict[str, Any]]],
    verdicts: MutableMapping[str, Verdict],
) -> list[str]:
    """One budget's bullets: each side's best (`_best_lines`), then the sides against each
    other, and against dense at round 2's rate where that is not dense's best."""
    labels = {point_of(rs[0], s): label for label, rs in groups.items()}
    families: dict[str, str] = {}
    for rs in groups.values():
        families.setdefault(side_of(rs[0]), family_of(arm_of_run(rs[0]["name"])))
    btag, head = budget_tag(budget), f"{budget:.1e}"
    lines, best = [], {}
    for side in ("winner", "dense", "joint"):
        if side in families:
            best[side] = grids.best(families[side], budget)
            lines += _best_lines(grids, budget, families[side], labels, verdicts)
    sides = {"winner": families.get("winner"), "joint": "mod", "dense": "dense-best"}

    def arm(p: Point) -> Any:
        return grids.arm(p, labels.get(p) or grids.labels[p])

    for a, b in (("winner", "dense"), ("joint", "dense"), ("winner", "joint")):
        if a in best and b in best:
            v = verdicts[f"iso-{btag}-{sides[a]}-vs-{sides[b]}"] = compare(
                arm(best[a]), arm(best[b])
            )
            lines.append(f"- {head}, each side at its best: {v.text()}")
    dense_sizes = grids.sizes("dense", BASE_LR, budget)
    if "dense" in best and dense_sizes and best["dense"].lr != BASE_LR:
        base = Point("dense", BASE_LR, budget, best_of(dense_sizes)[0])
        for a in ("winner", "joint"):
            if a in best:
                v = verdicts[f"iso-{btag}-{sides[a]}-vs-dense"] = compare(arm(best[a]), arm(base))
                lines.append(
                    f"- {head}, against dense at round 2's rate ({rate_text(BASE_LR)}, its best "
                    f"size there): {v.text()}"
                )
    return lines


def _best_lines(
    grids: Grids,
    budget: float,
    family: str,
    labels: dict[Point, str],
    verdicts: MutableMapping[str, Verdict],
) -> list[str]:
    """`family`'s best rate at `budget`, and its best size at each rate tried (each other size
    against it: a verdict)."""
    btag, head = budget_tag(budget), f"{budget:.1e}"
    over = over_text(next(a.over for a in ARMS if a.tag == family))
    joint = "round 2's arm"
    name = "dense" if family == "dense" else f"MoD, {over or joint}"
    lines = [f"- {head}, {name}: {pick(grids.rates(family, budget), *RATE)}"]
    for lr in sorted({p.lr for p in grids.seeds if (p.family, p.budget) == (family, budget)}):
        sizes = grids.sizes(family, lr, budget)
        top = best_of(sizes)[0]
        said = [pick(sizes, "size", ("smallest", "largest"))]
        for size, _ in sizes:
            if size != top:
                p, q = (Point(family, lr, budget, z) for z in (size, top))
                v = compare(*(grids.arm(x, labels.get(x) or grids.labels[x]) for x in (p, q)))
                verdicts[f"iso-{btag}-{tag_of(p)}-{size.lower()}-vs-{top.lower()}"] = v
                said.append(v.text())
        lines.append(f"  - at {rate_text(lr)}: " + "; ".join(said))
    return lines
