"""The pictures of `mod inspect`: routing.png, depth_hist.png, skip_runs.png, entropy.png
(matplotlib, headless; each written atomically)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .analysis import Report, loss_by, loss_by_run, rho_text, variance_ratio_text

PICTURES = ("routing.png", "depth_hist.png", "skip_runs.png", "entropy.png")


def _save(fig: object, path: Path) -> None:
    import matplotlib.pyplot as plt

    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[arg-type]
    tmp.replace(path)


def plot(report: Report, out: Path, row_len: int, show: int = 96) -> list[Path]:
    """routing.png, depth_hist.png, skip_runs.png and entropy.png in `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, draw in zip(PICTURES, (_routing, _depth_hist, _skip_runs, _entropy), strict=True):
        fig = draw(plt, report, min(show, row_len))
        fig.tight_layout()
        _save(fig, out / name)
    return [out / name for name in PICTURES]


def _routing(plt: Any, report: Report, n: int) -> Any:
    """The routed blocks each of the first `n` tokens took, causal above top-k."""
    R = len(report.router_names)
    fig, axes = plt.subplots(2, 1, figsize=(12, 1.2 + 0.5 * R), sharex=True)
    for ax, taken, title in (
        (axes[0], report.taken, "causal"),
        (axes[1], report.taken_topk, "top-k"),
    ):
        ax.imshow(
            taken[:n].T.float().numpy(),
            aspect="auto",
            cmap="Greens",
            vmin=0,
            vmax=1,
            interpolation="nearest",
        )
        ax.set_yticks(range(R), [f"L{nm}" for nm in report.router_names])
        ax.set_title(f"routed blocks taken ({title} routing), first {n} tokens", fontsize=9)
    axes[1].set_xlabel("token position")
    return fig


def _depth_hist(plt: Any, report: Report, n: int) -> Any:
    """Blocks taken per token, beside independent coins at the same per-router rates."""
    R = len(report.router_names)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    k = [float(i) for i in range(R + 1)]
    ax.bar([i - 0.2 for i in k], report.depth_hist.tolist(), width=0.4, label="observed (causal)")
    ax.bar(
        [i + 0.2 for i in k],
        report.independent_hist.tolist(),
        width=0.4,
        label="independent coins, same rates",
    )
    ax.set_xticks(range(R + 1))
    ind = report.independence
    if ind:
        ax.set_title(
            f"variance {variance_ratio_text(report, 'independent')}, permutation p = "
            f"{ind['p_value']:.3g}",
            fontsize=9,
        )
    ax.set_xlabel("routed blocks taken per token")
    ax.set_ylabel("tokens")
    ax.legend(fontsize=8)
    return fig


def _skip_runs(plt: Any, report: Report, n: int) -> Any:
    """Tokens and mean loss by longest skip run; with a baseline, the excess loss beside."""
    runs = loss_by_run(report)
    xs = list(runs)
    has_base = report.baseline_loss is not None
    fig, axes = plt.subplots(1, 2 if has_base else 1, figsize=(11 if has_base else 6, 3.5))
    ax = axes[0] if has_base else axes
    ax.bar(xs, [runs[x]["tokens"] for x in xs], color="tab:gray")
    ax.set_xlabel("longest run of consecutive skipped routed blocks")
    ax.set_ylabel("tokens")
    ax.set_xticks(xs)
    ax2 = ax.twinx()
    ax2.plot(xs, [runs[x]["mean_loss"] for x in xs], "o-", color="tab:red", label="this model")
    if has_base:
        ax2.plot(
            xs,
            [runs[x]["mean_baseline_loss"] for x in xs],
            "s--",
            color="black",
            label="baseline, same tokens",
        )
        ax2.legend(fontsize=8, loc="upper left")
        _excess(axes[1], report, runs)
    ax2.set_ylabel("mean loss (nats)", color="tab:red")
    return fig


def _excess(ax: Any, report: Report, runs: dict[int, dict[str, float]]) -> None:
    """The excess loss over the baseline, by longest skip run and by blocks taken."""
    by_depth = loss_by(report, report.depth)
    for table, label, shift, color in (
        (runs, "by longest skip run", -0.08, "tab:red"),
        (by_depth, "by routed blocks taken", 0.08, "tab:blue"),
    ):
        ks = list(table)
        ax.errorbar(
            [k + shift for k in ks],
            [table[k]["mean_excess"] for k in ks],
            yerr=[table[k]["excess_half_width"] for k in ks],
            fmt="o",
            capsize=3,
            color=color,
            label=label,
        )
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(range(len(report.router_names) + 1))
    ax.set_xlabel("longest skip run / blocks taken")
    ax.set_ylabel("loss minus baseline's (nats)")
    ax.set_title("excess loss over the baseline, mean and 95% interval", fontsize=9)
    ax.legend(fontsize=8)


def _entropy(plt: Any, report: Report, n: int) -> Any:
    """Mean entropy and loss by blocks taken, with Spearman's rho of each."""
    R = len(report.router_names)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    depth = report.depth
    ok = ~report.loss.isnan()
    for values, label, color in (
        (report.entropy, "entropy", "tab:blue"),
        (report.loss, "loss", "tab:red"),
    ):
        means = [
            float(values[(depth == d) & ok].mean()) if ((depth == d) & ok).any() else float("nan")
            for d in range(R + 1)
        ]
        ax.plot(range(R + 1), means, "o-", label=f"mean {label}", color=color)
    rho = [rho_text(report, k) for k in ("depth_vs_entropy", "depth_vs_loss")]
    sep = ",\n" if any(r.startswith("undefined") for r in rho) else ", "  # a long title wraps
    ax.set_title(f"Spearman rho: depth~entropy {rho[0]}{sep}depth~loss {rho[1]}", fontsize=9)
    ax.set_xticks(range(R + 1))
    ax.set_xlabel("routed blocks taken")
    ax.set_ylabel("nats")
    ax.legend(fontsize=8)
    return fig
