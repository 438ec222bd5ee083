"""Round 4's report, every verdict through the harness's verdict module: dense bracketed in rate
and size, each MoD family at its best against it with its costs, whether MoD pays here by the
rule written before the first run (README.md), the look-back probe and decode timings per arm
(``probes.jsonl``, ``decode.jsonl``: measured on the kept checkpoints once training is done),
the loss by place, and every arm and run."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from mixture_of_depths.config import MoDConfig
from mixture_of_depths.fileio import atomic_write_text, json_text
from mixture_of_depths.flops import estimate_flops
from mixture_of_depths.studies.runner import load_results
from mixture_of_depths.studies.verdict import BETTER, WITHIN, Arm, Verdict, best_of, compare

from ..common.measure import DECODE_NEW, DECODE_ROUNDS
from . import plan as p
from .plots import plot

ROUND3_METRICS = Path(__file__).resolve().parents[1] / "round3" / "metrics"

MOD_FAMILIES = ("joint", "mlp", "mlp-all", "mlp-kv")
RATE_ENDS = ("lowest", "highest")


def arms_of(rows: list[dict[str, Any]]) -> list[p.Arm]:
    """The arms of `rows`, by family, size and rate."""
    arms = {a for r in rows if (a := p.arm_key(r)) is not None}
    return sorted(arms, key=lambda a: (a.family, p.ORDER.index(a.size), a.lr, a.lr_warmup or 0))


def rate_name(arm: p.Arm) -> str:
    warm = "" if arm.lr_warmup is None else f" (warm-up {arm.lr_warmup:.0%})"
    return p.rate_tag(arm.lr) + warm


def rate_grid(rows: list[dict[str, Any]], family: str, size: str) -> list[p.Arm]:
    """`family`'s rates tried at `size`, lowest first (a longer warm-up after the plain one)."""
    return [a for a in arms_of(rows) if a.family == family and a.size == size]


def size_grid(rows: list[dict[str, Any]], like: p.Arm) -> list[p.Arm]:
    """The sizes tried at `like`'s family, rate and warm-up, smallest first."""
    return [a for a in arms_of(rows) if (a.family, a.lr, a.lr_warmup) ==
            (like.family, like.lr, like.lr_warmup)]  # fmt: skip


def optimum(rows: list[dict[str, Any]], family: str, size: str) -> tuple[p.Arm, Arm] | None:
    """`family` at its best rate (at `size`), then its best size at that rate: the arm, and
    it as the verdict module's `Arm` with its open ends named."""
    rates = rate_grid(rows, family, size)
    if not rates:
        return None
    # One point per learning rate (its best warm-up), so that a longer warm-up at the top rate
    # is still the top of the grid: the edge is a matter of the rate, not of the warm-up.
    by_lr: dict[float, list[p.Arm]] = {}
    for a in rates:
        by_lr.setdefault(a.lr, []).append(a)
    points = {}
    for lr, arms in by_lr.items():
        warm, _ = best_of([(rate_name(a), p.seeds_of(rows, a)) for a in arms], "warm-up")
        points[lr] = next(a for a in arms if rate_name(a) == warm)
    grid = [(rate_name(a), p.seeds_of(rows, a)) for _, a in sorted(points.items())]
    best_rate, open_rate = best_of(grid, "rate", RATE_ENDS)
    at_rate = next(a for a in rates if rate_name(a) == best_rate)
    sizes = size_grid(rows, at_rate)
    best_size, edge = best_of([(a.size, p.seeds_of(rows, a)) for a in sizes])
    best = next(a for a in sizes if a.size == best_size)
    where = f"{p.FAMILIES[family][1]}, {best.size}, lr {rate_name(best)}"
    return best, Arm(where, p.seeds_of(rows, best), edge=edge, unbracketed=open_rate)


def kept_run(rows: list[dict[str, Any]], arm: p.Arm) -> str | None:
    """The run of this round whose model is `arm`'s seed 0 (kept for the probes and decode
    timings: its own run, or a rerun of round 3's), None while there is none."""
    return next((r["name"] for r in rows if r["name"].startswith("r4-") and r["seed"] == 0
                 and p.arm_key(r) == arm), None)  # fmt: skip


def cost(rows: list[dict[str, Any]], arm: p.Arm, s: p.Settings) -> dict[str, float]:
    """Forward FLOPs per token in training's top-k routing (a training step spends three
    times that) and KV bytes per token of context (bf16) of `arm`'s model (as its rows built
    it, vocabulary and all), by `estimate_flops` at the round's context and batch."""
    row = next(r for r in rows if p.arm_key(r) == arm)
    cfg = MoDConfig(**row["model"])
    rep = estimate_flops(cfg, s.grid.seq_len, s.grid.batch_size, with_dense=False)
    return {
        "forward_flops_per_token": rep.forward_per_token,
        "kv_bytes_per_token": rep.kv_bytes_per_token,
    }


def measured(out: Path, name: str) -> dict[str, dict[str, Any]]:
    """Rows of ``<out>/<name>`` (probes.jsonl, decode.jsonl) by run name."""
    return {r["name"]: r for r in load_results(out / name)}


def pays(verdicts: dict[str, Verdict], costs: dict[str, dict[str, float]],
         decode: dict[str, dict[str, Any]]) -> list[str]:  # fmt: skip
    """The rule's reading (README.md): a family pays where its verdict is better; it is level at
    lower cost where it is within the spread and cheaper in training FLOPs, KV bytes and
    measured decode speed than dense."""
    out = []
    dense = costs["dense"]
    for family, v in verdicts.items():
        c = costs[family]
        cheaper = c["forward_flops_per_token"] < dense["forward_flops_per_token"] and (
            c["kv_bytes_per_token"] < dense["kv_bytes_per_token"]
        )
        got = decode.get(family, {})
        # faster only where faster on its own text and on held-out text alike
        speed = min(got["speedup_b1"], got["fed_speedup_b1"]) if got else None
        if v.word == BETTER:
            out.append(f"{v.a.label}: pays ({v.word}).")
        elif v.word == WITHIN and cheaper and speed is not None and speed > 1:
            out.append(f"{v.a.label}: {v.word}, at lower training FLOPs, KV bytes and decode "
                       f"time ({speed:.2f}x dense at batch 1): level at lower cost.")  # fmt: skip
        elif v.word == WITHIN and cheaper:
            out.append(f"{v.a.label}: {v.word} and cheaper by the FLOP count; its decode "
                       "speed is not measured yet, so the rule does not call it level at lower "
                       "cost.")  # fmt: skip
        else:
            out.append(f"{v.a.label}: does not pay here ({v.word}).")
    return out


def deciding(rows: list[dict[str, Any]], s: p.Settings, out: Path) -> tuple[list[str], dict]:
    """The deciding section: dense's optimum, each family at its best against it, the rule."""
    found = optimum(rows, "dense", "XS")
    if found is None:
        return ["No dense row yet."], {}
    dense_arm, dense = found
    costs = {"dense": cost(rows, dense_arm, s)}
    decode = measured(out, "decode.jsonl")
    lines = [
        f"Dense's optimum: {dense.label} ({len(dense.seeds)} seed"
        f"{'' if len(dense.seeds) == 1 else 's'}, mean {dense.mean:.4f}); "
        f"rate: {dense.unbracketed or 'interior'}; size: {dense.edge or 'interior'}.",
        "",
        "| family at its best | seeds | causal loss (each seed) | mean | against dense | "
        "forward FLOPs / token | KV bytes / token | decode x dense, b1 / b8: greedy; text |",
        "|---|---|---|---|---|---|---|---|",
    ]
    verdicts: dict[str, Verdict] = {}
    best_arms: dict[str, str | None] = {"dense": kept_run(rows, dense_arm)}
    for family in MOD_FAMILIES:
        found = optimum(rows, family, "S")
        if found is None:
            continue
        arm, a = found
        v = compare(a, dense)
        verdicts[family] = v
        costs[family] = cost(rows, arm, s)
        best_arms[family] = kept_run(rows, arm)
        speeds = decode.get(family, {})
        dec = f"{_ratios(speeds)}; {_ratios(speeds, 'fed_')}" if speeds else ""
        lines.append(
            f"| {a.label} | {len(a.seeds)} | {', '.join(f'{x:.4f}' for x in a.seeds.values())} "
            f"| {a.mean:.4f} | {v.word}: {v.numbers()} | "
            f"{costs[family]['forward_flops_per_token'] / 1e6:.2f}M | "
            f"{costs[family]['kv_bytes_per_token']:.0f} | {dec} |"
        )
    lines.append(
        f"| {dense.label} | {len(dense.seeds)} | "
        f"{', '.join(f'{x:.4f}' for x in dense.seeds.values())} | {dense.mean:.4f} | | "
        f"{costs['dense']['forward_flops_per_token'] / 1e6:.2f}M | "
        f"{costs['dense']['kv_bytes_per_token']:.0f} | 1.00 / 1.00; 1.00 / 1.00 |"
    )
    lines += ["", *(f"- {v.text()}" for v in verdicts.values())]
    lines += [
        "",
        "By the rule (README.md):",
        "",
        *(f"- {t}" for t in pays(verdicts, costs, decode)),
    ]
    found = {"dense": {"label": dense.label, "mean": dense.mean, "edge": dense.edge,
                       "unbracketed": dense.unbracketed},
             "costs": costs, "best_runs": best_arms}  # fmt: skip
    return lines, {"verdicts": {f"{f}-vs-dense": v for f, v in verdicts.items()}, **found}


def grid_lines(rows: list[dict[str, Any]]) -> tuple[list[str], dict[str, Verdict]]:
    """Dense's rates at XS and sizes at its best rate, each point against the optimum."""
    found = optimum(rows, "dense", "XS")
    if found is None:
        return [], {}
    best, opt = found
    lines, verdicts = [], {}
    for arm in rate_grid(rows, "dense", "XS") + size_grid(rows, best):
        if arm == best:
            continue
        key = f"dense-{arm.size}-lr{p.rate_tag(arm.lr)}"
        v = compare(Arm(f"dense {arm.size}, lr {rate_name(arm)}", p.seeds_of(rows, arm)), opt)
        verdicts[key] = v
        lines.append(f"- {v.text()}")
    return lines, verdicts


def arm_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| arm | seeds | causal loss (each seed) | mean | range |", "|---|---|---|---|---|"]
    for arm in arms_of(rows):
        by_seed = p.seeds_of(rows, arm)
        vals = [by_seed[k] for k in sorted(by_seed)]
        rng = f"{max(vals) - min(vals):.3f}" if len(vals) > 1 else ""
        lines.append(f"| {arm.label} | {len(vals)} | {', '.join(f'{v:.4f}' for v in vals)} | "
                     f"{statistics.fmean(vals):.4f} | {rng} |")  # fmt: skip
    return lines


def probe_table(rows: list[dict[str, Any]], out: Path) -> list[str]:
    """The look-back probes (``probes.jsonl``) of one kept model per arm (its lowest seed
    probed), by arm, and the arms of this round with no model probed yet."""
    probes = measured(out, "probes.jsonl")
    by_name = {r["name"]: r for r in rows}
    chosen: dict[Any, dict[str, Any]] = {}
    for name in sorted(n for n in probes if n in by_name):
        row = by_name[name]
        key = p.arm_key(row) or name.rsplit("-s", 1)[0]  # round 3's mechanism arms: by name
        if key not in chosen or row["seed"] < chosen[key]["seed"]:
            chosen[key] = row
    unprobed = [a.label for a in arms_of(rows) if kept_run(rows, a) and a not in chosen]
    if not chosen:
        lines = ["Not measured yet: `python -m experiments.round4.measure` once training is done."]
    else:
        named = [r["name"] for r in sorted(chosen.values(), key=_arm_order)]
        dists = sorted({int(d) for n in named for d in probes[n]["repeat"]})
        head = " | ".join([f"repeat {d}" for d in dists] + [f"recall {d}" for d in dists])
        lines = [f"| arm | run | {head} |", "|---|---|" + "---|" * (2 * len(dists))]
        for name in named:
            r, arm = probes[name], p.arm_key(by_name[name])
            cells = [f"{r['repeat'][str(d)]['score']:+.3f}" for d in dists]
            cells += [f"{r['recall'][str(d)]['score']:+.3f}" for d in dists]
            lines.append(f"| {arm.label if arm else name} | {name} | {' | '.join(cells)} |")
    if unprobed:
        lines += ["", "Not probed yet (the kept model went with an earlier machine, or the "
                  "probe has not run yet): " + "; ".join(unprobed) + "."]  # fmt: skip
    return lines


def decode_table(out: Path) -> list[str]:
    """Each family's best model decoded beside dense's (``decode.jsonl``), on its own greedy text
    and fed held-out text (``fed_``): tokens/s and their spread over the rounds, the ratio to
    dense, the KV bytes its cache held and the share of tokens each routed layer took at batch
    8 (the speed follows it)."""
    decode = measured(out, "decode.jsonl")
    if not decode:
        return ["Not measured yet: `python -m experiments.round4.measure` once training is done."]
    lines = ["| family | run | tokens/s b1 / b8, greedy (spread) | text (spread) | "
             "x dense b1 / b8, greedy | text | KV bytes / token held | "
             "taken per routed layer, greedy | text |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for fam in sorted(decode, key=lambda f: (f != "dense", f)):
        r = decode[fam]
        cells = [fam, r["run"]]
        for pre in ("", "fed_"):
            speeds = [f"{r[f'{pre}decode_tok_s_b{b}']:.0f} ({r[f'{pre}decode_spread_b{b}']:.0%})"
                      for b in (1, 8)]  # fmt: skip
            cells.append(" / ".join(speeds))
        cells += [_ratios(r, pre) for pre in ("", "fed_")]
        cells.append(f"{r['kv_bytes_per_token_measured']:.0f}")
        cells += [", ".join(f"{t:.1%}" for t in r[f"{pre}take_b8"]) or "-" for pre in ("", "fed_")]
        lines.append("| " + " | ".join(cells) + " |")
    busy = max(
        (r.get(k, 0.0) for r in decode.values() for k in ("others_busy", "fed_others_busy")),
        default=0.0,
    )
    lines += ["", f"Other processes kept up to {busy:.0%} of the CPUs busy during the timings."]
    return lines


def _ratios(row: dict[str, Any], pre: str = "") -> str:
    return f"{row[f'{pre}speedup_b1']:.2f} / {row[f'{pre}speedup_b8']:.2f}"


def _arm_order(row: dict[str, Any]) -> tuple[Any, ...]:
    arm = p.arm_key(row)
    if arm is None:  # round 3's mechanism arms, after the families
        return (1, row["name"])
    return (0, arm.family, p.ORDER.index(arm.size), arm.lr, arm.lr_warmup or 0)


def spread_lines(rows: list[dict[str, Any]]) -> list[str]:
    """How far seeds fall apart at each size (arms with two seeds or more): the spread the
    verdicts weigh a difference against is a property of the size as much as of the arm."""
    ranges: dict[str, list[float]] = {}
    for arm in arms_of(rows):
        vals = list(p.seeds_of(rows, arm).values())
        if len(vals) > 1:
            ranges.setdefault(arm.size, []).append(max(vals) - min(vals))
    lines = ["| size | arms with 2+ seeds | range of an arm's seeds: median | largest |",
             "|---|---|---|---|"]  # fmt: skip
    for size in sorted(ranges, key=p.ORDER.index):
        got = ranges[size]
        lines.append(f"| {size} | {len(got)} | {statistics.median(got):.3f} | {max(got):.3f} |")
    return lines


def rerun_table(results: list[dict[str, Any]], s: p.Settings, out: Path) -> list[str]:
    """Round 3's runs trained again (the same spec, seed 0) beside round 3's own loss, and the
    first logged step whose training loss differs: on one thread a run repeats itself under the
    code that trained it, so a difference says the code changed what it trains, or only its
    float rounding (README.md); a rounding difference can still end far apart."""
    old = {r["name"]: r for r in p.anchors(s)}
    lines = ["| run | round 3's causal loss | again | difference | first step apart |",
             "|---|---|---|---|---|"]  # fmt: skip
    gaps = []
    for r in (r for r in results if r.get("group") == "rerun"):
        name = "r3-" + r["name"].removeprefix("r4-rerun-")
        before = old.get(name)
        if before is not None:
            a, b = before["val_loss_causal"], r["val_loss_causal"]
            gaps.append(abs(b - a))
            apart = first_apart(
                ROUND3_METRICS / f"{name}.jsonl", out / "metrics" / f"{r['name']}.jsonl"
            )
            lines.append(f"| {r['name']} | {a:.4f} | {b:.4f} | {b - a:+.4f} | {apart} |")
    if not gaps:
        return ["None trained yet."]
    if max(gaps) >= 1e-4:
        lines += ["", f"The largest difference, {max(gaps):.3f} nats, is a run that parted "
                  "from its first training by a rounding-sized step in one loss (first step "
                  "apart): how far one run can land from itself here; weigh it beside the seed "
                  "ranges the verdicts use (Seed spread by size)."]  # fmt: skip
    return lines


def first_apart(first: Path, again: Path) -> str:
    """The first step both metrics logs hold whose training loss differs, and by how much of it
    ("none": the same at every step both hold; "-": a log is missing)."""
    if not (first.exists() and again.exists()):
        return "-"
    a, b = ({m["step"]: m["loss"] for m in load_results(f) if "loss" in m} for f in (first, again))
    t = next((t for t in sorted(a.keys() & b.keys()) if a[t] != b[t]), None)
    return "none" if t is None else f"{t} (by {abs(a[t] - b[t]) / abs(a[t]):.0e} of it)"


def run_table(results: list[dict[str, Any]]) -> list[str]:
    lines = ["| run | causal loss | steps | tokens | minutes |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['name']} | {r['val_loss_causal']:.4f} | {r['steps']} | "
                     f"{r['tokens'] / 1e6:.1f}M | {r['wall_s'] / 60:.0f} |")  # fmt: skip
    return lines


def write_report(results: list[dict[str, Any]], out: Path, s: p.Settings) -> None:
    rows = p.anchors(s) + results
    decide, found = deciding(rows, s, out)
    grid, grid_verdicts = grid_lines(rows)
    verdicts = {**found.pop("verdicts", {}), **grid_verdicts}
    lines = [
        "# Study round 4: the largest budget against a bracketed dense baseline",
        "",
        f"{s.grid.seq_len} tokens of context, {s.budget:.1e} training FLOPs, BPE. Round 3's rows "
        "at this budget (`anchors.jsonl`) are read beside this round's; every verdict is the "
        "verdict module's (docs/study.md), by the rule README.md states. Generated by "
        "`mod study experiments/round4` (`--report` to rewrite it from the results).",
        "",
        "## The deciding table",
        "",
        *decide,
        "",
        "## Decode",
        "",
        f"One thread, a held-out prompt of half the window, then {DECODE_NEW} decode steps, "
        f"every model once per round in a rotating order, the median of {DECODE_ROUNDS} rounds "
        "(spread: interquartile range over the median); KV bytes as bf16. Each model decodes "
        "twice: greedy (each step fed its own argmax) and fed the held-out text that follows "
        "the prompt (the same work per step). A routed layer's take-rate is its causal "
        "router's on what it is fed: a small model's greedy text repeats itself, its routers "
        "can take far fewer of those tokens than the capacity (12.5%), and a faster greedy "
        "decode is then fewer tokens taking the layer, not a faster one; the text column is "
        "what a decode at the capacity costs.",
        "",
        *decode_table(out),
        "",
        "## Dense, bracketed",
        "",
        *(grid or ["No dense grid yet."]),
        "",
        "## Look-back, measured directly (one model per arm: its lowest seed probed)",
        "",
        "Scores in nats (README.md, lookback.py): `repeat d`, a span of the text seen again d "
        "places later (its loss where the first occurrence was other text, less its loss where "
        "it was seen); `recall d`, a key-value pair recalled d places later (loss against a "
        "control that never saw the value). A model that does not look back d places scores "
        "~0.",
        "",
        *probe_table(rows, out),
        "",
        "## Seed spread by size",
        "",
        "The verdicts weigh a difference against the larger of the two arms' seed ranges (in "
        "nats); here is how wide those ranges run at each size.",
        "",
        *spread_lines(rows),
        "",
        "## Round 3's runs again",
        "",
        *rerun_table(results, s, out),
        "",
        "## Every arm",
        "",
        *arm_table(rows),
        "",
        "## This round's runs",
        "",
        *run_table(results),
    ]
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    findings = {**found, "verdicts": {k: v.as_dict() for k, v in verdicts.items()}}
    atomic_write_text(out / "findings.json", json_text(findings) + "\n")
    if rows:
        plot(rows, out / "round4.png")
