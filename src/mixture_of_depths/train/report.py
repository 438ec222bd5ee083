"""What a run tells its user: the evaluation lines, the final summary, and the loss plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..probes import format_copy_probe
from .calibrate import calibration_header, format_calibration


def _pct(v: float | None, digits: int = 1) -> str:
    return "n/a" if v is None or v != v else f"{v:.{digits}%}"  # NaN: no token taken


def format_eval(step: int, ev: dict[str, Any]) -> str:
    parts = [
        f"step {step}: val loss top-k {ev['val_loss_topk']:.4f}, causal {ev['val_loss_causal']:.4f}"
    ]
    for key, label in ROUTING_COLUMNS:  # the paper's accuracy last, labelled as such
        if ev.get(key):
            parts.append(f"{label} " + ", ".join(f"L{k} {_pct(v)}" for k, v in ev[key].items()))
    if ev.get("expert_take_rate"):
        rate = ", ".join(f"L{k} {v:.1%}" for k, v in ev["expert_take_rate"].items())
        parts.append(f"tokens running a real expert {rate}")
    if ev.get("copy_probe"):
        parts.append(f"copy score {ev['copy_probe']['score']:+.3f}")
    return " | ".join(parts)


# Whether causal decisions imitate top-k (routing.decision_scores): recall and precision of the
# top-k set first; the paper's accuracy, which a router that never fires scores 1 - capacity, last.
ROUTING_COLUMNS = (
    ("routing_recall", "top-k recall"),
    ("routing_precision", "precision"),
    ("causal_take_rate", "causal take-rate"),
    ("routing_accuracy", "accuracy (paper's)"),
)
ROUTING_KEYS = ("routing_recall", "routing_precision", "routing_balanced_accuracy")
ROUTING_KEYS += ("causal_take_rate",)


def format_eval_lines(ev: dict[str, Any]) -> list[str]:
    """Validation loss in both modes, then per router: recall and precision of its causal
    decisions against the top-k set, balanced accuracy, causal take-rate, and the paper's
    routing accuracy."""
    lines = [
        f"validation loss (nats/token): top-k {ev['val_loss_topk']:.4f}   "
        f"causal {ev['val_loss_causal']:.4f}"
    ]
    if ev["routing_accuracy"]:
        lines.append(
            "causal routing against top-k, per router (recall: share of top-k's tokens taken; "
            "precision: share of taken tokens in top-k; accuracy: the paper's)"
        )
    for k, v in ev["routing_accuracy"].items():
        got = {key: ev.get(key, {}).get(k) for key in ROUTING_KEYS}  # older summaries lack some
        lines.append(
            f"  layer {k}: recall {_pct(got['routing_recall'])}, precision "
            f"{_pct(got['routing_precision'])}, balanced accuracy "
            f"{_pct(got['routing_balanced_accuracy'])}, causal take-rate "
            f"{_pct(got['causal_take_rate'])}, the paper's accuracy {v:.2%}"
        )
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
    calibrated = s.get("calibration") or {}
    if "skipped" in calibrated:
        lines.append(f"causal thresholds not calibrated: {calibrated['skipped']}")
    elif calibrated:
        lines += [calibration_header(calibrated), *format_calibration(calibrated)]
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
        for i, name in enumerate(eval_rows[-1]["routing_accuracy"]):
            steps, color = [r["step"] for r in eval_rows], f"C{i}"
            for key, style, what in (("routing_recall", "o-", "recall"),
                                     ("routing_accuracy", ":", "paper's accuracy")):  # fmt: skip
                got = [r.get(key, {}).get(name) for r in eval_rows]  # null: none in the set
                got = [float("nan") if v is None else 100 * v for v in got]
                ax.plot(steps, got, style, color=color, label=f"layer {name} {what}")
        ax.set_xlabel("step")
        ax.set_ylabel("%")
        ax.set_title("causal decision vs top-k: recall of the top-k set (paper's accuracy dotted)",
                     fontsize=9)  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = png_path.with_name(f".{png_path.name}.tmp")  # a kill leaves it for the next start
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(png_path)
