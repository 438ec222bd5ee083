"""`mod study experiments/mode`: Mixture-of-Depths-and-Experts at equal training FLOPs.

At each budget, one model shape trained as: dense; MoD (every other block routed, 12.5%); MoE (4
SwiGLU experts of the dense MLP's size, token-choice top-1: the same active parameters as dense);
MoE with capacity factor 0.5 (the overflow dropped in training); staged MoDE (MoD's routing with
MoE's experts); integrated MoDE (4 real + 4 no-op experts); and integrated MoDE with the same
capacity factor 0.5 as the dropping baseline. What each claim compares (its baseline and its best
MoDE variant) trains again with a second seed, and each claim is judged by the verdict module
(`verdict.compare`: the difference against the seed spread of those two runs, the one size and
learning rate every model trained at named for both sides). The paper's two claims
(arXiv:2404.02258, section 3.6): MoDE improves on MoE, and integrated MoDE beats lowering the
capacity and dropping.

FLOPs: each run trains for floor(budget / training FLOPs per step), counted by `estimate_flops`
with its default expert share, the bound: every slot runs a real expert, or at most the
capacity's share. No run is charged less than it can spend, so no variant buys steps with
compute it might not save; integrated MoDE without a capacity is charged as MoE is (its no-op
savings are learned, not guaranteed), and the variant with capacity 0.5 is charged exactly what
the dropping baseline is. What each run actually spent (from the shares it logged) is reported
beside it. Runs and resumption are `runner.study`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mixture_of_depths.fileio import atomic_write_text, json_text
from mixture_of_depths.studies.runner import (
    AUX_ROUTING,
    Folders,
    Plan,
    RunSpec,
    StudySettings,
    budget_tag,
    mean_seeds,
    second_seed,
    seed_gaps,
)
from mixture_of_depths.studies.verdict import Arm, best_of, compare

from ..common.plots import plot_vs_dense

EXPERTS = dict(n_experts=4, experts_per_token=1)
ARCHS: tuple[tuple[str, str, dict[str, Any]], ...] = (  # (label, name tag, MoDConfig overrides)
    ("dense", "dense", dict(layer_pattern="D")),
    ("MoD", "mod", dict(layer_pattern="DR", capacity=0.125, **AUX_ROUTING)),
    ("MoE", "moe", dict(layer_pattern="D", **EXPERTS)),
    (
        "MoE, capacity 0.5 (drops)",
        "moe-drop",
        dict(layer_pattern="D", **EXPERTS, expert_capacity_factor=0.5),
    ),
    ("staged MoDE", "staged", dict(layer_pattern="DR", capacity=0.125, **AUX_ROUTING, **EXPERTS)),
    ("integrated MoDE", "integrated", dict(layer_pattern="D", **EXPERTS, n_noop_experts=4)),
    (
        "integrated MoDE, capacity 0.5",
        "integrated-cap",
        dict(layer_pattern="D", **EXPERTS, n_noop_experts=4, expert_capacity_factor=0.5),
    ),
)

# The isoFLOP study's best size at these budgets (experiments/isoflop/report.md: XS at 5e12 and
# 1.6e13).
FULL = StudySettings(
    budgets=(5e12, 1e13),
    sizes=(("XS", dict(d_model=64, n_layers=4, n_heads=4)),),
    seq_len=256,
    batch_size=16,
    eval_every_runs=2,
    eval_batches=8,
    base=dict(max_seq_len=256),
    ablation_size="XS",
)

QUICK = StudySettings(
    budgets=(2e9, 6e9),
    sizes=(("S", dict(d_model=32, n_layers=2, n_heads=2)),),
    seq_len=32,
    batch_size=4,
    eval_every_runs=1,
    eval_batches=1,
    base=dict(max_seq_len=32),
    ablation_size="S",
)


def plan(settings: StudySettings) -> list[RunSpec]:
    """Every architecture at every budget, one size (second seeds come once a budget is done)."""
    size, shape = settings.sizes[0]
    return [
        RunSpec(
            name=f"{budget_tag(budget)}-{tag}-{size}-s0",
            group="isoflop",
            label=label,
            budget=budget,
            model={**settings.base, **shape, **over},
        )
        for budget in settings.budgets
        for label, tag, over in ARCHS
    ]


def seed_specs(results: list[dict[str, Any]], budget: float) -> list[RunSpec]:
    """Second seeds for what each claim compares: its baseline and its best MoDE variant (by the
    first seed's loss), so each verdict weighs its own difference against those runs' spread."""
    first = {r["label"]: r for r in results if r["budget"] == budget and r["seed"] == 0}
    labels: list[str] = []
    for _, _, contenders, base in CLAIMS:
        have = [c for c in contenders if c in first]
        if base in first and have:
            best = min(have, key=lambda c: judged_loss(first[c]))
            labels += [lab for lab in (base, best) if lab not in labels]
    return [second_seed(first[lab]) for lab in labels]


def judged_loss(r: dict[str, Any]) -> float:
    """The loss a model is judged by: causal where MoD routing makes it differ (what generation
    gets); for the others both modes are one computation (no dropping outside training)."""
    return r["val_loss_causal"]


# -- findings --------------------------------------------------------------------------------------
# (key of its verdicts, claim, its MoDE variants, its baseline)
CLAIMS = (
    ("mode-vs-moe", "MoDE improves on MoE", ("staged MoDE", "integrated MoDE"), "MoE"),
    (
        "integrated-vs-dropping",
        "integrated MoDE beats MoE that drops at capacity 0.5",
        ("integrated MoDE, capacity 0.5", "integrated MoDE"),
        "MoE, capacity 0.5 (drops)",
    ),
    # Ours, not the paper's: a MoDE variant runs MoD's routing, so it takes MoD's extra steps;
    # whether the experts add anything beyond them is this comparison (plain MoD's second seed).
    (
        "mode-vs-mod",
        "MoDE improves on plain MoD (its gain is more than MoD's extra steps)",
        ("staged MoDE", "integrated MoDE"),
        "MoD",
    ),
)
# TrainConfig's peak learning rate when these runs trained (their rows name none: the default),
# pinned so that a later default does not rewrite the report
DEFAULT_LR = 2e-3


def rate_text(lr: float) -> str:
    """A learning rate as the report writes it: 0.002 -> "2e-3"."""
    return f"{lr:.0e}".replace("e-0", "e-").replace("e+0", "e")


def arm(rows: list[dict[str, Any]], label: str) -> Arm:
    """`label`'s runs at one budget as an `Arm`: its loss per seed, the edge of the sizes it
    trained at (`best_of`: one here, the isoFLOP study's best dense size) and of its learning
    rates at that size (one, TrainConfig's, for every model: not bracketed)."""
    mine = [r for r in rows if r["label"] == label]
    sizes: dict[str, dict[int, float]] = {}
    for r in sorted(mine, key=lambda r: r["model"]["d_model"]):
        size = r["name"].rsplit("-", 2)[-2]  # <budget>-<tag>-<size>-s<seed>
        sizes.setdefault(size, {})[r["seed"]] = judged_loss(r)
    size, edge = best_of(list(sizes.items()))
    rates: dict[float, dict[int, float]] = {}
    for r in mine:
        if r["name"].rsplit("-", 2)[-2] == size:
            rates.setdefault(r.get("lr") or DEFAULT_LR, {})[r["seed"]] = judged_loss(r)
    grid = [(rate_text(lr), seeds) for lr, seeds in sorted(rates.items())]
    rate, open_end = best_of(grid, "learning rate", ("lowest", "highest"))
    return Arm(f"{label} ({size})", dict(grid)[rate], edge, open_end)


def findings(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per budget: each architecture's loss (mean over seeds), its seeds, the largest seed
    spread, and each claim: the better of its MoDE variants (by mean loss) against its
    baseline, judged by `verdict.compare` (its verdict under "verdicts", by key)."""
    sizes = sorted({r["name"].rsplit("-", 2)[-2] for r in results})
    rates = [rate_text(lr) for lr in sorted({r.get("lr") or DEFAULT_LR for r in results})]
    out: dict[str, Any] = {"sizes": sizes, "learning_rates": rates, "budgets": [], "verdicts": {}}
    for budget in sorted({r["budget"] for r in results}):
        rows = [r for r in results if r["budget"] == budget]
        loss = mean_seeds([{**r, "judged": judged_loss(r)} for r in rows], "judged")
        seeds = {lab: sorted(r["seed"] for r in rows if r["label"] == lab) for lab in loss}
        gaps = seed_gaps(rows)
        spread = max(gaps.values()) if gaps else None
        claims = []
        for key, text, contenders, base in CLAIMS:
            have = [c for c in contenders if c in loss]
            if base not in loss or not have:
                continue
            best = min(have, key=loss.get)
            diff = loss[base] - loss[best]  # > 0: the MoDE variant is lower
            verdict = compare(arm(rows, best), arm(rows, base))
            key = f"{key}-{budget_tag(budget)}"
            out["verdicts"][key] = verdict.as_dict()
            claims.append(
                {
                    "claim": text,
                    "best": best,
                    "best_loss": loss[best],
                    "baseline": base,
                    "baseline_loss": loss[base],
                    "gain": diff / loss[base],
                    "seed_spread": verdict.spread,
                    "verdict": key,
                }
            )
        out["budgets"].append(
            {"budget": budget, "loss": loss, "seeds": seeds, "seed_spread": spread,
             "claims": claims}
        )  # fmt: skip
    return out


def format_findings(f: dict[str, Any]) -> list[str]:
    lines = ["## The paper's claims at this scale (and whether MoDE adds to plain MoD)", ""]
    sizes, rates = ", ".join(f["sizes"]), ", ".join(f["learning_rates"])
    if len(f["sizes"]) == len(f["learning_rates"]) == 1:
        tried = (f"Every model trained at one size ({sizes}: the isoFLOP study's best dense size "
                 f"at these budgets) and one peak learning rate ({rates}): neither is bracketed "
                 "for any model, so each verdict names both for both sides")  # fmt: skip
    else:
        tried = f"Sizes tried: {sizes}; peak learning rates: {rates}"
    lines += [
        f"{tried}. Each verdict is the verdict module's (`mixture_of_depths.studies.verdict`): "
        "the MoDE variant minus its baseline, on every seed both trained, against the seed "
        "spread of the two.",
        "",
    ]
    for b in f["budgets"]:
        sp = "no second seed yet" if b["seed_spread"] is None else f"{b['seed_spread']:.4f}"
        lines.append(f"Budget {b['budget']:.1e} FLOPs (largest seed spread {sp}):")
        lines.append("")
        for c in b["claims"]:
            n_best, n_base = (len(b["seeds"][c[side]]) for side in ("best", "baseline"))
            lines.append(
                f"- {c['claim']}. The MoDE variant with the lower loss, {c['best']} "
                f"{c['best_loss']:.4f} "
                f"({_seeds(n_best)}) against {c['baseline']} {c['baseline_loss']:.4f} "
                f"({_seeds(n_base)}) ({100 * c['gain']:+.2f}%): "
                f"{f['verdicts'][c['verdict']]['text']}."
            )
        lines.append("")
    return lines


def _seeds(n: int) -> str:
    return f"{n} seed" + ("" if n == 1 else "s")


# -- report ----------------------------------------------------------------------------------------
_HEADER = (
    "| model | seed | params | FLOPs/fwd token charged | spent | steps | val loss top-k | "
    "val loss causal | train tok/s | tokens running a real expert (eval), per layer | "
    "expert slots run in training, per layer |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def _shares(d: dict[str, float] | None) -> str:
    return "" if not d else " ".join(f"{100 * v:.0f}%" for v in d.values())


def _row(r: dict[str, Any]) -> str:
    spent = r.get("flops_per_forward_token_spent", r["flops_per_forward_token"])
    return (
        f"| {r['label']} | {r['seed']} | {r['params'] / 1e6:.2f}M | "
        f"{r['flops_per_forward_token'] / 1e6:.3f}M | {spent / 1e6:.3f}M | {r['steps']} | "
        f"{r['val_loss_topk']:.4f} | {r['val_loss_causal']:.4f} | {r['tokens_per_s']:,.0f} | "
        f"{_shares(r.get('expert_take_rate'))} | {_shares(r.get('train_expert_share'))} |"
    )


def write_report(results: list[dict[str, Any]], out: Path, settings: StudySettings) -> None:
    order = {label: i for i, (label, _, _) in enumerate(ARCHS)}
    intro = [
        "# MoDE study: dense, MoD, MoE and Mixture-of-Depths-and-Experts at equal training FLOPs",
        "",
        f"Default corpus, byte tokenizer, sequences of {settings.seq_len} tokens, batch "
        f"{settings.batch_size}, one shape ({settings.sizes[0][0]}: {settings.sizes[0][1]}). "
        "Experts: 4 SwiGLU experts of the dense MLP's size, token-choice top-1 (the same "
        "active parameters as dense); integrated MoDE adds 4 no-op experts. Each run trains "
        "for floor(budget / training FLOPs per step); expert layers are charged their bound "
        "(every slot a real expert, or the capacity's share), and the FLOPs each run actually "
        "spent are beside it. Losses are validation losses in nats per token, judged by the "
        "causal one (what generation gets; equal to top-k where no MoD routing runs, since "
        "nothing drops outside training). Generated by `mod study experiments/mode`; plot: "
        "`mode.png`.",
        "",
    ]
    body: list[str] = []
    for budget in sorted({r["budget"] for r in results}):
        rows = [r for r in results if r["budget"] == budget]
        body += [f"## Budget {budget:.1e} FLOPs", "", _HEADER]
        body += [
            _row(r) for r in sorted(rows, key=lambda r: (order.get(r["label"], 99), r["seed"]))
        ]
        body.append("")
    summary = findings(results)
    atomic_write_text(
        out / "report.md", "\n".join([*intro, *format_findings(summary), *body]) + "\n"
    )
    atomic_write_text(out / "findings.json", json_text(summary, indent=1) + "\n")
    try:
        _plot(results, out, summary)
    except Exception as exc:  # plots are a convenience; the results are already saved
        print(f"note: plot failed: {exc!r}")


def _plot(results: list[dict[str, Any]], out: Path, summary: dict[str, Any]) -> None:
    budgets = [b for b in summary["budgets"] if "dense" in b["loss"]]  # the bars' reference
    labels = [label for label, _, _ in ARCHS if any(label in b["loss"] for b in budgets)]
    if not labels:
        return
    groups = [(f"{b['budget']:.2g} FLOPs", b["loss"], b["seed_spread"]) for b in budgets]
    title = "MoD, MoE and MoDE at equal training FLOPs (whiskers: seed spread)"
    plot_vs_dense(groups, labels, out / "mode.png", title, rotate=True)


PLAN = Plan(  # the module's globals are read at call time (tests cut the plan down)
    name="mode",
    settings=lambda quick: QUICK if quick else FULL,
    runs=lambda settings: plan(settings),
    report=lambda results, out, settings: write_report(results, out, settings),
    folders=Folders(str(Path(__file__).resolve().parent)),
    seeds=lambda results, budget, settings: seed_specs(results, budget),
)
