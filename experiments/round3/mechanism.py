"""The round's question answered by rule: why does MoD stop learning where dense learns to look
back? Each hypothesis has the arm that tests it (docs/study.md, "The third round"):

- isolation blocks look-back: routed tokens that read the whole context (residual KV) or
  attention for every token (MLP-only routing) close most of the gap *and* their loss still
  falls past place 32, as dense's does;
- the gates shut the routed blocks: the straight-through gate (which cannot close) closes it;
- the learning rate (round 2 compared untuned arms): MoD at its best learning rate closes it
  against the same dense, or the gap shrinks by `MOST` once both are at their best rates;
- none of these: it is depth (MoD's routed blocks add little to its dense layers).

An arm "closes most of the gap" when it closes at least `MOST` of it on the seeds it shares with
MoD and dense, with at least two of them: one seed decides nothing. That is the round's own
reading rule, set before its runs; every statement of an arm against dense in it is a verdict of
the verdict module (`mixture_of_depths.studies.verdict`), which the report computes and passes
in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mixture_of_depths.studies.verdict import Verdict, best_of

from .planning import ARMS

MOST = 0.5  # the share of round 2's gap an arm must close for its hypothesis to hold
FAR = 32  # "looking back": the loss by place from this place on
DENSE_LABEL, MOD_LABEL = ARMS[0].label, ARMS[1].label


def late_fall(row: dict[str, Any]) -> float | None:
    """How much a run's held-out loss falls from the first bucket of places at or past `FAR`
    to the last bucket (positive: it keeps learning from far context); None without a profile."""
    prof = row.get("loss_by_position")
    if not prof:
        return None
    first = next((i for i, e in enumerate(prof["edges"][:-1]) if e >= FAR), None)
    if first is None or first == len(prof["loss"]) - 1:
        return None
    return prof["loss"][first] - prof["loss"][-1]


def _label(tag: str) -> str:
    return next(a.label for a in ARMS if a.tag == tag)


def _closes(arms: dict[str, dict[str, Any]], label: str) -> tuple[bool | None, str]:
    """Whether `label`'s arm closes most of the gap (None: not enough shared seeds yet), and
    the words with its numbers."""
    a = arms.get(label)
    if a is None or a.get("gap_closed") is None:
        return None, "not trained yet"
    seeds = a.get("gap_seeds", 0)
    text = f"closes {a['gap_closed']:.0%} of the gap ({seeds} seed{'s' * (seeds != 1)})"
    if seeds < 2:
        return None, text + ": one seed decides nothing"
    return a["gap_closed"] >= MOST, text


def _falls(arms: dict[str, dict[str, Any]], label: str) -> tuple[bool | None, str]:
    """Whether `label`'s loss still falls past place `FAR` by at least half of dense's fall."""
    fall, ref = (arms.get(x, {}).get("late_fall") for x in (label, DENSE_LABEL))
    if fall is None or ref is None:
        return None, "no loss by place"
    text = f"its loss falls {fall:.2f} nats from place {FAR} to the end (dense: {ref:.2f})"
    return fall >= ref / 2, text


def _against(judged: Mapping[str, Verdict], key: str) -> str:
    """The verdict under `key` as the report words it ("" where there is none yet)."""
    v = judged.get(key)
    return f"; {v.text()}" if v is not None else ""


def _isolation(
    arms: dict[str, dict[str, Any]], judged: Mapping[str, Verdict]
) -> tuple[bool | None, list[str]]:
    verdicts, words = [], []
    for tag in ("residual", "mlp"):
        label = _label(tag)
        closes, c_text = _closes(arms, label)
        falls, f_text = _falls(arms, label)
        both = None if None in (closes, falls) else bool(closes and falls)
        verdicts.append(both)
        word = {True: "yes", False: "no", None: "undecided"}[both]
        words.append(f"{label}: {word}, {c_text}; {f_text}{_against(judged, f'{tag}-vs-dense')}")
    return _any(verdicts), words


def _learning_rate(
    arms: dict[str, dict[str, Any]], judged: Mapping[str, Verdict]
) -> tuple[bool | None, list[str]]:
    """MoD at its best rate against dense at the round's rate (the gap closed), and both at
    their best rates against the untuned pair (whether tuning shrinks the gap); each best by
    `best_of`, on the seeds every rate trained, as the report's verdicts take it."""
    mods = [a.label for a in ARMS if a.arch == "MoD" and not a.over and a.label in arms]
    denses = [a.label for a in ARMS if a.arch == "dense" and a.label in arms]
    if len(mods) < 2 or len(denses) < 2 or MOD_LABEL not in arms or DENSE_LABEL not in arms:
        return None, ["the learning-rate arms are not trained yet"]
    best_mod = best_of([(x, arms[x]["by_seed"]) for x in mods])[0]
    best_dense = best_of([(x, arms[x]["by_seed"]) for x in denses])[0]
    untuned = arms[MOD_LABEL]["loss"] - arms[DENSE_LABEL]["loss"]
    tuned = arms[best_mod]["loss"] - arms[best_dense]["loss"]
    closes, c_text = (
        _closes(arms, best_mod) if best_mod != MOD_LABEL else (False, "closes 0% of the gap")
    )
    words = [
        f"MoD at its best rate ({best_mod}): {c_text}",
        f"the gap with each at its best rate ({best_mod} against {best_dense}): "
        f"{tuned:+.4f} nats, against {untuned:+.4f} for round 2's untuned pair"
        + _against(judged, "mod-vs-dense-best-rates"),
    ]
    shrinks = tuned <= untuned * (1 - MOST)
    return None if closes is None else bool(closes or shrinks), words


def _any(verdicts: list[bool | None]) -> bool | None:
    if any(v is True for v in verdicts):
        return True
    return None if any(v is None for v in verdicts) else False


def mechanism(
    arms: dict[str, dict[str, Any]], judged: Mapping[str, Verdict] | None = None
) -> list[str]:
    """The report's "What the round says": each hypothesis, whether it holds by the rule above
    and the numbers behind it, then the conclusion. `arms` are the deciding table's summaries
    (with "gap_closed", "gap_seeds" and "late_fall"); `judged`, the report's verdicts by key
    ("<tag>-vs-dense", "mod-vs-dense-best-rates"), quoted beside each arm."""
    if DENSE_LABEL not in arms or MOD_LABEL not in arms:
        return []
    judged = judged or {}
    gates, gate_text = _closes(arms, _label("st"))
    gate_text += _against(judged, "st-vs-dense")
    found = {
        "isolation of the routed layers blocks look-back": _isolation(arms, judged),
        "the gates shut the routed blocks": (gates, [f"{_label('st')}: {gate_text}"]),
        "tuning the learning rate closes the gap": _learning_rate(arms, judged),
    }
    lines = [
        "## What the round says",
        "",
        "By the round's own reading rule, set before its runs (`experiments/round3/"
        f"mechanism.py`): a hypothesis holds where its arm closes at least {MOST:.0%} of round "
        "2's gap on two or more seeds it shares with MoD and dense; the look-back one also "
        f"needs the arm's loss to keep falling past place {FAR} by at least half as much as "
        "dense's. The rule reads shares of the gap, not a verdict of an arm against dense: "
        "those are quoted beside each arm.",
        "",
    ]
    for name, (verdict, words) in found.items():
        word = {True: "holds", False: "does not hold", None: "undecided"}[verdict]
        lines.append(f"- **{name}: {word}.** " + "; ".join(words) + ".")
    held = [name for name, (v, _) in found.items() if v]
    if held:
        conclusion = "; ".join(held)
    elif any(v is None for v, _ in found.values()):
        conclusion = "not decided yet: an arm that tests a hypothesis lacks its seeds"
    else:
        conclusion = "none of the three: it is depth (MoD's routed blocks add little)"
    return [*lines, "", f"Conclusion, by the round's rule: {conclusion}.", ""]
