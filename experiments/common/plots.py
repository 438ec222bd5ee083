"""Figures more than one study draws: a study's arms against dense."""

from __future__ import annotations

from pathlib import Path

from mixture_of_depths.studies.plots import pyplot


def plot_vs_dense(
    groups: list[tuple[str, dict[str, float], float | None]],
    labels: list[str],
    path: Path,
    title: str,
    ylabel: str = "validation loss vs dense (%), lower is better",
    rotate: bool = False,
) -> None:
    """Bars of each label's loss against the group's dense one (%), one colour per group
    (legend, losses by label, seed spread for whiskers or None)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=120)
    width = 0.8 / max(1, len(groups))
    for i, (legend, loss, spread) in enumerate(groups):
        ref = loss["dense"]
        xs = [j + (i - (len(groups) - 1) / 2) * width for j in range(len(labels))]
        pct = [100 * (loss.get(lab, float("nan")) - ref) / ref for lab in labels]
        ax.bar(xs, pct, width, label=legend, color=f"C{i}")
        if spread is not None:
            band = 100 * spread / ref
            ax.errorbar(xs, pct, yerr=band, fmt="none", ecolor="black", lw=0.8, capsize=2)
    ax.axhline(0, color="black", lw=0.6)
    tick = dict(rotation=20, ha="right") if rotate else {}
    ax.set_xticks(range(len(labels)), labels, fontsize=8, **tick)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
