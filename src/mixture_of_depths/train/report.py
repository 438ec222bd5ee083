"""What a run tells its user: the evaluation lines, the final summary, and the loss plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..probes import format_copy_probe


def format_eval(step: int, ev: dict[str, Any]) -> str:
    parts = [
        f"step {step}: val loss top-k {ev['val_loss_topk']:.4f}, causal {ev['val_loss_causal']:.4f}"
    ]
    if ev["routing_accuracy"]:
        acc = ", ".join(f"L{k} {v:.1%}" for k, v in ev["routing_accuracy"].items())
        parts.append(f"routing accuracy {acc}")
    if ev["causal_take_rate"]:
        take = ", ".join(f"L{k} {v:.1%}" for k, v in ev["causal_take_rate"].items())
        parts.append(f"causal take-rate {take}")
    if ev.get("expert_take_rate"):
        rate = ", ".join(f"L{k} {v:.1%}" for k, v in ev["expert_take_rate"].items())
        parts.append(f"tokens running a real expert {rate}")
    if ev.get("copy_probe"):
        parts.append(f"copy score {ev['copy_probe']['score']:+.3f}")
    return " | ".join(parts)


def format_eval_lines(ev: dict[str, Any]) -> list[str]:
    """Validation loss in both modes, then routing accuracy and take-rate per router."""
    lines = [
        f"validation loss (nats/token): top-k {ev['val_loss_topk']:.4f}   "
        f"causal {ev['val_loss_causal']:.4f}"
    ]
    for k, v in ev["routing_accuracy"].items():
        take = ev["causal_take_rate"].get(k)
        extra = f", causal take-rate {take:.1%}" if take is not None else ""
        lines.append(f"routing accuracy layer {k}: {v:.2%}{extra}")
    if ev.get("expert_take_rate"):
        rate = ", ".join(f"L{k} {v:.1%}" for k, v in ev["expert_take_rate"].items())
        lines.append(f"tokens running a real expert (causal forward): {rate}")
    if ev.get("prefill_calibration"):
        pc = ev["prefill_calibration"]
        lines.append(
            f"prefill calibration (teacher-forced second half): causal prefill "
            f"{pc['loss_causal_prefill']:.4f}, top-k prefill {pc['loss_topk_prefill']:.4f} "
            f"({pc['loss_gap']:+.4f}); prompt decisions that differ {pc['decisions_differ']:.1%}"
        )
    if ev.get("train_expert_share"):
        share = ", ".join(f"L{k} {v:.1%}" for k, v in ev["train_expert_share"].items())
        lines.append(f"expert slots run in training (mean over logged steps): {share}")
    if ev.get("copy_probe"):
        lines.append(format_copy_probe(ev["copy_probe"]))
    return lines


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"trained {s['steps']} steps, {s['tokens']:,} tokens in {s['train_time_s']:.0f} s "
        f"({s['params'] / 1e6:.2f}M parameters, layers {s['layer_kinds']}, "
        f"capacity {s['capacity']})",
        *format_eval_lines(s),
    ]
    lines.append(f"checkpoint: {s['checkpoint']}")
    if "plot" in s:
        lines.append(f"loss curve: {s['plot']}")
    return "\n".join(lines)


def mean_expert_share(metrics_path: Path) -> dict[str, float]:
    """Per expert layer, the mean over the logged training steps of the share of slots that ran
    a real expert (read from the log, so a resumed run counts its steps before the resume)."""
    sums: dict[str, float] = {}
    n = 0
    for line in metrics_path.read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if "expert_share" in rec:
            n += 1
            for k, v in rec["expert_share"].items():
                sums[k] = sums.get(k, 0.0) + v
    return {k: v / n for k, v in sums.items()}


def plot_metrics(metrics_path: Path, png_path: Path) -> None:
    """Training and validation loss curves to a PNG (matplotlib, headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train_rows = [r for r in rows if "lm_loss" in r]
    eval_rows = [r for r in rows if "val_loss_topk" in r]
    routed = bool(eval_rows and eval_rows[-1]["routing_accuracy"])
    fig, axes = plt.subplots(
        1, 2 if routed else 1, figsize=(12 if routed else 7, 4), dpi=120, squeeze=False
    )
    ax = axes[0, 0]
    ax.plot(
        [r["step"] for r in train_rows],
        [r["lm_loss"] for r in train_rows],
        lw=1,
        label="train LM loss (top-k)",
    )
    for key, style in (("val_loss_topk", "o-"), ("val_loss_causal", "s--")):
        ax.plot(
            [r["step"] for r in eval_rows],
            [r[key] for r in eval_rows],
            style,
            label=key.replace("_", " "),
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    if routed:  # causal decision vs top-k, per router: how honest causal sampling will be
        ax = axes[0, 1]
        for name in eval_rows[-1]["routing_accuracy"]:
            ax.plot(
                [r["step"] for r in eval_rows],
                [100 * r["routing_accuracy"].get(name, float("nan")) for r in eval_rows],
                "o-",
                label=f"layer {name}",
            )
        ax.set_xlabel("step")
        ax.set_ylabel("routing accuracy (%)")
        ax.set_title("causal decision vs top-k membership", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    tmp = png_path.with_name(f".{png_path.name}.tmp")  # a kill leaves it for the next start
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(png_path)
