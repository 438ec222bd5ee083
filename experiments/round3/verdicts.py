"""Round 3's comparisons as verdicts of the one verdict module (`mixture_of_depths.studies.
verdict`; docs/study.md, "How a verdict is read"): the report words none of its own.

Every run is a point of two grids: the sizes tried for its configuration at its learning rate
and budget, and the learning rates tried for it at that budget (each rate at its best size). An
arm's `edge` is what `best_of` says of the first grid and its `unbracketed` what it says of the
second, so that no verdict names a winner whose optimum, or whose baseline's, was not measured:
a configuration trained at one size is "one size tried", at one rate "one rate tried". Dense XS
was trained at one size at 1.5e14 and its best rate, 4e-3, is the highest of the three tried:
every verdict against it says both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mixture_of_depths.studies.verdict import Arm, Verdict, best_of

from . import planning
from .planning import Round3Settings

# The peak learning rate of every arm without one of its own (their rows name none: the
# default when they trained), pinned so that a later default does not rewrite the report.
BASE_LR: float = 2e-3
RATE = ("rate", ("lowest", "highest"))  # `best_of`'s words for a learning-rate grid


def rate_text(lr: float) -> str:
    """A learning rate as the arms' labels write it: 0.004 -> "4e-3"."""
    mantissa, exp = f"{lr:.6e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exp)}"


@dataclass(frozen=True)
class Point:
    """Where a run sits in the grids: its configuration (`family`: the tag of the arm at round
    2's rate, "dense", "mod", "mlp", ...), learning rate, budget and size."""

    family: str
    lr: float
    budget: float
    size: str


def arm_of_row(row: dict[str, Any]) -> planning.Arm:
    """The arm a row was planned from: by its run's name (`planning.arm_of_run`), or, for a run
    named otherwise (the GPU plan's ``gpu-r3-...``), by its label."""
    try:
        return planning.arm_of_run(row["name"])
    except ValueError:
        arm = planning.arm_of(row)
        if arm is None:
            raise
        return arm


def family_of(arm: planning.Arm) -> str:
    """The tag of `arm`'s configuration at round 2's rate (an lr arm is a point of its grid)."""
    same = (a for a in planning.ARMS if (a.arch, a.over, a.lr) == (arm.arch, arm.over, None))
    return next((a.tag for a in same), arm.tag)


def point_of(row: dict[str, Any], s: Round3Settings) -> Point:
    """A row's point: an isoFLOP run names its size (`planning.iso_spec`), the round's own runs
    are dense at `s.dense_size` and the rest at `s.mod_size`."""
    arm = arm_of_row(row)
    if row["name"].startswith("r3-iso-"):
        size = row["name"].split("-")[-2]
    else:
        size = s.dense_size if arm.arch == "dense" else s.mod_size
    return Point(family_of(arm), arm.lr or BASE_LR, row["budget"], size)


def tag_of(point: Point) -> str:
    """The tag of the arm at `point`'s configuration and rate ("dense-lr4e-3")."""
    for a in planning.ARMS:
        if family_of(a) == point.family and (a.lr or BASE_LR) == point.lr:
            return a.tag
    return f"{point.family}-lr{rate_text(point.lr)}"


def shared_seeds(grid: list[tuple[Any, Mapping[int, float]]]) -> list[int]:
    """The seeds every point of `grid` trained (what `best_of` compares them on)."""
    return sorted(set.intersection(*(set(seeds) for _, seeds in grid))) if grid else []


class Grids:
    """Every run's causal loss by point and seed, and the size and rate grids `best_of` reads.
    A reused run (an isoFLOP point that is the round's own run) is the same point and seed, so
    it counts once."""

    def __init__(self, results: list[dict[str, Any]], s: Round3Settings) -> None:
        self.order = [name for name, _ in s.grid.sizes]
        self.seeds: dict[Point, dict[int, float]] = {}
        self.labels: dict[Point, str] = {}  # the round's own label where it has one
        for r in sorted(results, key=lambda r: r.get("group") != "round3"):
            point = point_of(r, s)
            self.seeds.setdefault(point, {})[r["seed"]] = r["val_loss_causal"]
            self.labels.setdefault(point, r["label"])

    def sizes(self, family: str, lr: float, budget: float) -> list[tuple[str, dict[int, float]]]:
        """The sizes tried for `family` at `lr` and `budget`, smallest first, with their seeds."""
        at = {p.size: v for p, v in self.seeds.items() if (p.family, p.lr, p.budget) == (
            family, lr, budget)}  # fmt: skip
        return [(z, at[z]) for z in sorted(at, key=self._rank)]

    def _rank(self, size: str) -> int:
        return self.order.index(size) if size in self.order else len(self.order)

    def rates(self, family: str, budget: float) -> list[tuple[str, dict[int, float]]]:
        """The rates tried for `family` at `budget`, lowest first ("4e-3"), each with the seeds
        of its best size."""
        lrs = sorted({p.lr for p in self.seeds if (p.family, p.budget) == (family, budget)})
        grid = []
        for lr in lrs:
            size = best_of(self.sizes(family, lr, budget))[0]
            grid.append((rate_text(lr), self.seeds[Point(family, lr, budget, size)]))
        return grid

    def best(self, family: str, budget: float) -> Point:
        """`family`'s best point at `budget`: its best rate (each at its best size), then the
        best size at that rate."""
        text = best_of(self.rates(family, budget), *RATE)[0]
        lr = next(p.lr for p in self.seeds if p.family == family and rate_text(p.lr) == text)
        return Point(family, lr, budget, best_of(self.sizes(family, lr, budget))[0])

    def arm(self, point: Point, label: str, seeds: Mapping[int, float] | None = None) -> Arm:
        """The `Arm` of `point` (its own seeds unless given), with what its grids say of it."""
        return Arm(
            label,
            dict(seeds if seeds is not None else self.seeds[point]),
            edge=best_of(self.sizes(point.family, point.lr, point.budget))[1],
            unbracketed=best_of(self.rates(point.family, point.budget), *RATE)[1],
        )

    def arm_of_rows(self, rows: list[dict[str, Any]], s: Round3Settings, label: str) -> Arm:
        """The `Arm` of the run rows of one label (one point)."""
        return self.arm(
            point_of(rows[0], s), label, {r["seed"]: r["val_loss_causal"] for r in rows}
        )


def keyed(verdicts: Mapping[str, Verdict]) -> dict[str, dict[str, Any]]:
    """findings.json's "verdicts": each verdict's numbers and words (`Verdict.as_dict`)."""
    return {key: v.as_dict() for key, v in verdicts.items()}


def pick(grid: list[tuple[Any, dict[int, float]]], what: str, ends: tuple[str, str]) -> str:
    """What `best_of` says of `grid`, and the seeds it compared the points on."""
    top, why = best_of(grid, what, ends)
    if len(grid) == 1:
        return str(why)
    tried = ", ".join(str(v) for v, _ in grid)
    said = why or f"its best {what}, {top}, is interior to those tried ({tried})"
    seeds = shared_seeds(grid)
    if not seeds:
        return f"{said}, by each {what}'s own mean (no seed every {what} trained)"
    many = len(seeds) > 1
    on = f"seed{'s' * many} {', '.join(map(str, seeds))}"
    return f"{said}, on {on}, {'those' if many else 'the one'} every {what} trained"
