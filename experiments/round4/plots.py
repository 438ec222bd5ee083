"""round4.png: the held-out loss by place in the context of each arm's seed-0 run, dense's at
each of its rates and each MoD family at its rates, on a log axis of places."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mixture_of_depths.studies.plots import pyplot

from . import plan as p


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """One panel per family (dense and each MoD family at size S, dense at XS): every rate's
    seed-0 loss by place."""
    families = [f for f in p.FAMILIES if any((a := p.arm_key(r)) and a.family == f for r in rows)]
    if not families:
        return
    plt = pyplot()
    fig, axes = plt.subplots(1, len(families), figsize=(4 * len(families), 3.4), squeeze=False)
    for ax, family in zip(axes[0], families, strict=True):
        size = "XS" if family == "dense" else "S"
        for r in rows:
            arm = p.arm_key(r)
            prof = r.get("loss_by_position")
            if arm is None or arm.family != family or arm.size != size or r["seed"] or not prof:
                continue
            mids = [(a + b) / 2 for a, b in zip(prof["edges"], prof["edges"][1:], strict=False)]
            warm = "" if arm.lr_warmup is None else f", warm-up {arm.lr_warmup:g}"
            ax.plot(mids, prof["loss"], marker=".", label=f"lr {p.rate_tag(arm.lr)}{warm}")
        ax.set_xscale("log")
        ax.set_title(f"{family} {size}", fontsize=9)
        ax.set_xlabel("place in the context")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("held-out loss (causal)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
