"""Calibrating a trained model on held-out validation windows: what `mod calibrate` does to a
checkpoint and `mod train` does at the end of a run (unless --no-calibrate).

The windows are the run's validation text cut as `mod calibrate` cuts it by default (the run's
batch size and length, `BATCHES` batches), split by `calibrate.fit_and_held`: alternate batches
fit the thresholds (`calibrate.fit_thresholds`), the others measure take-rates, routing scores
and the causal loss before and after, so the figures reported are on windows the fit never saw.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm

from ..calibrate import fit_and_held, fit_thresholds, nothing_to_calibrate, set_config, targets
from ..config import MoDConfig
from ..data import eval_batches
from ..model import MoDTransformer
from .config import TrainConfig
from .evaluate import evaluate

# Validation batches a calibration reads (`mod calibrate --batches`): take-rates vary much from
# one batch to the next, so more than a run's usual evaluation.
BATCHES = 32
MEASURED = ("take_rate", "routing_recall", "routing_precision", "routing_accuracy")

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def calibrate_model(
    model: MoDTransformer, batches: Batches, device: torch.device, progress: bool = False
) -> dict[str, Any]:
    """Fit `model`'s causal thresholds on half of `batches` (set in its config) and return them
    with the take-rates, routing scores and causal loss on the other half before and after,
    per router (`MEASURED`). `progress`: a bar on stderr, when stderr is a terminal."""
    cfg = model.config
    reason = nothing_to_calibrate(cfg)
    if reason:
        raise ValueError(f"calibrating thresholds: {reason}")
    fit, held = fit_and_held(batches)
    total = 2 * len(held) + cfg.n_routers * len(fit)
    shown = None if progress else True  # None: on a terminal only
    bar = tqdm(total=total, desc="calibrating", unit="batch", disable=shown, leave=False)
    try:
        before = _measure(model, held, device, bar.update)
        thresholds = fit_thresholds(model, [x for x, _ in fit], on_batch=bar.update)
        after = _measure(model, held, device, bar.update)
    finally:
        bar.close()
    names = list(after["take_rate"])
    return {
        "capacity": cfg.capacity,
        "target_take_rate": dict(zip(names, targets(cfg), strict=True)),
        "thresholds": dict(zip(names, thresholds, strict=True)),
        "batches": {"fit": len(fit), "held_out": len(held)},
        "before": before,
        "after": after,
    }


def _measure(
    model: MoDTransformer, batches: Batches, device: torch.device, tick: Callable[[], Any]
) -> dict[str, Any]:
    ev = evaluate(model, batches, device, on_batch=tick)
    return {
        "take_rate": ev["causal_take_rate"],
        **{k: ev[k] for k in MEASURED[1:]},
        "val_loss_causal": ev["val_loss_causal"],
    }


def uncalibrated(config: MoDConfig, trainer_state: dict[str, Any] | None) -> MoDConfig:
    """The config a run trained with, from its checkpoint's: a run calibrated at its end keeps
    the thresholds it had before (``trainer.json``'s ``calibration``), so a resumed run
    evaluates as the uninterrupted one did until it calibrates again."""
    saved = (trainer_state or {}).get("calibration")
    if not isinstance(saved, dict) or "uncalibrated" not in saved:
        return config
    return dataclasses.replace(config, causal_thresholds=tuple(saved["uncalibrated"] or ()))


def _pct(v: float | None) -> str:
    return "n/a" if v is None or v != v else f"{v:.1%}"  # NaN precision: nothing taken


def format_calibration(r: dict[str, Any]) -> list[str]:
    """Per router: target, threshold, and on the held-out windows the take-rate, recall,
    precision and the paper's accuracy before -> after; then the causal loss there."""
    b, a = r["before"], r["after"]
    lines = []
    for name, thr in r["thresholds"].items():
        take, rec, prec, acc = (f"{_pct(b[k][name])} -> {_pct(a[k][name])}" for k in MEASURED)
        lines.append(
            f"  router {name}: target {r['target_take_rate'][name]:.1%}, threshold {thr:+.4f}: "
            f"causal take-rate {take}, recall {rec}, precision {prec}, the paper's accuracy {acc}"
        )
    lines.append(
        f"  causal validation loss there {b['val_loss_causal']:.4f} -> {a['val_loss_causal']:.4f}"
    )
    return lines


def calibration_header(r: dict[str, Any]) -> str:
    n = r["batches"]
    return (
        f"causal thresholds fitted to each router's capacity on {n['fit']} validation batches, "
        f"before -> after on {n['held_out']} others held out from the fit:"
    )


def calibration_set(
    tc: TrainConfig, config: MoDConfig, val_tokens: torch.Tensor, seq_len: int
) -> tuple[Batches, str | None]:
    """With `tc.calibrate`, the windows a run's end calibrates on (those `mod calibrate` reads
    by default on its checkpoint), or why there is nothing to calibrate; known at the start, so
    that a run says so before it trains rather than after."""
    if not tc.calibrate:
        return [], None
    reason = nothing_to_calibrate(config)
    if reason:
        return [], reason
    batches = eval_batches(val_tokens, tc.batch_size, seq_len, BATCHES)
    if len(batches) < 2:
        return [], (
            f"the validation text gives {len(batches)} batch of {tc.batch_size} x {seq_len} "
            "tokens and calibration needs 2 (one fits, one measures): not calibrated"
        )
    return batches, None


def restore_uncalibrated(
    model: MoDTransformer, config: MoDConfig, trainer_state: dict[str, Any] | None
) -> MoDConfig:
    """`uncalibrated` set on `model` too (its modules hold the config)."""
    cfg = uncalibrated(config, trainer_state)
    if cfg != config:
        set_config(model, causal_thresholds=cfg.causal_thresholds)
    return cfg
