"""The one place where a study's numbers become a verdict (docs/study.md, "How a verdict is
read"): every report words its comparisons through `compare`, none by itself.

An `Arm` is one configuration's result per seed (a loss: lower is better) and what is known of
the grid it was chosen from: whether its best size sits at an edge of the sizes tried (`edge`),
and whether a hyperparameter tuned for it has its best value at the end of its range
(`unbracketed`). `compare(a, b)` judges `a` against the baseline `b` and says exactly one of
`WORDS`, with the paired difference on every seed both trained beside the means:

1. not testable here: the claim needs hardware or a scale we do not have (the caller says why);
2. one seed (a reading): fewer than two seeds that both arms trained;
3. within the spread: the mean paired difference is no larger than the seed spread (the largest
   range, max - min, of either arm's seeds);
4. baseline not bracketed: beyond the spread, but an arm's tuned hyperparameter has its best
   value at the end of the range tried, so a better value may lie outside it;
5. at the grid's edge (not measured): beyond the spread, but an arm's best size is at an edge
   of the sizes tried (or only one was tried), so its optimum was not measured;
6. better / worse: beyond the spread, two or more shared seeds, both optima interior.

`best_of` picks a grid's best point and says whether it sits at an edge, in the words the
verdicts quote.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

BETTER = "better"
WORSE = "worse"
WITHIN = "within the spread"
UNBRACKETED = "baseline not bracketed"
EDGE = "at the grid's edge (not measured)"
ONE_SEED = "one seed (a reading)"
UNTESTABLE = "not testable here"
WORDS = (BETTER, WORSE, WITHIN, UNBRACKETED, EDGE, ONE_SEED, UNTESTABLE)


@dataclass(frozen=True)
class Arm:
    """One configuration's loss per seed, and what its grid says of it: `edge`, why its best
    size is not interior (None: it is); `unbracketed`, which tuned value sits at the end of its
    range (None: every one is interior)."""

    label: str
    seeds: Mapping[int, float]
    edge: str | None = None
    unbracketed: str | None = None

    def __post_init__(self) -> None:
        if not self.seeds:
            raise ValueError(f"arm {self.label!r} has no seed: a verdict needs a result")

    @property
    def mean(self) -> float:
        return statistics.fmean(self.seeds.values())

    @property
    def range(self) -> float:
        """max - min over its seeds (0 for one seed)."""
        return max(self.seeds.values()) - min(self.seeds.values())


@dataclass(frozen=True)
class Verdict:
    """`a` against the baseline `b`: the `word` (one of `WORDS`), the difference of the means
    over the shared seeds (`diff`, negative where `a` is lower), each shared seed's difference
    (`paired`), the seed spread it was held against, why the word was chosen, and caveats that
    do not change it."""

    word: str
    a: Arm
    b: Arm
    diff: float | None
    paired: dict[int, float]
    spread: float
    why: str
    caveats: tuple[str, ...] = field(default=())

    def numbers(self) -> str:
        """The mean difference and its pairs: "+0.0816 nats (seeds 0, 1, 2: +0.054, +0.170,
        +0.021)"."""
        if self.diff is None:
            return "no shared seed"
        seeds = ", ".join(str(s) for s in self.paired)
        pairs = ", ".join(f"{d:+.3f}" for d in self.paired.values())
        one = len(self.paired) == 1
        return f"{self.diff:+.4f} nats ({'seed' if one else 'seeds'} {seeds}: {pairs})"

    def text(self) -> str:
        """The verdict as a report quotes it, e.g. "MoD S against dense XS: +0.0816 nats (seeds
        0, 1, 2: +0.054, +0.170, +0.021), within the spread (0.185)"."""
        if self.word == UNTESTABLE:
            return f"{self.a.label} against {self.b.label}: {UNTESTABLE} ({self.why})"
        extra = "".join(f"; {c}" for c in self.caveats)
        head = f"{self.a.label} against {self.b.label}: {self.numbers()}"
        return f"{head}, {self.word} ({self.why}{extra})"

    def as_dict(self) -> dict[str, Any]:
        """For a findings file: every number behind the words."""
        return {
            "a": self.a.label, "b": self.b.label, "verdict": self.word, "diff": self.diff,
            "paired": {str(k): v for k, v in self.paired.items()}, "spread": self.spread,
            "why": self.why, "caveats": list(self.caveats), "text": self.text(),
        }  # fmt: skip


def compare(a: Arm, b: Arm, untestable: str | None = None) -> Verdict:
    """`a` against the baseline `b` by the rules of this module's docstring (in that order).
    `untestable`: why the claim cannot be tested here (then nothing else is judged)."""
    shared = sorted(set(a.seeds) & set(b.seeds))
    paired = {s: a.seeds[s] - b.seeds[s] for s in shared}
    diff = statistics.fmean(paired.values()) if paired else None
    spread = max(a.range, b.range)

    def verdict(word: str, why: str, caveats: tuple[str, ...] = ()) -> Verdict:
        return Verdict(word, a, b, diff, paired, spread, why, caveats)

    if untestable is not None:
        return verdict(UNTESTABLE, untestable)
    if len(shared) < 2:
        got = f"{len(shared)} shared seed" + ("" if len(shared) == 1 else "s")
        return verdict(ONE_SEED, got)
    assert diff is not None
    open_ends = [f"{arm.label}: {arm.unbracketed}" for arm in (b, a) if arm.unbracketed]
    edges = [f"{arm.label}: {arm.edge}" for arm in (b, a) if arm.edge]
    if abs(diff) <= spread:
        return verdict(WITHIN, f"spread {spread:.3f}", tuple(open_ends + edges))
    beyond = f"beyond the spread {spread:.3f}"
    if open_ends:
        return verdict(UNBRACKETED, f"{beyond}, but " + "; ".join(open_ends), tuple(edges))
    if edges:
        return verdict(EDGE, f"{beyond}, but " + "; ".join(edges))
    return verdict(BETTER if diff < 0 else WORSE, beyond)


def best_of(
    grid: Sequence[tuple[Any, Mapping[int, float]]],
    what: str = "size",
    ends: tuple[str, str] = ("smallest", "largest"),
) -> tuple[Any, str | None]:
    """The best point of a grid (its points in order, each a value and its loss per seed) by
    the mean over the seeds every point trained (each point's own mean where they share none),
    and why it is not interior: None, or e.g. "its best size, XS, is the smallest tried (XS, S,
    M)" or "one size tried (S)". `what` names a point; `ends` the grid's two ends in words."""
    if not grid:
        raise ValueError("best_of: an empty grid has no best point")
    shared = set.intersection(*(set(seeds) for _, seeds in grid))

    def mean(seeds: Mapping[int, float]) -> float:
        return statistics.fmean(seeds[k] for k in (shared or seeds.keys()))

    values = [v for v, _ in grid]
    best = min(range(len(grid)), key=lambda i: mean(grid[i][1]))
    if len(grid) == 1:
        return values[0], f"one {what} tried ({values[0]})"
    if best in (0, len(grid) - 1):
        end = ends[0] if best == 0 else ends[1]
        tried = ", ".join(str(v) for v in values)
        return values[best], f"its best {what}, {values[best]}, is the {end} tried ({tried})"
    return values[best], None
