"""`mod study experiments/kv`: the two KV strategies for skipped tokens at equal training FLOPs.

Routing-isolated attention (``skipped_kv="none"``: a routed token attends only to earlier tokens
that took the layer, whose cache holds only them) against residual cache duplication
(``"residual"``: the layer's keys and values of every token, from its input; a routed token sees
its whole history, and the cache is as large as a dense layer's). At each budget and sequence
length (256, and 1024, where a token that sees 12.5% of its history should lose the most), one
shape trained as: dense; MoD (every other block routed) with each strategy at capacities 12.5%
and 25%. Every sequence length trains on the same tokens per step (batch 16 x 256 or 4 x 1024).
At the larger budget the best run of each strategy at each length trains again with a second
seed; residual is judged against none by the verdict module (`verdict.compare`), per capacity
and each strategy at its best capacity.

Each run trains for floor(budget / training FLOPs per step) (`estimate_flops`, which charges
"residual" its skippers' K/V projections and its routed queries' attention over every key). After
training, each model is measured with nothing else of the study running (`measure`, with the
shared `experiments.common.measure`): the KV bytes per token its cache held (bf16), the
prefill calibration of `generate.prefill_calibration` (teacher-forced loss after a causal
against a top-k prefill of half the sequence, and the share of prompt decisions that differ),
and decode tokens/s at batch
1 and 8, the models of each budget and length side by side (`measure.decode_speeds`: one thread,
a prompt of half the sequence, 128 greedy tokens, the median of 15 interleaved rounds).
Measurements are kept in ``measures.jsonl`` and ``decode.jsonl``; delete one to measure again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mixture_of_depths.config import MoDConfig
from mixture_of_depths.fileio import atomic_write_text, json_text
from mixture_of_depths.flops import estimate_flops
from mixture_of_depths.runtime.checkpoint import resolve_checkpoint
from mixture_of_depths.studies.runner import (
    AUX_ROUTING,
    Folders,
    Plan,
    RunSpec,
    StudySettings,
    budget_tag,
    load_results,
    mean_seeds,
    second_seed,
    seed_gaps,
)
from mixture_of_depths.studies.verdict import Arm, Verdict, best_of, compare
from mixture_of_depths.train import CHECKPOINT_NAME, has_checkpoint

from ..common.measure import decode_speeds, measure_run
from ..common.plots import plot_vs_dense

SEQ_LENS: tuple[tuple[int, int], ...] = ((256, 16), (1024, 4))  # (length, batch): 4096 tokens
ARCHS: tuple[tuple[str, str, dict[str, Any]], ...] = (  # (label, name tag, MoDConfig overrides)
    ("dense", "dense", dict(layer_pattern="D")),
    ("MoD 12.5%, none", "none-c12", dict(layer_pattern="DR", capacity=0.125, **AUX_ROUTING)),
    (
        "MoD 12.5%, residual",
        "res-c12",
        dict(layer_pattern="DR", capacity=0.125, **AUX_ROUTING, skipped_kv="residual"),
    ),
    ("MoD 25%, none", "none-c25", dict(layer_pattern="DR", capacity=0.25, **AUX_ROUTING)),
    (
        "MoD 25%, residual",
        "res-c25",
        dict(layer_pattern="DR", capacity=0.25, **AUX_ROUTING, skipped_kv="residual"),
    ),
)
STRATEGIES = ("none", "residual")

FULL = StudySettings(
    budgets=(2e12, 4e12),
    sizes=(("XS", dict(d_model=64, n_layers=4, n_heads=4)),),
    seq_len=256,
    batch_size=16,
    eval_every_runs=2,
    eval_batches=8,
    base={},
    ablation_size="XS",
)

QUICK = StudySettings(
    budgets=(1e9, 2e9),
    sizes=(("S", dict(d_model=32, n_layers=2, n_heads=2)),),
    seq_len=32,
    batch_size=4,
    eval_every_runs=1,
    eval_batches=1,
    base={},
    ablation_size="S",
)


def _lengths(settings: StudySettings) -> tuple[tuple[int, int], ...]:
    """(sequence length, batch) pairs: the full study's, or the quick one's scaled down."""
    if settings is FULL:
        return SEQ_LENS
    return (
        (settings.seq_len, settings.batch_size),
        (2 * settings.seq_len, settings.batch_size // 2),
    )


def plan(settings: StudySettings) -> list[RunSpec]:
    size, shape = settings.sizes[0]
    return [
        RunSpec(
            name=f"{budget_tag(budget)}-T{T}-{tag}-{size}-s0",
            group="isoflop",
            label=label,
            budget=budget,
            model={**settings.base, **shape, "max_seq_len": T, **over},
            seq_len=T,
            batch_size=B,
        )
        for budget in settings.budgets
        for T, B in _lengths(settings)
        for label, tag, over in ARCHS
    ]


def strategy(r: dict[str, Any]) -> str | None:
    """The strategy of an MoD run ("none" or "residual"); None for dense."""
    if "R" not in r["model"].get("layer_pattern", "D"):
        return None
    return r["model"].get("skipped_kv", "none")


def seed_specs(
    results: list[dict[str, Any]], budget: float, settings: StudySettings
) -> list[RunSpec]:
    """At the largest budget, a second seed for each strategy's best run at each length."""
    if budget != max(settings.budgets):
        return []
    specs = []
    for T in sorted({r["seq_len"] for r in results}):
        first = [
            r for r in results if r["budget"] == budget and r["seq_len"] == T and r["seed"] == 0
        ]
        for strat in STRATEGIES:
            runs = [r for r in first if strategy(r) == strat]
            if runs:
                specs.append(second_seed(min(runs, key=lambda r: r["val_loss_causal"])))
    return specs


# -- measurements of the trained models ---------------------------------------------------------
def train_curve(run_dir: Path) -> list[list[float]]:
    """The run's logged (step, training LM loss) pairs, from its metrics.jsonl."""
    rows = load_results(run_dir / "metrics.jsonl")
    return [[r["step"], r["lm_loss"]] for r in rows if "lm_loss" in r and "step" in r]


def same_steps_loss(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    """The two runs' mean training LM loss over the last quarter of the steps both reached (the
    same batches, in the same order, for the same seed): how they compare per step, apart from
    the steps their FLOPs buy."""
    if not a.get("train_curve") or not b.get("train_curve"):
        return None
    ca, cb = dict(map(tuple, a["train_curve"])), dict(map(tuple, b["train_curve"]))
    common = sorted(set(ca) & set(cb))
    if not common:
        return None
    last = [s for s in common if s > 0.75 * common[-1]] or common[-1:]
    mean = lambda c: sum(c[s] for s in last) / len(last)  # noqa: E731
    return {"from_step": last[0], "to_step": last[-1], "a": mean(ca), "b": mean(cb)}


def measure(results: list[dict[str, Any]], out: Path, work: Path, data: str | None) -> None:
    """Measure the trained models whose checkpoints are kept: each run not yet in
    ``measures.jsonl`` (cache bytes, prefill calibration, training curve), then decode speed,
    cell by cell, for the cells with a run not yet in ``decode.jsonl`` (all of the cell's models
    again, side by side). Delete a file to measure again."""
    kept = [r for r in results if has_checkpoint(work / r["name"])]
    ckpt = {r["name"]: resolve_checkpoint(work / r["name"] / CHECKPOINT_NAME) for r in kept}
    path = out / "measures.jsonl"
    done = {m["name"] for m in load_results(path)}
    for r in kept:
        if r["name"] in done:
            continue
        print(f"measuring {r['name']}")
        row = {"name": r["name"], **measure_run(ckpt[r["name"]], r["seq_len"], data)}
        row["train_curve"] = train_curve(work / r["name"])
        with path.open("a") as fh:
            fh.write(json_text(row) + "\n")
    path = out / "decode.jsonl"
    done = {m["name"] for m in load_results(path)}
    for budget, T in sorted({(r["budget"], r["seq_len"]) for r in kept}):
        cell = [r["name"] for r in kept if (r["budget"], r["seq_len"]) == (budget, T)]
        if all(name in done for name in cell):
            continue
        print(f"decode speed: budget {budget:.0e}, T={T}, {len(cell)} models side by side")
        speeds = decode_speeds({name: ckpt[name] for name in cell}, T, data)
        with path.open("a") as fh:
            for name in cell:
                fh.write(json_text({"name": name, **speeds[name]}) + "\n")


# -- report -------------------------------------------------------------------------------------
def _merged(results: list[dict[str, Any]], out: Path) -> list[dict[str, Any]]:
    rows = [dict(r) for r in results]
    for file in ("measures.jsonl", "decode.jsonl"):  # the later measurement of a name wins
        found = {m["name"]: m for m in load_results(out / file)}
        for r in rows:
            r.update(found.get(r["name"], {}))
    return rows


# TrainConfig's peak learning rate when these runs trained (their rows name none: the default),
# pinned so that a later default does not rewrite the report
DEFAULT_LR = 2e-3
CAPACITIES = ("12.5%", "25%")


def rate_text(lr: float) -> str:
    """A learning rate as the report writes it: 0.002 -> "2e-3"."""
    return f"{lr:.0e}".replace("e-0", "e-").replace("e+0", "e")


def _size(r: dict[str, Any]) -> str:
    return r["name"].rsplit("-", 2)[-2]  # <budget>-T<length>-<tag>-<size>-s<seed>


def _lr(r: dict[str, Any]) -> float:
    return r.get("lr") or DEFAULT_LR


def _grid(rows: list[dict[str, Any]], point: Any) -> list[tuple[Any, dict[int, float]]]:
    """`rows` as a `best_of` grid: per point (`point(row)`, in sorted order), loss per seed."""
    grid: dict[Any, dict[int, float]] = {}
    for r in rows:
        grid.setdefault(point(r), {})[r["seed"]] = r["val_loss_causal"]
    return sorted(grid.items(), key=lambda p: p[0])


def arm(rows: list[dict[str, Any]], strat: str, caps: tuple[str, ...]) -> Arm | None:
    """Strategy `strat` at one budget and length as an `Arm`: at the best of capacities `caps`
    (`best_of`; with two tried, its best is an end of them: not bracketed), the edge of the
    sizes it trained at (one here) and its learning rate's (one, for every model)."""
    by_cap = [(cap, [r for r in rows if r["label"] == f"MoD {cap}, {strat}"]) for cap in caps]
    by_cap = [(cap, runs) for cap, runs in by_cap if runs]
    if not by_cap:
        return None
    grid = [(cap, {r["seed"]: r["val_loss_causal"] for r in runs}) for cap, runs in by_cap]
    cap, cap_end = best_of(grid, "capacity", ("lowest", "highest"))
    runs = dict(by_cap)[cap]
    size, edge = best_of(_grid(runs, _size))
    at_size = [r for r in runs if _size(r) == size]
    rates = [
        (rate_text(lr), seeds) for lr, seeds in _grid(at_size, lambda r: r.get("lr") or DEFAULT_LR)
    ]
    rate, rate_end = best_of(rates, "learning rate", ("lowest", "highest"))
    ends = [e for e in (cap_end if len(caps) > 1 else None, rate_end) if e]
    label = f"MoD {cap}, {strat} ({size})"
    return Arm(label, dict(rates)[rate], edge, "; ".join(ends) or None)


def _judge(rows: list[dict[str, Any]], caps: tuple[str, ...]) -> Verdict | None:
    """Residual against none (the baseline) at capacities `caps`, each at its best of them."""
    res, none = arm(rows, "residual", caps), arm(rows, "none", caps)
    return None if res is None or none is None else compare(res, none)


def findings(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per budget and length: each model's causal loss (mean over seeds), the cell's largest
    seed spread, per capacity the residual-minus-none difference and its verdict's key, and
    the key of residual against none each at its best capacity; the verdicts (`verdict.compare`,
    residual against none) by key."""
    sizes = sorted({_size(r) for r in results})
    rates = [rate_text(lr) for lr in sorted({_lr(r) for r in results})]
    out: dict[str, Any] = {"sizes": sizes, "learning_rates": rates, "cells": [], "verdicts": {}}
    for budget in sorted({r["budget"] for r in results}):
        for T in sorted({r["seq_len"] for r in results}):
            rows = [r for r in results if r["budget"] == budget and r["seq_len"] == T]
            loss = mean_seeds([{**r, "judged": r["val_loss_causal"]} for r in rows], "judged")
            gaps = seed_gaps(rows)
            spread = max(gaps.values()) if gaps else None
            where = f"{budget_tag(budget)}-t{T}"
            pairs = []
            for cap in CAPACITIES:
                a, b = f"MoD {cap}, none", f"MoD {cap}, residual"
                verdict = _judge(rows, (cap,))
                if verdict is None:
                    continue
                key = f"residual-vs-none-c{cap.rstrip('%')}-{where}"
                out["verdicts"][key] = verdict.as_dict()
                first = {r["label"]: r for r in rows if r["seed"] == 0}
                per_step = same_steps_loss(first[a], first[b])
                diff = loss[a] - loss[b]  # > 0: residual is lower
                pairs.append(
                    {
                        "capacity": cap,
                        "none": loss[a],
                        "residual": loss[b],
                        "gain_residual": diff / loss[a],
                        "verdict": key,
                        "steps": [first[a]["steps"], first[b]["steps"]],
                        "train_loss_same_steps": per_step,
                    }
                )
            best = _judge(rows, CAPACITIES)
            if best is not None:
                out["verdicts"][f"residual-vs-none-{where}"] = best.as_dict()
            out["cells"].append(
                {
                    "budget": budget,
                    "seq_len": T,
                    "loss": loss,
                    "seed_spread": spread,
                    "pairs": pairs,
                    "best_capacity": None if best is None else f"residual-vs-none-{where}",
                }
            )
    return out


_HEADER = (
    "| model | seed | params | FLOPs/token fwd | steps | val loss causal | vs dense | "
    "KV bytes/token (bf16) | decode FLOPs/token | decode tok/s b1 | b8 | "
    "loss, causal prefill | top-k prefill | decisions differ |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _f(r: dict[str, Any], key: str, fmt: str) -> str:
    v = r.get(key)
    return "" if v is None else format(v, fmt)


def _speed(r: dict[str, Any], b: int) -> str:
    """Decode tokens/s at batch `b`, with the spread of its rounds."""
    v, spread = r.get(f"decode_tok_s_b{b}"), r.get(f"decode_spread_b{b}")
    return "" if v is None else f"{v:,.0f}" + ("" if spread is None else f" ({spread:.0%})")


def _row(r: dict[str, Any], dense_loss: float | None) -> str:
    rel = (
        ""
        if dense_loss is None
        else f"{100 * (r['val_loss_causal'] - dense_loss) / dense_loss:+.2f}%"
    )
    return (
        f"| {r['label']} | {r['seed']} | {r['params'] / 1e6:.2f}M | "
        f"{r['flops_per_forward_token'] / 1e6:.3f}M | {r['steps']} | {r['val_loss_causal']:.4f} | "
        f"{rel} | {_f(r, 'kv_bytes_per_token_measured', ',.0f')} | "
        f"{r['decode_flops_per_token'] / 1e6:.3f}M | {_speed(r, 1)} | {_speed(r, 8)} | "
        f"{_f(r, 'loss_causal_prefill', '.4f')} | "
        f"{_f(r, 'loss_topk_prefill', '.4f')} | {_f(r, 'decisions_differ', '.1%')} |"
    )


def write_report(results: list[dict[str, Any]], out: Path, settings: StudySettings) -> None:
    """``report.md``, ``findings.json`` and ``kv.png``, from the results and measurements so far."""
    rows = _merged(results, out)
    for r in rows:  # analytic decode FLOPs per token at the run's length, take-rate = capacity
        cfg = MoDConfig(**r["model"])
        r["decode_flops_per_token"] = estimate_flops(
            cfg, r["seq_len"], with_dense=False
        ).decode_per_token
    summary = findings(rows)
    lines = [*_intro(settings), *_pairs(summary), "", *_tables(rows)]
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    atomic_write_text(out / "findings.json", json_text(summary, indent=1) + "\n")
    try:
        _plot(summary, out)
    except Exception as exc:  # plots are a convenience; the results are already saved
        print(f"note: plot failed: {exc!r}")


def _intro(settings: StudySettings) -> list[str]:
    return [
        "# KV strategies: routing-isolated attention against residual cache duplication",
        "",
        f"Default corpus, byte tokenizer, one shape ({settings.sizes[0][0]}: "
        f"{settings.sizes[0][1]}), every other block routed; sequences of 256 (batch 16) and "
        "1024 (batch 4) tokens, the same tokens per step. `none`: a routed token attends only to "
        "earlier tokens that took the layer (its cache holds only them); `residual`: the layer "
        "computes keys and values of every token from its input, so a routed token attends to "
        "all earlier tokens (its cache is a dense layer's). Each run trains for floor(budget / "
        "training FLOPs per step); `residual` is charged its extra K/V projections and its "
        "wider attention. Val loss: causal routing, nats per token (what generation gets). KV "
        "bytes per token: what the decode cache held per token of context, counted at 2 bytes "
        "an element. Decode: CPU, one thread, prompt of half the sequence, 128 greedy tokens, "
        "the models of a table side by side, median of 15 interleaved rounds (in brackets: "
        "interquartile range / median); measured after training, nothing else running. "
        "Prefill: "
        "teacher-forced loss on the second half of 8 held-out sequences after prefilling the "
        "first half causally (exact) or with top-k (the paper's prefill), and the share of the "
        "prompt's routing decisions that differ. Generated by `mod study experiments/kv`; plot: "
        "`kv.png`.",
        "",
    ]


def _pairs(summary: dict[str, Any]) -> list[str]:
    """Residual against none per cell and capacity, and each at its best capacity: the
    verdicts (residual against none), with the same-steps loss."""
    verdicts = summary["verdicts"]
    lines = [
        "## Residual against none, per capacity",
        "",
        f"{_tried(summary)}. Each "
        "verdict is the verdict module's (`mixture_of_depths.studies.verdict`): residual minus "
        "none on every seed both trained (only the larger budget's best run of each strategy "
        "at each length has a second seed), against the larger seed range of the two.",
        "",
    ]
    for c in summary["cells"]:
        sp = "-" if c["seed_spread"] is None else f"{c['seed_spread']:.4f}"
        for p in c["pairs"]:
            same = p["train_loss_same_steps"]
            per_step = (
                ""
                if same is None
                else f" Steps {p['steps'][0]} against {p['steps'][1]}; at the same steps "
                f"({same['from_step']}-{same['to_step']}) training loss {same['a']:.4f} against "
                f"{same['b']:.4f}."
            )
            lines.append(
                f"- budget {c['budget']:.0e}, T={c['seq_len']}, capacity {p['capacity']}: none "
                f"{p['none']:.4f}, residual {p['residual']:.4f} (residual "
                f"{-100 * p['gain_residual']:+.2f}% against none; the cell's largest seed "
                f"spread {sp}): {verdicts[p['verdict']]['text']}.{per_step}"
            )
    lines += ["", "## Residual against none, each at its best capacity", ""]
    for c in summary["cells"]:
        if c["best_capacity"] is not None:
            text = verdicts[c["best_capacity"]]["text"]
            lines.append(f"- budget {c['budget']:.0e}, T={c['seq_len']}: {text}.")
    return lines


def _tried(summary: dict[str, Any]) -> str:
    """The sizes and learning rates every model trained at, in words."""
    sizes, rates = ", ".join(summary["sizes"]), ", ".join(summary["learning_rates"])
    if len(summary["sizes"]) == len(summary["learning_rates"]) == 1:
        return (f"Every model trained at one size ({sizes}) and one peak learning rate ({rates}): "
                "neither is bracketed, so the verdicts name both, for both strategies")  # fmt: skip
    return f"Sizes tried: {sizes}; peak learning rates: {rates}"


def _tables(rows: list[dict[str, Any]]) -> list[str]:
    """A table per budget and length: every run with its measurements, against dense."""
    order = {label: i for i, (label, _, _) in enumerate(ARCHS)}
    lines: list[str] = []
    for budget in sorted({r["budget"] for r in rows}):
        for T in sorted({r["seq_len"] for r in rows}):
            cell = [r for r in rows if r["budget"] == budget and r["seq_len"] == T]
            dense = [r["val_loss_causal"] for r in cell if r["label"] == "dense"]
            dense_loss = sum(dense) / len(dense) if dense else None
            lines += [f"## Budget {budget:.1e} FLOPs, sequences of {T}", "", _HEADER]
            key = lambda r: (order.get(r["label"], 99), r["seed"])  # noqa: E731
            lines += [_row(r, dense_loss) for r in sorted(cell, key=key)]
            lines.append("")
    return lines


def _plot(summary: dict[str, Any], out: Path) -> None:
    cells = [c for c in summary["cells"] if "dense" in c["loss"]]
    if not cells:
        return
    groups = [
        (f"{c['budget']:.0e} FLOPs, T={c['seq_len']}", c["loss"], c["seed_spread"]) for c in cells
    ]
    title = "KV strategies at equal training FLOPs (whiskers: seed spread)"
    ylabel = "causal val loss vs dense (%), lower is better"
    plot_vs_dense(groups, [label for label, _, _ in ARCHS[1:]], out / "kv.png", title, ylabel)


PLAN = Plan(  # the module's globals are read at call time (tests cut the plan down)
    name="kv",
    settings=lambda quick: QUICK if quick else FULL,
    runs=lambda settings: plan(settings),
    report=lambda results, out, settings: write_report(results, out, settings),
    folders=Folders(str(Path(__file__).resolve().parent)),
    seeds=lambda results, budget, settings: seed_specs(results, budget, settings),
    finish=lambda results, out, work, data: measure(results, out, work, data),
)
