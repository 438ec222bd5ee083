"""The third round's report: the deciding table (every arm against dense, with its seeds, the
share of round 2's gap it closes, its copy score, its late-context loss and its gates), the
per-run table, and the plots (copy score against tokens seen, loss by place, gates)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from mixture_of_depths.fileio import atomic_write_text, json_text
from mixture_of_depths.studies.plots import pyplot
from mixture_of_depths.studies.verdict import Arm, Verdict, compare

from .followup import follow_up_table
from .mechanism import DENSE_LABEL, MOD_LABEL, late_fall, mechanism
from .planning import ARMS, Round3Settings, own_rows, plan
from .verdicts import RATE, Grids, keyed, pick


def by_arm(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The rows of each arm, in the order of `ARMS` (arms with no row yet left out)."""
    out: dict[str, list[dict[str, Any]]] = {}
    results = own_rows(results)
    for arm in ARMS:
        rows = sorted((r for r in results if r["label"] == arm.label), key=lambda r: r["seed"])
        if rows:
            out[arm.label] = rows
    return out


def late_loss(row: dict[str, Any]) -> float | None:
    """The mean held-out loss over the last bucket of places (the second half of the context)."""
    prof = row.get("loss_by_position")
    return prof["loss"][-1] if prof else None


def evaluations(out: Path, name: str) -> list[dict[str, Any]]:
    """The evaluation records of run `name`'s metrics (its copy, in ``<out>/metrics``)."""
    path = out / "metrics" / f"{name}.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "val_loss_topk" in r]


def last_gate(out: Path, row: dict[str, Any]) -> float | None:
    """The median gate on chosen tokens of the first routed layer at the last evaluation."""
    evals = evaluations(out, row["name"])
    diag = evals[-1].get("routing_diag") if evals else None
    if not diag:
        return None
    return next(iter(diag.values())).get("gate_chosen_p50")


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def _f(v: float | None, fmt: str) -> str:
    return "" if v is None else format(v, fmt)


def arm_summary(out: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """An arm's numbers over its seeds."""
    losses = [r["val_loss_causal"] for r in rows]
    return {
        "seeds": len(rows),
        "losses": losses,
        "by_seed": {r["seed"]: r["val_loss_causal"] for r in rows},
        "loss": statistics.fmean(losses),
        "spread": max(losses) - min(losses),
        "copy_score": _mean([r.get("copy_probe", {}).get("score") for r in rows]),
        "late_loss": _mean([late_loss(r) for r in rows]),
        "late_fall": _mean([late_fall(r) for r in rows]),
        "gate_p50": _mean([last_gate(out, r) for r in rows]),
        "reach": reach_summary(rows),
        "tokens": statistics.fmean(r["tokens"] for r in rows),
        "calibrated": _calibrated(rows),
    }


def reach_summary(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """Per attention call ("L<layer>", "r" for a routed one, ".<n>" for a later application of
    the same layer), the share of attention weight 32 or more places back (`probes.
    attention_reach`), mean over the seeds that measured it; None where none did."""
    per: dict[str, list[float]] = {}
    for r in rows:
        for call in r.get("attention_reach") or []:
            if call["far_share"] is None:
                continue
            name = f"L{call['layer']}{'r' if call['routed'] else ''}"
            name += f".{call['call']}" if call["call"] else ""
            per.setdefault(name, []).append(call["far_share"])
    return {k: statistics.fmean(v) for k, v in per.items()} or None


def _calibrated(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """Mean over seeds and routers of the causal take-rate before and after `mod calibrate`,
    and the causal loss before and after (held-out half of the validation windows)."""
    cals = [r["calibration"] for r in rows if r.get("calibration")]
    if not cals:
        return None

    def mean_take(side: str) -> float:
        return statistics.fmean(v for c in cals for v in c[side]["take_rate"].values())

    return {
        "take_before": mean_take("before"),
        "take_after": mean_take("after"),
        "loss_before": statistics.fmean(c["before"]["val_loss_causal"] for c in cals),
        "loss_after": statistics.fmean(c["after"]["val_loss_causal"] for c in cals),
    }


def common_seeds(*arms: dict[str, Any]) -> tuple[list[int], list[float]] | None:
    """The seeds every one of `arms` trained, and each arm's mean loss over them (a seed fixes
    the data order and the initial weights: an arm with one seed is judged on that seed, not
    against the others' means over seeds it did not train); None without a common seed."""
    seeds = sorted(set.intersection(*(set(a.get("by_seed", {})) for a in arms)))
    if not seeds:
        return None
    return seeds, [statistics.fmean(a["by_seed"][s] for s in seeds) for a in arms]


def gap_closed(arm: dict[str, Any], mod: dict[str, Any], dense: dict[str, Any]) -> float | None:
    """The share of MoD's gap to dense that `arm` closes, on the seeds all three trained
    (`common_seeds`); None without a common seed or a gap."""
    common = common_seeds(mod, dense, arm)
    if common is None:
        return None
    m, d, x = common[1]
    return (m - x) / (m - d) if m > d else None


def deciding_table(out: Path, results: list[dict[str, Any]]) -> tuple[list[str], dict]:
    """The table of arms against dense, and the numbers behind it (for findings.json)."""
    arms = {label: arm_summary(out, rows) for label, rows in by_arm(results).items()}
    dense, mod = arms.get(DENSE_LABEL), arms.get(MOD_LABEL)
    lines = [
        "| arm | seeds | causal loss (each seed) | mean | spread | vs dense, same seeds | "
        "gap closed, same seeds | copy score | loss, 2nd half of context | "
        "gate p50 (1st routed layer) | attention >= 32 back, per layer | tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, a in arms.items():
        vs = closed = None
        if dense:  # on the seeds both trained, as the gap (`gap_closed`)
            x, d = (common_seeds(a, dense) or ([], [a["loss"], dense["loss"]]))[1]
            vs = x / d - 1
        if dense and mod and label not in (DENSE_LABEL, MOD_LABEL) and not _is_dense(label):
            closed = gap_closed(a, mod, dense)  # a dense arm closes no gap: it moves one end
        a.update(vs_dense=vs, gap_closed=closed)
        if closed is not None:  # how many seeds the share stands on: those all three trained
            a["gap_seeds"] = len((common_seeds(a, mod, dense) or ([], []))[0])
        each = ", ".join(f"{v:.4f}" for v in a["losses"])
        lines.append(
            f"| {label} | {a['seeds']} | {each} | {a['loss']:.4f} | {a['spread']:.3f} | "
            f"{_f(vs, '+.1%')} | {_f(closed, '.0%')} | {_f(a['copy_score'], '+.3f')} | "
            f"{_f(a['late_loss'], '.4f')} | {_f(a['gate_p50'], '.3f')} | {_reach_text(a)} | "
            f"{a['tokens'] / 1e6:.1f}M |"
        )
    return lines, arms


def _seeds_text(n: int) -> str:
    return "the seed" if n == 1 else f"the {n} seeds"


def _reach_text(a: dict[str, Any]) -> str:
    return " ".join(f"{k} {v:.2f}" for k, v in (a.get("reach") or {}).items())


# Runs share 2 CPU cores with another study and are paused for checks: their clocks are no
# speed figure, and the table must not read as one.
_THROUGHPUT_NOTE = (
    "Train tok/s is each run's own wall clock, on CPU cores shared with other runs and with "
    "pauses included: indicative only, not a speed figure (`mod bench` measures speed)."
)


def run_table(out: Path, results: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| run | steps | params | val loss top-k | causal | copy score | loss by place "
        "(buckets) | causal take-rate | train tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: r["name"]):
        prof = r.get("loss_by_position")
        places = " / ".join(f"{v:.2f}" for v in prof["loss"]) if prof else ""
        take = ", ".join(f"{v:.1%}" for v in r.get("causal_take_rate", {}).values())
        lines.append(
            f"| {r['name']} | {r['steps']} | {r['params'] / 1e6:.2f}M | {r['val_loss_topk']:.4f} "
            f"| {r['val_loss_causal']:.4f} | {_f(r.get('copy_probe', {}).get('score'), '+.3f')} "
            f"| {places} | {take} | {r['tokens_per_s']:,.0f} |"
        )
    return lines


def write_report(results: list[dict[str, Any]], out: Path, s: Round3Settings) -> None:
    """report.md, findings.json and round3.png in `out`, from the results so far."""
    out.mkdir(parents=True, exist_ok=True)
    table, arms = deciding_table(out, results)
    verdicts: dict[str, Verdict] = {}  # every section adds its own, in the report's order
    pending = [sp.name for sp in plan(s, results) if sp.name not in {r["name"] for r in results}]
    reading = _reading(arms, results, s, verdicts)
    lines = [*_intro(s), "## The deciding table", "", *table, "", *reading, ""]
    lines += mechanism(arms, verdicts)
    lines += follow_up_table(results, s, verdicts)
    notes = out / "notes.md"
    if notes.exists():
        lines += [notes.read_text().strip(), ""]
    lines += ["## Every run", "", _THROUGHPUT_NOTE, "", *run_table(out, results), ""]
    lines += [f"{len(results)} runs done, {len(pending)} planned still to run."]
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    findings = {**arms, "verdicts": keyed(verdicts)}
    atomic_write_text(out / "findings.json", json_text(findings, indent=1) + "\n")
    if results:
        try:
            plot(results, out)
        except Exception as exc:  # a plot is a convenience: the results are saved
            print(f"note: round 3 plots failed: {exc!r}")


def _intro(s: Round3Settings) -> list[str]:
    g = s.grid
    return [
        "# Round 3: why MoD stops learning where dense learns to look back",
        "",
        f"Context {g.seq_len} tokens, batch {g.batch_size}, BPE (vocabulary 4096), "
        f"{s.budget:.1e} training FLOPs per run: where round 2 measured its largest difference "
        f"between MoD and dense (dense {s.dense_size} against MoD {s.mod_size}, +15.2%). Each "
        f"run evaluates {s.evaluations} times on {g.eval_batches * g.batch_size} windows, with "
        "the copy probe (loss on the second copy of a repeated random sequence against the "
        "first; `mixture_of_depths.probes`) and the gates of the routed layers. MoD arms: round "
        "2's (the predictor, a 10% capacity warm-up) and one change each. Losses are validation "
        "nats per token, MoD's in causal routing. Generated by `mod study experiments/round3` "
        "(`--report` rewrites this file, findings.json and the plots from results.jsonl); "
        "plots: `round3.png`.",
        "",
    ]


_HOW = (
    "Every comparison below is a verdict of the verdict module "
    '(`mixture_of_depths.studies.verdict`; docs/study.md, "How a verdict is read"): the '
    "difference on each seed both arms trained and their mean, held against the larger seed "
    "spread (the range over an arm's seeds), with what each arm's grids say of it "
    "(`experiments/round3/verdicts.py`): the sizes tried for its configuration at its rate "
    "and budget, and the learning rates tried for it (dense XS and every MoD arm here were "
    "trained at one size)."
)


def _reading(
    arms: dict[str, dict[str, Any]],
    results: list[dict[str, Any]],
    s: Round3Settings,
    verdicts: dict[str, Verdict],
) -> list[str]:
    """The gap, each arm against dense, the learning rates and the routed blocks' worth: the
    numbers and their verdicts (added to `verdicts`; the words are the verdict module's)."""
    if DENSE_LABEL not in arms or MOD_LABEL not in arms:
        return ["The reference pair is not in yet."]
    grids, rows = Grids(results, s), by_arm(results)

    def arm(label: str) -> Arm:
        return grids.arm_of_rows(rows[label], s, label)

    gap = arms[MOD_LABEL]["loss"] - arms[DENSE_LABEL]["loss"]
    mod = verdicts["mod-vs-dense"] = compare(arm(MOD_LABEL), arm(DENSE_LABEL))
    lines = [
        f"Round 2's gap, rerun: MoD {arms[MOD_LABEL]['loss']:.4f} against dense "
        f"{arms[DENSE_LABEL]['loss']:.4f} ({gap:+.4f} nats; seed spreads "
        f"{arms[MOD_LABEL]['spread']:.3f} and {arms[DENSE_LABEL]['spread']:.3f}).",
        "",
        _HOW,
        "",
        f"- {mod.text()}",
    ]
    for label, a in arms.items():
        if a.get("gap_closed") is not None:
            v = verdicts[f"{_tag(label)}-vs-dense"] = compare(arm(label), arm(DENSE_LABEL))
            lines.append(
                f"- {label}: closes {a['gap_closed']:.0%} of the gap on "
                f"{_seeds_text(a['gap_seeds'])} it shares with MoD and dense; {v.text()}"
            )
    lines += learning_rates(grids, rows, s, verdicts)
    bare = next((a.label for a in ARMS if a.arch == "bare" and a.label in arms), None)
    if bare is not None:
        v = verdicts["mod-vs-bare"] = compare(arm(MOD_LABEL), arm(bare))
        lines.append(
            f"- the routed blocks' worth, MoD S against its dense layers alone: {v.text()}"
        )
    for a in (a for a in ARMS if "capacity" in a.over and a.label in arms):
        v = verdicts[f"{a.tag}-vs-mod"] = compare(arm(a.label), arm(MOD_LABEL))
        lines.append(f"- a capacity of {a.over['capacity']:.0%} against 12.5%: {v.text()}")
    return lines + _calibration(arms)


def _calibration(arms: dict[str, dict[str, Any]]) -> list[str]:
    cal = [(label, a["calibrated"]) for label, a in arms.items() if a.get("calibrated")]
    if not cal:
        return []
    lines = [
        "",
        "Calibrated causal thresholds (`mod calibrate`; fitted on half the validation "
        "windows, measured on the other half; mean over routers and seeds):",
        "",
        "| arm | causal take-rate before | after | causal loss before | after |",
        "|---|---|---|---|---|",
    ]
    for label, c in cal:
        lines.append(
            f"| {label} | {c['take_before']:.1%} | {c['take_after']:.1%} | "
            f"{c['loss_before']:.4f} | {c['loss_after']:.4f} |"
        )
    return lines


def _is_dense(label: str) -> bool:
    return any(a.arch == "dense" for a in ARMS if a.label == label)


def _tag(label: str) -> str:
    return next(a.tag for a in ARMS if a.label == label)


def learning_rates(
    grids: Grids,
    rows: dict[str, list[dict[str, Any]]],
    s: Round3Settings,
    verdicts: dict[str, Verdict],
) -> list[str]:
    """Each configuration the plan tries at several learning rates: the rates tried, the best
    by `best_of`, each other rate against round 2's (a verdict); then every MoD variant with lr
    arms in the plan at its best rate against dense at its best, whether round 2 (and the
    variants at 2e-3) compared untuned arms. Empty until an lr arm has a row."""
    if not any(a.lr is not None and a.label in rows for a in ARMS):
        return []
    lines: list[str] = []
    for ref in (a for a in ARMS if a.lr is None and a.label in rows):
        others = [a for a in ARMS if a.lr is not None and (a.arch, a.over) == (ref.arch, ref.over)]
        if not any(a.label in rows for a in others):
            continue
        lines.append(f"- {ref.label}, the learning rates tried: "
                     f"{pick(grids.rates(ref.tag, s.budget), *RATE)}")  # fmt: skip
        for a in (a for a in others if a.label in rows):
            v = verdicts[f"{a.tag}-vs-{ref.tag}"] = compare(
                grids.arm_of_rows(rows[a.label], s, a.label),
                grids.arm_of_rows(rows[ref.label], s, ref.label),
            )
            lines.append(f"  - {v.text()}")
    dense = grids.best(ARMS[0].tag, s.budget) if ARMS[0].label in rows else None
    for ref in ARMS:  # each MoD variant at the round's rate for which the plan tries others
        tuned = [a for a in ARMS if a.lr is not None and a.arch == "MoD" and a.over == ref.over]
        if ref.arch != "MoD" or ref.lr is not None or not tuned or ref.label not in rows:
            continue
        if dense is None:
            continue
        best = grids.best(ref.tag, s.budget)
        v = verdicts[f"{ref.tag}-vs-dense-best-rates"] = compare(
            grids.arm(best, grids.labels[best]), grids.arm(dense, grids.labels[dense])
        )
        lines.append(f"- each at its best learning rate of those tried: {v.text()}")
    return lines


def plot(results: list[dict[str, Any]], out: Path) -> None:
    """round3.png: copy score against tokens seen, loss by place, gate p50 against tokens, and
    how far back each layer's attention looks."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(22, 5.6))
    # more arms than colors: past the tenth, the colors come back dashed, so no two arms look alike
    styles = {a.label: dict(color=f"C{i % 10}", ls="-" if i < 10 else "--")
              for i, a in enumerate(ARMS)}  # fmt: skip
    calls: list[str] = []  # the attention calls of the deepest model, for the last panel's ticks
    for label, rows in by_arm(results).items():
        for j, r in enumerate(rows):
            evals = evaluations(out, r["name"])
            tokens = [e["step"] * r["batch_size"] * r["seq_len"] / 1e6 for e in evals]
            kw = dict(**styles[label], alpha=1.0 if j == 0 else 0.35, lw=1.2)
            kw["label"] = label if j == 0 else None
            copy = [e.get("copy_probe", {}).get("score") for e in evals]
            axes[0].plot(tokens, copy, marker="o", ms=2.5, **kw)
            gates = [next(iter(e["routing_diag"].values()))["gate_chosen_p50"]
                     for e in evals if e.get("routing_diag")]  # fmt: skip
            if gates:
                axes[2].plot(tokens[-len(gates) :], gates, marker="o", ms=2.5, **kw)
        _loss_by_place(axes[1], label, rows, styles[label])
        reach = reach_summary(rows)
        if reach:
            axes[3].plot(range(len(reach)), list(reach.values()), marker="o", ms=3,
                         **styles[label], label=label)  # fmt: skip
            calls = max(calls, list(reach), key=len)
    axes[3].set_xticks(range(len(calls)), calls, fontsize=7)
    axes[0].set(xlabel="tokens seen (M)", ylabel="copy score (nats)", title="in-context copying")
    axes[1].set(xscale="log", xlabel="place in the context", ylabel="held-out loss (nats)",
                title="loss by place (mean over seeds)")  # fmt: skip
    axes[2].set(xlabel="tokens seen (M)", ylabel="gate on chosen tokens, median",
                title="first routed layer's gate")  # fmt: skip
    axes[3].set(xlabel="attention call (r: routed)", ylabel="share of attention >= 32 back",
                title="how far back attention looks (mean over seeds)")  # fmt: skip
    for ax in axes:
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    tmp = out / ".round3.png.tmp"
    fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    tmp.replace(out / "round3.png")


def _loss_by_place(ax: Any, label: str, rows: list[dict[str, Any]], style: dict[str, Any]) -> None:
    profs = [r["loss_by_position"] for r in rows if r.get("loss_by_position")]
    if not profs:
        return
    edges = profs[0]["edges"]
    mids = [max(1, (a + b) / 2) for a, b in zip(edges, edges[1:], strict=False)]
    mean = [statistics.fmean(p["loss"][i] for p in profs) for i in range(len(mids))]
    ax.plot(mids, mean, marker="o", ms=3, **style, label=label)
