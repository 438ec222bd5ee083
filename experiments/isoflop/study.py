"""`mod study`: the isoFLOP study. Does MoD beat dense at equal training compute?

At each training-FLOP budget, dense and MoD models (capacity 12.5%, every other block routed) of
several sizes are each trained for exactly as many steps as the budget buys, counted by
`estimate_flops(...).train`. At the middle budget, ablations of the middle MoD model: capacity,
every block routed, random routing, raw gate, predictor. The two best models of each budget are
trained again with a second seed, to show the seed spread beside the differences.

Runs and resumption are `runner.study`'s; the report (``report.md``), ``findings.json`` and the
plots are rewritten from ``results.jsonl`` after every run.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from mixture_of_depths.fileio import atomic_write_text, json_text
from mixture_of_depths.studies.plots import pyplot
from mixture_of_depths.studies.runner import (
    AUX_ROUTING,
    Folders,
    Plan,
    RunSpec,
    StudySettings,
    budget_tag,
    mean_seeds,
    seed_gaps,
)
from mixture_of_depths.studies.verdict import Arm, Verdict, best_of, compare

# Sizes bracket the compute-optimal size of these budgets (N ~ sqrt(C / 120) is 0.2M-0.6M
# parameters), so each isoFLOP curve can show its minimum. At the largest budget the smallest
# and largest sizes are left out: at 1.6e13 L is already ~40% worse than the best, and each run
# there costs ~12 minutes. 38 runs, 2.6 hours on 2 CPU cores; the ablations use size M.
FULL = StudySettings(
    budgets=(5e12, 1.6e13, 5e13),
    sizes=(
        ("XXS", dict(d_model=48, n_layers=3, n_heads=3)),
        ("XS", dict(d_model=64, n_layers=4, n_heads=4)),
        ("S", dict(d_model=96, n_layers=4, n_heads=4)),
        ("M", dict(d_model=128, n_layers=4, n_heads=4)),
        ("L", dict(d_model=192, n_layers=6, n_heads=6)),
    ),
    seq_len=256,
    batch_size=16,
    eval_every_runs=2,
    eval_batches=8,
    base=dict(max_seq_len=256),
    ablation_size="M",
    skip=((5e13, ("XXS", "L")),),
)

QUICK = StudySettings(
    budgets=(2e9, 6e9, 2e10),
    sizes=(
        ("S", dict(d_model=32, n_layers=2, n_heads=2)),
        ("M", dict(d_model=48, n_layers=2, n_heads=2)),
    ),
    seq_len=32,
    batch_size=4,
    eval_every_runs=1,
    eval_batches=1,
    base=dict(max_seq_len=32, predictor_hidden=16),
    ablation_size="M",
)

MOD = dict(layer_pattern="DR", capacity=0.125, **AUX_ROUTING)
DENSE = dict(layer_pattern="D")
ABLATIONS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("capacity 25%", dict(capacity=0.25)),
    ("capacity 50%", dict(capacity=0.5)),
    ("every block routed", dict(layer_pattern="R")),
    ("random routing", dict(router_scores="random")),
    ("raw gate", dict(router_gate="raw")),
    ("predictor", dict(causal_router="predictor")),
)


def plan(settings: StudySettings) -> list[RunSpec]:
    """The isoFLOP grid and the ablations (second seeds are planned once their budget is done)."""
    specs = []
    for budget in settings.budgets:
        for size, shape in settings.sizes_at(budget):
            for arch, over in (("dense", DENSE), ("MoD", MOD)):
                specs.append(
                    RunSpec(
                        name=f"{budget_tag(budget)}-{arch}-{size}-s0",
                        group="isoflop",
                        label=f"{arch} {size}",
                        budget=budget,
                        model={**settings.base, **shape, **over},
                    )
                )
    mid = settings.budgets[len(settings.budgets) // 2]
    size, shape = next(sz for sz in settings.sizes if sz[0] == settings.ablation_size)
    for label, over in ABLATIONS:
        tag = label.replace(" ", "-").replace("%", "")
        specs.append(
            RunSpec(
                name=f"{budget_tag(mid)}-abl-{tag}-{size}-s0",
                group="ablation",
                label=f"MoD {size}, {label}",
                budget=mid,
                model={**settings.base, **shape, **MOD, **over},
            )
        )
    return specs


# -- verdicts ------------------------------------------------------------------------------------
# Rounds 1 and 2 trained every model at one learning rate (TrainConfig's 2e-3). Round 3 tuned
# dense's (experiments/round3/results.jsonl): at 1.5e14 FLOPs and 1024 tokens dense XS at 4e-3 was
# 0.19 nats lower than at 2e-3, so no dense baseline of these rounds is bracketed.
DENSE_RATE = (
    "one learning rate tried, 2e-3 (round 3 found dense 0.19 nats lower at 4e-3: "
    "experiments/round3/results.jsonl)"
)


def size_of(label: str) -> str:
    """ "MoD XS" -> "XS"."""
    return label.split(" ", 1)[1]


def size_grid(rows: list[dict[str, Any]], key: str) -> list[tuple[str, dict[int, float]]]:
    """One architecture's sizes at one budget, smallest first (by parameters), each its `key`
    per seed: the grid its best size was chosen from."""
    by: dict[str, dict[int, float]] = {}
    params: dict[str, float] = {}
    for r in rows:
        by.setdefault(size_of(r["label"]), {})[r["seed"]] = r[key]
        params[size_of(r["label"])] = r["params"]
    return [(size, by[size]) for size in sorted(by, key=params.__getitem__)]


def grid_edge(
    grid: list[tuple[str, dict[int, float]]], best: str, what: str = "size"
) -> str | None:
    """Why `best`, the headline's best point of `grid` (each point's mean over its own seeds,
    as round 2's grid bracketed it), is not a measured interior optimum, in `best_of`'s words;
    None where it is. `best_of` reads the seeds every point trained: where that reading puts
    the best at an edge, or the headline's best sits at one, the optimum was not measured."""
    got, edge = best_of(grid, what)
    if got == best:
        return edge
    if edge is not None:
        shared = sorted(set.intersection(*(set(s) for _, s in grid)))
        seeds = ", ".join(str(s) for s in shared)
        return f"{edge} on seed {seeds}, the one every {what} trained"
    # the headline's best, in best_of's words: one mean per point (the key is a placeholder)
    return best_of([(v, {0: statistics.fmean(s.values())}) for v, s in grid], what)[1]


def is_dense(r: dict[str, Any]) -> bool:
    return r["model"].get("layer_pattern") == "D"


# -- findings -------------------------------------------------------------------------------------
def _describe(r: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "label": r["label"],
        "params": r["params"],
        "flops_per_forward_token": r["flops_per_forward_token"],
        "tokens_per_s": r["tokens_per_s"],
        "seeds": sum(1 for x in rows if x["label"] == r["label"]),
    }


def _budget_findings(
    rows: list[dict[str, Any]], budget: float, dense_rate: str | None
) -> tuple[dict[str, Any], dict[str, Verdict]] | None:
    """One budget's best dense and best MoD, the verdict of one against the other, and the
    cheapest MoD forward whose loss comes within the budget's seed spread of the best dense
    loss (or below it), with its verdict; None without both architectures. The verdicts by key
    (``mod-vs-dense-<budget>``, ``matching-<budget>``)."""
    dense = [r for r in rows if is_dense(r)]
    mod = [r for r in rows if not is_dense(r)]
    if not dense or not mod:
        return None
    d_loss = mean_seeds(dense, "val_loss_topk")
    m_loss = mean_seeds(mod, "val_loss_causal")
    m_topk = mean_seeds(mod, "val_loss_topk")
    bd, bm = min(d_loss, key=d_loss.get), min(m_loss, key=m_loss.get)
    first = {r["label"]: r for r in rows if r["seed"] == 0}
    gaps = seed_gaps(rows)
    spread = max(gaps.values()) if gaps else None
    gain = (d_loss[bd] - m_loss[bm]) / d_loss[bd]
    d_grid, m_grid = size_grid(dense, "val_loss_topk"), size_grid(mod, "val_loss_causal")
    d_arm = Arm(bd, dict(d_grid)[size_of(bd)], grid_edge(d_grid, size_of(bd)), dense_rate)
    m_arm = Arm(bm, dict(m_grid)[size_of(bm)], grid_edge(m_grid, size_of(bm)))
    tag = budget_tag(budget)
    verdicts = {f"mod-vs-dense-{tag}": compare(m_arm, d_arm)}
    # MoD models at this budget whose causal loss reaches the best dense loss (or comes within
    # the seed spread of it): the cheapest forward among them, against the best dense's. Its
    # own optimum does not matter to that claim, so it carries no edge unless it is the best.
    tol = spread or 0.0
    match = [lab for lab in m_loss if m_loss[lab] <= d_loss[bd] + tol]
    cheapest = min(match, key=lambda lab: first[lab]["flops_per_forward_token"], default=None)
    if cheapest is not None:
        seeds = dict(m_grid)[size_of(cheapest)]
        cheap = m_arm if cheapest == bm else Arm(cheapest, seeds)
        verdicts[f"matching-{tag}"] = compare(cheap, d_arm)
    found = {
        "budget": budget,
        "best_dense": {**_describe(first[bd], rows), "val_loss": d_loss[bd]},
        "best_mod": {
            **_describe(first[bm], rows),
            "val_loss_causal": m_loss[bm],
            "val_loss_topk": m_topk[bm],
        },
        "mod_gain": gain,
        "seed_spread": spread,
        "verdict": f"mod-vs-dense-{tag}",
        "mod_matching": None
        if cheapest is None
        else {
            **_describe(first[cheapest], rows),
            "val_loss_causal": m_loss[cheapest],
            "flops_ratio_vs_best_dense": first[cheapest]["flops_per_forward_token"]
            / first[bd]["flops_per_forward_token"],
            "verdict": f"matching-{tag}",
        },
    }
    return found, verdicts


def _range(values: list[float]) -> dict[str, float]:
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def _ablation_findings(
    results: list[dict[str, Any]], iso: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, Verdict]] | None:
    """Each ablation's losses against the MoD run of its size and budget, and its verdict
    (``ablation-<variant>``); the best capacity against the next (``capacity-best``) and the
    predictor against random routing (``predictor-vs-random-routing``). None without both."""
    abl = [r for r in results if r["group"] == "ablation"]
    if not abl:
        return None
    base = [
        r
        for r in iso
        if r["group"] == "isoflop"
        and r["budget"] == abl[0]["budget"]
        and not is_dense(r)
        and r["model"]["d_model"] == abl[0]["model"]["d_model"]
    ]
    if not base:
        return None
    b = base[0]
    rows = [
        {
            "label": r["label"].split(", ")[-1],
            "val_loss_topk": r["val_loss_topk"],
            "val_loss_causal": r["val_loss_causal"],
            "vs_baseline_causal": (r["val_loss_causal"] - b["val_loss_causal"])
            / b["val_loss_causal"],
            "routing_accuracy_mean": r["routing_accuracy_mean"],
        }
        for r in [b, *abl]
    ]
    rows[0]["label"] = "baseline (learned, sigmoid gate, aux loss)"
    # every arm here trained at one size: its optimum over sizes was not measured
    one_size = best_of([(size_of(b["label"]), {0: 0.0})])[1]
    same = [r for r in iso if r["budget"] == b["budget"] and r["label"] == b["label"]]
    seeds = {r["seed"]: r["val_loss_causal"] for r in same}
    arms = {"baseline": Arm(f"{b['label']}, baseline", seeds, one_size)}
    for row, r in zip(rows[1:], abl, strict=True):
        seeds = {x["seed"]: x["val_loss_causal"] for x in abl if x["label"] == r["label"]}
        arms[row["label"]] = Arm(r["label"], seeds, one_size)
        row["verdict"] = "ablation-" + row["label"].replace(" ", "-").replace("%", "")
    verdicts = {row["verdict"]: compare(arms[row["label"]], arms["baseline"]) for row in rows[1:]}
    verdicts.update(_capacity_verdict(b, abl, arms))
    if "predictor" in arms and "random routing" in arms:
        verdicts["predictor-vs-random-routing"] = compare(arms["predictor"], arms["random routing"])
    return rows, verdicts


def _capacity_verdict(
    b: dict[str, Any], abl: list[dict[str, Any]], arms: dict[str, Arm]
) -> dict[str, Verdict]:
    """The best capacity tried against the next best, its edge from the capacities tried."""
    labels = {r["label"].split(", ")[-1] for r in abl}
    at = {lab.removeprefix("capacity "): arms[lab] for lab in labels if lab.startswith("capacity ")}
    if not at or "capacity" not in b["model"]:
        return {}
    at[f"{b['model']['capacity']:.1%}".replace(".0%", "%")] = arms["baseline"]
    order = sorted(at, key=lambda c: float(c.rstrip("%")))
    grid = [(c, dict(at[c].seeds)) for c in order]
    best, edge = best_of(grid, "capacity", ("lowest", "highest"))
    means = {c: statistics.fmean(s.values()) for c, s in grid}
    runner_up = min((c for c in order if c != best), key=means.__getitem__)
    a = Arm(f"MoD {size_of(b['label'])}, capacity {best}", at[best].seeds, edge)
    other = Arm(f"MoD {size_of(b['label'])}, capacity {runner_up}", at[runner_up].seeds)
    return {"capacity-best": compare(a, other)}


def judge(
    results: list[dict[str, Any]], dense_rate: str | None = DENSE_RATE
) -> tuple[dict[str, Any], dict[str, Verdict]]:
    """`findings` less its "verdicts", and the verdicts themselves by key."""
    out: dict[str, Any] = {"budgets": []}
    verdicts: dict[str, Verdict] = {}
    iso = [r for r in results if r["group"] in ("isoflop", "seed")]
    for budget in sorted({r["budget"] for r in iso}):
        found = _budget_findings([r for r in iso if r["budget"] == budget], budget, dense_rate)
        if found is not None:
            out["budgets"].append(found[0])
            verdicts.update(found[1])
    mods = [r for r in iso if not is_dense(r)]
    if mods:
        gaps = [(r["val_loss_causal"] - r["val_loss_topk"]) / r["val_loss_topk"] for r in mods]
        accs = [r["routing_accuracy_mean"] for r in mods if r["routing_accuracy_mean"] is not None]
        out["causal_gap"] = _range(gaps)
        if accs:
            out["routing_accuracy"] = _range(accs)
    ablations = _ablation_findings(results, iso)
    if ablations is not None:
        out["ablations"] = ablations[0]
        verdicts.update(ablations[1])
    return out, verdicts


def findings(results: list[dict[str, Any]], dense_rate: str | None = DENSE_RATE) -> dict[str, Any]:
    """The study's answers, computed from the results: per budget the best dense and best MoD
    (MoD judged by its causal loss; seeds averaged where there are two) and the verdict of one
    against the other, the cheapest MoD forward that matches the best dense loss; the
    ablations' verdicts; the causal-mode gap; routing accuracy. `dense_rate`: why dense's
    learning rate is not bracketed (None: it is). "verdicts" holds every verdict by key."""
    out, verdicts = judge(results, dense_rate)
    return {**out, "verdicts": {key: v.as_dict() for key, v in verdicts.items()}}


def format_findings(f: dict[str, Any]) -> list[str]:
    """The headline of `findings` as report lines: the best models per budget and their
    verdicts, the matching MoD, the causal gap, routing accuracy and the ablations."""
    verdicts = f["verdicts"]
    lines = [
        "## Headline",
        "",
        "MoD is judged by its causal-mode loss (what generation gets); losses are the mean over "
        "seeds where a second seed ran. Seed spread: the largest |seed 0 - seed 1| at that budget. "
        "Verdict: the best MoD against the best dense by `mixture_of_depths.studies.verdict`, on "
        "the seeds both trained, against the wider of their two seed ranges.",
        "",
        "| budget | best dense | params | FLOPs/fwd tok | tok/s | loss | best MoD | params | "
        "FLOPs/fwd tok | tok/s | loss top-k | loss causal | MoD vs dense | seed spread | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b in f["budgets"]:
        d, m = b["best_dense"], b["best_mod"]
        sp = "-" if b["seed_spread"] is None else f"{b['seed_spread']:.4f}"
        lines.append(
            f"| {b['budget']:.1e} | {d['label']} | {d['params'] / 1e6:.2f}M | "
            f"{d['flops_per_forward_token'] / 1e6:.2f}M | {d['tokens_per_s']:,.0f} | "
            f"{d['val_loss']:.4f} | {m['label']} | {m['params'] / 1e6:.2f}M | "
            f"{m['flops_per_forward_token'] / 1e6:.2f}M | {m['tokens_per_s']:,.0f} | "
            f"{m['val_loss_topk']:.4f} | {m['val_loss_causal']:.4f} | {-100 * b['mod_gain']:+.2f}% "
            f"loss | {sp} | {verdicts[b['verdict']]['verdict']} |"
        )
    texts = (verdicts[b["verdict"]]["text"] for b in f["budgets"])
    lines += ["", *(f"- {b['budget']:.1e}: {t}." for b, t in zip(f["budgets"], texts, strict=True))]
    lines += [
        "",
        "The MoD model with the cheapest forward among those whose causal loss comes within the "
        "budget's seed spread of the best dense loss, or below it, and its verdict against the "
        "best dense:",
        "",
    ]
    for b in f["budgets"]:
        mm = b["mod_matching"]
        if mm is None:
            lines.append(f"- {b['budget']:.1e}: no MoD model comes that close.")
        else:
            lines.append(
                f"- {b['budget']:.1e}: {mm['label']} (causal {mm['val_loss_causal']:.4f}) at "
                f"{mm['flops_per_forward_token'] / 1e6:.2f}M FLOPs per forward token, "
                f"{mm['flops_ratio_vs_best_dense']:.2f}x the best dense model's. "
                f"{verdicts[mm['verdict']]['text']}."
            )
    return lines + _format_routing(f) + _format_ablations(f)


def _format_routing(f: dict[str, Any]) -> list[str]:
    lines = []
    if "causal_gap" in f:
        g = f["causal_gap"]
        lines += [
            "",
            f"Causal-mode loss over top-k loss, MoD runs: mean {100 * g['mean']:+.2f}% "
            f"(range {100 * g['min']:+.2f}% to {100 * g['max']:+.2f}%).",
        ]
    if "routing_accuracy" in f:
        a = f["routing_accuracy"]
        lines.append(
            "The paper's routing accuracy (the share of tokens whose causal decision agrees with "
            "top-k, mean over routed layers; a router that takes no token scores 1 - capacity, "
            "and these runs logged no recall or precision of the top-k set), MoD runs: "
            f"mean {100 * a['mean']:.1f}% (range {100 * a['min']:.1f}% to {100 * a['max']:.1f}%)."
        )
    return lines


def _format_ablations(f: dict[str, Any]) -> list[str]:
    if "ablations" not in f:
        return []
    verdicts = f["verdicts"]
    lines = [
        "",
        "## Ablations (middle budget, size of the ablation runs)",
        "",
        "| variant | loss top-k | loss causal | vs baseline (causal) | the paper's routing acc. "
        "| verdict |",
        "|---|---|---|---|---|---|",
    ]
    for a in f["ablations"]:
        acc = a["routing_accuracy_mean"]
        word = verdicts[a["verdict"]]["verdict"] if "verdict" in a else ""
        lines.append(
            f"| {a['label']} | {a['val_loss_topk']:.4f} | {a['val_loss_causal']:.4f} | "
            f"{100 * a['vs_baseline_causal']:+.2f}% | {'' if acc is None else f'{acc:.1%}'} | "
            f"{word} |"
        )
    keys = [a["verdict"] for a in f["ablations"] if "verdict" in a]
    keys += [k for k in ("capacity-best", "predictor-vs-random-routing") if k in verdicts]
    return [*lines, "", *(f"- {verdicts[k]['text']}." for k in keys)]


# -- report ---------------------------------------------------------------------------------------
def _fmt_row(r: dict[str, Any]) -> str:
    acc = r.get("routing_accuracy_mean")
    return (
        f"| {r['label']} | {r['seed']} | {r['params'] / 1e6:.2f}M | "
        f"{r['flops_per_forward_token'] / 1e6:.2f}M | {r['steps']} | {r['tokens'] / 1e6:.2f}M | "
        f"{r['val_loss_topk']:.4f} | {r['val_loss_causal']:.4f} | "
        f"{'' if acc is None else f'{acc:.1%}'} | {r['tokens_per_s']:,.0f} |"
    )


_HEADER = (
    "| model | seed | params | FLOPs/fwd token | steps | tokens | val loss top-k | "
    "val loss causal | the paper's routing acc. | train tok/s |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def _seed_spread(rows: list[dict[str, Any]]) -> str:
    return ", ".join(f"{lab} {gap:.4f}" for lab, gap in seed_gaps(rows).items())


def _tables(results: list[dict[str, Any]]) -> list[str]:
    """Every run, a table per budget with its seed spread, then the ablations."""
    body: list[str] = []
    for budget in sorted({r["budget"] for r in results}):
        rows = [r for r in results if r["budget"] == budget and r["group"] in ("isoflop", "seed")]
        body += [f"## Budget {budget:.1e} FLOPs", "", _HEADER]
        body += [_fmt_row(r) for r in sorted(rows, key=lambda r: (r["label"], r["seed"]))]
        body.append("")
        spread = _seed_spread(rows)
        if spread:
            body += [f"Seed spread (|seed 0 - seed 1| of the causal loss): {spread}", ""]
    ablations = [r for r in results if r["group"] == "ablation"]
    if ablations:
        body += ["## Ablations at the middle budget", "", _HEADER]
        body += [_fmt_row(r) for r in ablations]
        body.append("")
    return body


def write_report(results: list[dict[str, Any]], out: Path, settings: StudySettings) -> None:
    """``report.md``, ``findings.json`` and the plots, from the results so far."""
    intro = [
        "# isoFLOP study: MoD against dense at equal training compute",
        "",
        f"Default corpus, byte tokenizer, sequences of {settings.seq_len} tokens, batch "
        f"{settings.batch_size}. Each run trains for floor(budget / training FLOPs per step) "
        "steps, FLOPs from `mixture_of_depths.flops.estimate_flops`. Losses are validation "
        "losses in nats per token; MoD runs are judged by the causal loss, the one generation "
        "gets. Generated by `mod study`; plots: `isoflop.png`, `ablations.png`.",
        "",
    ]
    summary = findings(results)
    atomic_write_text(
        out / "report.md",
        "\n".join([*intro, *format_findings(summary), "", *_tables(results)]) + "\n",
    )
    atomic_write_text(out / "findings.json", json_text(summary, indent=1) + "\n")
    try:
        plots(results, out)
    except Exception as exc:  # plots are a convenience; the results are already saved
        print(f"note: plots failed: {exc!r}")


# -- plots ----------------------------------------------------------------------------------------
def plots(results: list[dict[str, Any]], out: Path) -> None:
    """``isoflop.png`` (loss against size per budget) and ``ablations.png``."""
    _plot_curves(results, out)
    _plot_ablations(results, out)


def _plot_curves(results: list[dict[str, Any]], out: Path) -> None:
    iso = [r for r in results if r["group"] == "isoflop"]
    if not iso:
        return
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for i, budget in enumerate(sorted({r["budget"] for r in iso})):
        for arch, style, key in (
            ("dense", "o-", "val_loss_topk"),
            ("MoD", "s--", "val_loss_causal"),
        ):
            # Seeds averaged per size, as in the headline table.
            runs = [
                r
                for r in results
                if r["group"] in ("isoflop", "seed")
                and r["budget"] == budget
                and r["label"].startswith(arch)
            ]
            loss = mean_seeds(runs, key)
            params = {r["label"]: r["params"] for r in runs}
            labels = sorted(loss, key=params.get)
            if labels:
                ax.plot(
                    [params[lab] for lab in labels],
                    [loss[lab] for lab in labels],
                    style,
                    color=f"C{i}",
                    label=f"{arch} @ {budget:.2g} FLOPs",
                )
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("validation loss (MoD: causal; seeds averaged)")
    ax.set_title("isoFLOP curves: loss against size at fixed training FLOPs")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "isoflop.png")
    plt.close(fig)


def _plot_ablations(results: list[dict[str, Any]], out: Path) -> None:
    abl = [r for r in results if r["group"] == "ablation"]
    if not abl:
        return
    mid = abl[0]["budget"]
    ref = [r for r in results if r["group"] == "isoflop" and r["budget"] == mid]
    ref = [r for r in ref if r["label"].startswith("MoD")]
    base = [r for r in ref if r["model"]["d_model"] == abl[0]["model"]["d_model"]]
    if not base:  # no baseline run of the ablations' size yet: nothing to compare with
        return
    rows = base + abl
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4), dpi=120)
    names = [r["label"].split(", ")[-1] if ", " in r["label"] else "baseline" for r in rows]
    x = list(range(len(rows)))
    # Change of each loss against the baseline's causal loss, in %; bars beyond the axis
    # (an ablation that breaks the model) are cut and labelled with their value.
    ref_loss = rows[0]["val_loss_causal"]
    lim = 6.0
    for off, key, lab in ((-0.2, "val_loss_topk", "top-k"), (0.2, "val_loss_causal", "causal")):
        pct = [100 * (r[key] - ref_loss) / ref_loss for r in rows]
        ax.bar([i + off for i in x], [max(-lim, min(lim, p)) for p in pct], 0.4, label=lab)
        for i, p in enumerate(pct):
            if abs(p) > lim:
                ax.annotate(
                    f"{p:+.0f}%",
                    (i + off, lim if p > 0 else -lim),
                    ha="center",
                    va="bottom" if p > 0 else "top",
                    fontsize=7,
                )
    ax.axhline(0, color="black", lw=0.6)
    gaps = seed_gaps([r for r in results if r["budget"] == mid and r["group"] != "ablation"])
    if gaps:  # differences inside this band are within the seed noise of this budget
        band = 100 * max(gaps.values()) / ref_loss
        ax.axhspan(-band, band, color="grey", alpha=0.15, label="seed spread")
    ax.set_ylim(-lim * 1.15, lim * 1.15)
    ax.set_xticks(x, names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("loss vs baseline causal loss (%)")
    ax.set_title(f"ablations at {mid:.2g} FLOPs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ablations.png")
    plt.close(fig)


ISOFLOP = Plan(  # the module's globals are read at call time (tests cut the plan down)
    name="isoflop",
    settings=lambda quick: QUICK if quick else FULL,
    runs=lambda settings: plan(settings),
    report=lambda results, out, settings: write_report(results, out, settings),
    folders=Folders(str(Path(__file__).resolve().parent)),
)
