"""Running the third round: `rounds.run` with round 3's settings, plan and report, and what it
measures of each trained model before its folder is deleted (`profile`)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from ...calibrate import causal_take_rates, fit_thresholds
from ...data import load_tokenizer
from ...probes import attention_reach
from ...runtime.checkpoint import load_model
from ...train import evaluate
from ...train.evaluate import run_batches
from .. import rounds
from ..round2.profiles import position_profile
from ..runner import RunSpec
from .planning import FOLDERS, FULL, QUICK, Round3Settings, plan
from .report import write_report


def place_edges(seq_len: int) -> list[int]:
    """Edges of the places the loss is profiled over: the first 8 tokens, then doubling
    buckets (8-15, 16-31, ...) up to the end of the context."""
    edges, e = [0], 8
    while e < seq_len:
        edges.append(e)
        e *= 2
    return [*edges, seq_len]


def profile(spec: RunSpec, s: Round3Settings, folder: Path, data: str | None) -> dict[str, Any]:
    """The held-out loss by place in the context, on every validation window the run used; for a
    MoD model, its causal thresholds calibrated (`calibration`); how far back its attention
    looks (`reach`); and a copy of the model, kept
    beside the work folder (``<work>-kept/<name>``) for decode timings at a quiet moment."""
    g = s.grid
    seq_len = spec.seq_len or g.seq_len
    ckpt = folder / "checkpoint"
    row: dict[str, Any] = {
        "loss_by_position": position_profile(
            ckpt, data, spec.batch_size or g.batch_size, seq_len, g.eval_batches,
            edges=place_edges(seq_len),
        )
    }  # fmt: skip
    if "R" in spec.model.get("layer_pattern", "D"):
        row["calibration"] = calibration(ckpt, data)
    row["attention_reach"] = reach(ckpt, data)
    kept = folder.parent.with_name(folder.parent.name + "-kept") / spec.name
    kept.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "trainer.json"):
        if (ckpt / name).exists():
            shutil.copyfile(ckpt / name, kept / name)
    return row


REACH_WINDOWS = 8  # validation windows the attention reach is measured on


def reach(ckpt: Path, data: str | None) -> list[dict[str, Any]]:
    """How far back each layer's attention looks (`probes.attention_reach`, causal routing) on
    the first `REACH_WINDOWS` validation windows of the run."""
    model, cfg = load_model(ckpt)
    batches, _ = run_batches(ckpt, load_tokenizer(ckpt), cfg.max_seq_len, data)
    idx = torch.cat([x for x, _ in batches])[:REACH_WINDOWS]
    return attention_reach(model, idx)


def calibration(ckpt: Path, data: str | None) -> dict[str, Any]:
    """`mod calibrate` on the run's validation windows: thresholds fitted on the first half,
    causal take-rates and loss measured on the second, before and after."""
    model, cfg = load_model(ckpt)
    batches, _ = run_batches(ckpt, load_tokenizer(ckpt), cfg.max_seq_len, data)
    # the first half fits, the second measures (the round began so; `mod calibrate` now
    # alternates batches, `calibrate.fit_and_held`), kept for one method across the round
    fit, held = batches[: len(batches) // 2], batches[len(batches) // 2 :]

    def measure() -> dict[str, Any]:
        loss = evaluate(model, held, torch.device("cpu"))["val_loss_causal"]
        return {
            "take_rate": causal_take_rates(model, [x for x, _ in held]),
            "val_loss_causal": loss,
        }

    before = measure()
    thresholds = fit_thresholds(model, [x for x, _ in fit])
    return {"thresholds": thresholds, "before": before, "after": measure()}


# Each looks its parts up here when called, so that tests can replace them in this module.
ROUND3 = rounds.Round(
    name="round 3",
    folders=FOLDERS,
    settings=lambda quick: QUICK if quick else FULL,
    plan=lambda s, results: plan(s, results),
    report=lambda results, out, s: write_report(results, out, s),
    profile=lambda spec, s, folder, data: profile(spec, s, folder, data),
)


def run(
    out: str | Path | None = None,
    work: str | Path | None = None,
    quick: bool = False,
    data: str | None = None,
    progress: bool = True,
    max_runs: int | None = None,
    worker: int | None = None,
    poll_s: float = 10.0,
) -> list[dict[str, Any]]:
    """Run (or resume) the third round (`rounds.run`): one process, or one of several at once
    (`mod study --plan round3 --workers N`)."""
    return rounds.run(ROUND3, out, work, quick, data, progress, max_runs, worker, poll_s)
