"""Every verdict the second round's report and its diagnosis (``notes.md``) word, through the
verdict module (`mixture_of_depths.studies.verdict`): the ablations against their reference,
the pairs the diagnosis compares, the grid's best sizes per budget and context (round 1's
`findings`), size for size, and the claim about scale that cannot be tested here. `verdicts`
gathers them by key; `fill` writes them into the diagnosis's quotes
(``<!-- verdict round2:KEY -->...<!-- /verdict -->``, as `experiments.quotes` does for docs/)."""

from __future__ import annotations

import re
from typing import Any

from mixture_of_depths.studies.runner import budget_tag
from mixture_of_depths.studies.verdict import Arm, Verdict, best_of, compare

from ..isoflop.study import DENSE_RATE, is_dense, judge, size_grid
from ..quotes import QUOTE
from .planning import LEARNED, Round2Settings, mod_arm, winner

# The pairs the diagnosis (notes.md) compares beyond each table's reference row: (a, b) by the
# tags of their run names, a judged against b.
ABLATION_PAIRS = (
    ("rand", "pred"), ("rand", "aux001"), ("aux", "rand"), ("rand-rates", "rand"),
    ("pred-warm", "rand"), ("pred", "aux001"), ("pred-st", "pred"), ("bare", "pred-warm"),
    ("pred-warm", "dense"),
)  # fmt: skip
LONGER_PAIRS = (("pred-warm", "rand"), ("bare", "pred-warm"))
# The paper's "random routing is drastically worse" (arXiv:2404.02258), against the longer runs
RANDOM = (
    "the paper's 'drastically worse' is at budgets five orders of magnitude larger, where the "
    "routed blocks are worth routing to; here their worth is itself unsettled "
    "(round2:long-bare-vs-pred-warm)"
)
SCALE = (
    "budgets past 1.5e14 training FLOPs were not run: 2 CPU cores, five orders of magnitude "
    "below the paper's; a GPU run at 1e16-3e16 FLOPs would read 75-230M tokens of this "
    "9.2M-token corpus"
)


def tag_of(r: dict[str, Any]) -> str:
    """A round-2 ablation or longer run's variant, from its name: "abl-pred-warm-s1" ->
    "pred-warm"."""
    return r["name"].split("-", 1)[1].rsplit("-s", 1)[0]


def _arms(rows: list[dict[str, Any]], size: str) -> dict[str, Arm]:
    """One arm per variant of a group, all trained at the ablation size (one size tried); a
    dense arm's learning rate is not bracketed."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(tag_of(r), []).append(r)
    one_size = best_of([(size, {0: 0.0})])[1]  # "one size tried (S)"
    return {
        tag: Arm(
            f"{runs[0]['label']} ({budget_tag(runs[0]['budget'])})",
            {r["seed"]: r["val_loss_causal"] for r in runs},
            edge=one_size,
            unbracketed=DENSE_RATE if is_dense(runs[0]) else None,
        )
        for tag, runs in by.items()
    }


def group_verdicts(
    results: list[dict[str, Any]], group: str, s: Round2Settings
) -> dict[str, Verdict]:
    """A group's verdicts ("ablation": ``abl-<tag>`` against aux loss 0.1, the round-1 default;
    "longer": ``long-<tag>`` against dense), then its pairs (``abl-<a>-vs-<b>``); of the longer
    runs, the paper's claim about random routing (``random-drastically-worse``), not testable
    here."""
    arms = _arms([r for r in results if r["group"] == group], s.grid.ablation_size)
    prefix, ref = ("abl", LEARNED[0][1]) if group == "ablation" else ("long", "dense")
    out = {}
    if ref in arms:
        out = {f"{prefix}-{t}": compare(a, arms[ref]) for t, a in arms.items() if t != ref}
    for a, b in ABLATION_PAIRS if group == "ablation" else LONGER_PAIRS:
        if a in arms and b in arms:
            out[f"{prefix}-{a}-vs-{b}"] = compare(arms[a], arms[b])
    if group == "longer" and "rand" in arms and "pred-warm" in arms:
        out["random-drastically-worse"] = compare(arms["rand"], arms["pred-warm"], RANDOM)
    return out


def choice_verdicts(results: list[dict[str, Any]], s: Round2Settings) -> dict[str, Verdict]:
    """The choices the plan made by the lowest mean: the winning learned router against the
    next (``winner``), and the MoD arm's capacity warm-up against none (``mod-arm``)."""
    arms = _arms([r for r in results if r["group"] == "ablation"], s.grid.ablation_size)
    out = {}
    win = winner(results)
    if win is not None:
        mean = {t: arms[t].mean for _, t, _ in LEARNED if t in arms}
        runner_up = min((t for t in mean if t != win[1]), key=mean.__getitem__)
        out["winner"] = compare(arms[win[1]], arms[runner_up])
        if mod_arm(results) is not None and f"{win[1]}-warm" in arms:
            out["mod-arm"] = compare(arms[f"{win[1]}-warm"], arms[win[1]])
    return out


def grid_rows(results: list[dict[str, Any]], seq_len: int) -> list[dict[str, Any]]:
    """One context's grid runs (both seeds)."""
    return [r for r in results if r["group"] in ("isoflop", "seed") and r["seq_len"] == seq_len]


def size_verdicts(rows: list[dict[str, Any]], seq_len: int) -> dict[str, Verdict]:
    """Size for size (one context's grid): MoD against the dense model of its size at each
    budget, ``ctx<seq_len>-<budget>-size-<size>``. The size is fixed by the pairing, not
    chosen from a grid, so no arm has an edge."""
    out = {}
    for budget in sorted({r["budget"] for r in rows}):
        at = [r for r in rows if r["budget"] == budget]
        dense = dict(size_grid([r for r in at if is_dense(r)], "val_loss_causal"))
        mod = dict(size_grid([r for r in at if not is_dense(r)], "val_loss_causal"))
        for size in (s for s in mod if s in dense):
            d = Arm(f"dense {size}", dense[size], unbracketed=DENSE_RATE)
            key = f"ctx{seq_len}-{budget_tag(budget)}-size-{size}"
            out[key] = compare(Arm(f"MoD {size}", mod[size]), d)
    return out


def grid_verdicts(results: list[dict[str, Any]], s: Round2Settings) -> dict[str, Verdict]:
    """Per context: round 1's verdicts of the best sizes (``ctx<n>-mod-vs-dense-<budget>``,
    ``ctx<n>-matching-<budget>``), size for size, and the claim about scale past the largest
    budget (``advantage-grows-with-scale``), not testable here."""
    out: dict[str, Verdict] = {}
    for seq_len, _ in s.contexts:
        rows = grid_rows(results, seq_len)
        if not rows:
            continue
        out.update({f"ctx{seq_len}-{k}": v for k, v in judge(rows)[1].items()})
        out.update(size_verdicts(rows, seq_len))
    return {**out, **_scale_verdict(results, s)}


def _scale_verdict(results: list[dict[str, Any]], s: Round2Settings) -> dict[str, Verdict]:
    """MoD against dense past the largest budget of the longest context, not testable here; its
    arms carry that budget's best sizes' seeds, the nearest numbers to the claim. {} until both
    architectures have run there."""
    longest = s.contexts[-1][0]
    rows = grid_rows(results, longest)
    if not rows:
        return {}
    top = max(r["budget"] for r in rows)
    last = judge([r for r in rows if r["budget"] == top])[1]
    v = last.get(f"mod-vs-dense-{budget_tag(top)}")
    if v is None:
        return {}
    past = f"past {budget_tag(top)} FLOPs (nearest run: "
    a = Arm(f"MoD {past}{v.a.label}, {longest} tokens)", v.a.seeds)
    b = Arm(f"dense {past}{v.b.label}, {longest} tokens)", v.b.seeds)
    return {"advantage-grows-with-scale": compare(a, b, untestable=SCALE)}


def verdicts(results: list[dict[str, Any]], s: Round2Settings) -> dict[str, Verdict]:
    """Every verdict of the round by key."""
    out = {**group_verdicts(results, "ablation", s), **group_verdicts(results, "longer", s)}
    return {**out, **choice_verdicts(results, s), **grid_verdicts(results, s)}


def fill(text: str, found: dict[str, str], study: str = "round2") -> str:
    """`text` with each quote of one of `study`'s verdicts rewritten from `found` (key ->
    text); a quote of a verdict not in `found` is an error, not a stale quote."""

    def one(m: re.Match[str]) -> str:
        if m.group(1) != study:
            return m.group(0)
        if m.group(2) not in found:
            raise KeyError(f"notes quote {study}:{m.group(2)}, a verdict the round does not have")
        return f"<!-- verdict {study}:{m.group(2)} -->{found[m.group(2)]}<!-- /verdict -->"

    return QUOTE.sub(one, text)
