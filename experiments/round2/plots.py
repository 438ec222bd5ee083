"""The second round's figures: routing diagnostics during training (``diagnosis.png``) and the
isoFLOP curves of each context (``isoflop.png``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mixture_of_depths.studies.plots import pyplot


def _diag_series(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Per diagnostic, (step, mean over routers) at each evaluation; and the training aux loss."""
    series: dict[str, list[tuple[int, float]]] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if "routing_diag" in rec:
            diag = rec["routing_diag"]
            for key in next(iter(diag.values())):
                vals = [v[key] for v in diag.values() if v[key] is not None]
                if vals:
                    series.setdefault(key, []).append((rec["step"], sum(vals) / len(vals)))
        if "aux_loss" in rec and "loss" in rec:
            series.setdefault("aux_loss", []).append((rec["step"], rec["aux_loss"]))
    return series


DIAG_PANELS = (
    ("r_std", "router weight r: std over tokens"),
    ("topk_boundary", "top-k boundary: k-th largest r"),
    ("gate_chosen_mean", "gate g(r) of the chosen tokens"),
    ("topk_flips", "top-k decisions changed since last eval"),
    ("causal_take_rate", "causal take-rate"),
    ("aux_loss", "aux loss (BCE, training)"),
)


def plot_diagnosis(results: list[dict[str, Any]], out: Path) -> None:
    """Per diagnostic panel, each routed ablation's seed 0 over its training steps."""
    runs = [r for r in results if r["group"] == "ablation" and r["seed"] == 0]
    runs = [r for r in runs if r["model"].get("layer_pattern") != "D"]
    if not runs:
        return
    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5), dpi=100)
    for i, r in enumerate(runs):
        path = out / "metrics" / f"{r['name']}.jsonl"
        if not path.exists():
            continue
        series = _diag_series(path)
        for ax, (key, title) in zip(axes.flat, DIAG_PANELS, strict=True):
            pts = series.get(key, [])
            if key == "aux_loss" and len(pts) > 20:  # smooth the noisy per-step loss
                w = max(1, len(pts) // 20)
                pts = [(pts[j][0], sum(v for _, v in pts[j : j + w]) / w) for j in
                       range(0, len(pts) - w + 1, w)]  # fmt: skip
            if pts:
                style = "--" if "random" in r["label"] else "-"
                ax.plot(*zip(*pts, strict=True), style, color=f"C{i % 10}", label=r["label"])
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("routing during training (seed 0, mean over routers)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "diagnosis.png")
    plt.close(fig)


def plot_grid(
    results: list[dict[str, Any]], out: Path, contexts: tuple[tuple[int, int], ...]
) -> None:
    """The isoFLOP curves, one panel per context: loss against parameters, per budget."""
    plt = pyplot()
    from matplotlib import ticker

    fig, axes = plt.subplots(
        1, len(contexts), figsize=(6 * len(contexts), 5.2), dpi=110, squeeze=False
    )
    for ax, (seq_len, _) in zip(axes[0], contexts, strict=True):
        rows = [r for r in results if r["group"] in ("isoflop", "seed") and r["seq_len"] == seq_len]
        for j, budget in enumerate(sorted({r["budget"] for r in rows})):
            for arch, style in (("dense", "s--"), ("MoD", "o-")):
                pts: dict[float, list[float]] = {}
                for r in rows:
                    if r["budget"] == budget and r["label"].startswith(arch + " "):
                        pts.setdefault(r["params"], []).append(r["val_loss_causal"])
                if pts:
                    xs = sorted(pts)
                    ax.plot(xs, [sum(pts[x]) / len(pts[x]) for x in xs], style, color=f"C{j}",
                            label=f"{arch} @ {budget:.2g}")  # fmt: skip
        ax.set_xscale("log")
        # 1-2-5 ticks labelled in millions: log axes' default minor labels overlap at this span
        ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x / 1e6:g}M"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel("parameters")
        ax.set_ylabel("validation loss (MoD: causal)")
        ax.set_title(f"{seq_len} tokens of context")
        ax.grid(alpha=0.3)
        # under the axes: inside, a legend of six entries hides the points it names
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
    fig.tight_layout()
    fig.savefig(out / "isoflop.png")
    plt.close(fig)
