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
from mixture_of_depths.train.config import TrainConfig

from .mechanism import DENSE_LABEL, MOD_LABEL, late_fall, mechanism
from .planning import (
    ARMS,
    FULL,
    Round3Settings,
    arm_of_run,
    best_dense,
    over_text,
    own_rows,
    plan,
)

BASE_LR: float = TrainConfig.lr  # the peak learning rate of every arm without one of its own


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
    pending = [sp.name for sp in plan(s, results) if sp.name not in {r["name"] for r in results}]
    lines = [*_intro(s), "## The deciding table", "", *table, "", *_reading(arms), ""]
    lines += mechanism(arms)
    lines += follow_up_table(results)
    notes = out / "notes.md"
    if notes.exists():
        lines += [notes.read_text().strip(), ""]
    lines += ["## Every run", "", _THROUGHPUT_NOTE, "", *run_table(out, results), ""]
    lines += [f"{len(results)} runs done, {len(pending)} planned still to run."]
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    atomic_write_text(out / "findings.json", json_text(arms, indent=1) + "\n")
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
        f"{s.budget:.1e} training FLOPs per run: where round 2 found MoD furthest behind "
        f"(dense {s.dense_size} against MoD {s.mod_size}, +15.2%). Each run evaluates "
        f"{s.evaluations} times on {g.eval_batches * g.batch_size} windows, with the copy probe "
        "(loss on the second copy of a repeated random sequence against the first; "
        "`mixture_of_depths.probes`) and the gates of the routed layers. MoD arms: round 2's "
        "(the predictor, a 10% capacity warm-up) and one change each. Losses are validation "
        "nats per token, MoD's in causal routing. Generated by `mod study experiments/round3`; "
        "plots: `round3.png`.",
        "",
    ]


def _reading(arms: dict[str, dict[str, Any]]) -> list[str]:
    """The hypotheses, each with the number that bears on it (the words are in notes.md)."""
    if DENSE_LABEL not in arms or MOD_LABEL not in arms:
        return ["The reference pair is not in yet."]
    gap = arms[MOD_LABEL]["loss"] - arms[DENSE_LABEL]["loss"]
    lines = [
        f"Round 2's gap, rerun: MoD {arms[MOD_LABEL]['loss']:.4f} against dense "
        f"{arms[DENSE_LABEL]['loss']:.4f} ({gap:+.4f} nats; seed spreads "
        f"{arms[MOD_LABEL]['spread']:.3f} and {arms[DENSE_LABEL]['spread']:.3f}).",
        "",
    ]
    dense = arms[DENSE_LABEL]
    for label, a in arms.items():
        if a.get("gap_closed") is not None:
            lines.append(
                f"- {label}: closes {a['gap_closed']:.0%} of the gap on "
                f"{_seeds_text(a['gap_seeds'])} it shares with MoD and dense; "
                f"against dense: {against(a, dense)}"
            )
    for label, a in arms.items():
        if _is_dense(label) and label != DENSE_LABEL:
            lines.append(f"- {label}: against dense XS at {BASE_LR:g}: {against(a, dense)}")
    lines += learning_rates(arms)
    bare = next((arms[a.label] for a in ARMS if a.arch == "bare" and a.label in arms), None)
    if bare is not None:
        lines.append(
            f"- the routed blocks' worth: MoD S against the same model without them, "
            f"{against(arms[MOD_LABEL], bare)}"
        )
    cal = [(label, a["calibrated"]) for label, a in arms.items() if a.get("calibrated")]
    if cal:
        lines += [
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


def learning_rates(arms: dict[str, dict[str, Any]]) -> list[str]:
    """Each architecture at its best learning rate of those tried (round 2's 2e-3 and the lr
    arms): every MoD variant that has lr arms in the plan against dense's best, whether round 2
    (and the variants at 2e-3) compared untuned arms. Empty until an lr arm has a row."""
    if not any(a.lr is not None and a.label in arms for a in ARMS):
        return []
    best_dense = _best_lr(arms, "dense", {})
    lines = []
    for ref in ARMS:  # each MoD variant at the round's rate for which the plan tries others
        tuned = [a for a in ARMS if a.lr is not None and a.arch == "MoD" and a.over == ref.over]
        if ref.arch != "MoD" or ref.lr is not None or not tuned:
            continue
        best = _best_lr(arms, "MoD", ref.over)
        if best is None or best_dense is None:
            continue
        (d_lr, _, d), (m_lr, n, m) = best_dense, best
        name = "MoD S" if not ref.over else f"MoD S, {over_text(ref.over)}"
        rate = "its best learning rate" if n > 1 else "the only learning rate tried yet"
        lines.append(
            f"- {name} at {rate} ({m_lr:g}) against dense XS at its best ({d_lr:g}): "
            f"{against(m, d)}"
        )
    return lines


def _best_lr(
    arms: dict[str, dict[str, Any]], arch: str, over: dict[str, Any]
) -> tuple[float, int, dict[str, Any]] | None:
    """Among the arms of `arch` with overrides `over` that have rows (the round's rate and the
    lr arms): the learning rate with the lowest mean loss, how many rates have rows, and that
    arm's summary; None when none has a row."""
    tried = [
        (a.lr or BASE_LR, arms[a.label])
        for a in ARMS
        if a.arch == arch and a.over == over and a.label in arms
    ]
    if not tried:
        return None
    lr, best = min(tried, key=lambda t: t[1]["loss"])
    return lr, len(tried), best


def side_of(row: dict[str, Any]) -> str:
    """Which side of the isoFLOP points a row is on: dense, round 2's MoD arm (joint routing),
    or the winner; known by its run's arm (`planning.arm_of_run`: a reused twin keeps its own)."""
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


def follow_up_table(results: list[dict[str, Any]]) -> list[str]:
    """The winner's isoFLOP points beside dense's and round 2's MoD arm's
    (`planning.follow_up`): per budget, every size with its seeds, and the best of each side
    against the others."""
    rows = [r for r in results if r["name"].startswith("r3-iso-")]
    if not rows:
        return []
    lines = [
        "## The winner at round 2's 1024-token isoFLOP points",
        "",
        "The first variant to close the gap with two seeds, at several sizes and at both of "
        "round 2's larger budgets, beside dense and round 2's MoD arm (rerun here at 5e13 with "
        "this round's evaluation, dense at round 2's learning rate and at its best where "
        "another beat it; at 1.5e14 the round's dense XS and MoD S arms). The verdicts take the "
        "best of each side.",
        "",
        "| budget | model, size | seeds | causal loss (each seed) | mean |",
        "|---|---|---|---|---|",
    ]
    verdicts = []
    for budget in sorted({r["budget"] for r in rows}):
        here = [r for r in rows if r["budget"] == budget]
        if budget == FULL.budget:  # the round's own dense and MoD arms are their points here
            own = {DENSE_LABEL, best_dense(results).label, MOD_LABEL}
            here += [r for r in own_rows(results) if r["label"] in own]
        here += _twin_seeds(here, results)
        groups: dict[str, list[dict[str, Any]]] = {}
        for r in here:
            groups.setdefault(r["label"], []).append(r)
        best: dict[str, dict[str, Any]] = {}
        for label, rs in sorted(groups.items()):
            a = arm_summary_losses(rs)
            side = side_of(rs[0])
            if side not in best or a["loss"] < best[side]["loss"]:
                best[side] = {**a, "label": label}
            each = ", ".join(f"{v:.4f}" for v in a["losses"])
            lines.append(f"| {budget:.1e} | {label} | {a['seeds']} | {each} | {a['loss']:.4f} |")
        for a, b in (("winner", "dense"), ("joint", "dense"), ("winner", "joint")):
            if a in best and b in best:
                verdicts.append(
                    f"- {budget:.1e}: best {best[a]['label']} against best "
                    f"{best[b]['label']}: {against(best[a], best[b])}"
                )
    return [*lines, "", *verdicts, ""]


def arm_summary_losses(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Seeds, losses, their mean and range, of one group of rows."""
    losses = [r["val_loss_causal"] for r in sorted(rows, key=lambda r: r["seed"])]
    return {"seeds": len(losses), "losses": losses, "loss": statistics.fmean(losses),
            "spread": max(losses) - min(losses)}  # fmt: skip


def against(a: dict[str, Any], b: dict[str, Any]) -> str:
    """`a`'s mean loss against `b`'s, judged against the larger of their seed spreads (the
    range over seeds): a verdict needs two seeds on both sides. Where their seeds differ, the
    difference is taken on the seeds both trained (`common_seeds`)."""
    diff = a["loss"] - b["loss"]
    if a["seeds"] < 2 or b["seeds"] < 2:
        common = common_seeds(a, b)
        if common and len(common[0]) < max(a["seeds"], b["seeds"]):  # the same seeds only
            on = ", ".join(map(str, common[0]))
            paired = common[1][0] - common[1][1]
            return f"{paired:+.4f} nats on seed {on} (one seed on a side: no verdict yet)"
        return f"{diff:+.4f} nats (one seed on a side: no verdict yet)"
    on = ""
    common = common_seeds(a, b)
    if common and len(common[0]) >= 2 and len(common[0]) < max(a["seeds"], b["seeds"]):
        # a seed fixes the data order and the initial weights: compare what both trained
        diff = common[1][0] - common[1][1]
        on = f" on seeds {', '.join(map(str, common[0]))}"
    spread = max(a["spread"], b["spread"])
    side = "better" if diff < 0 else "worse"
    word = "within the seed spread" if abs(diff) <= spread else f"{side} beyond the seed spread"
    return f"{diff:+.4f} nats{on}, {word} ({spread:.4f})"


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
