"""Profiles of a trained model, taken from its checkpoint before its run folder is deleted
(a `rounds.Round`'s ``profile``): its loss by
place in the context (`position_profile`), its causal thresholds calibrated (`calibration`), how
far back its attention looks (`reach`), and a copy of the model kept for later measures
(`keep`)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..calibrate import causal_take_rates, fit_thresholds
from ..data import eval_batches, load_splits, load_tokenizer
from ..probes import attention_reach
from ..runtime.checkpoint import load_model
from ..train import evaluate
from ..train.evaluate import run_batches


def position_buckets(seq_len: int) -> list[int]:
    """Edges of the context's places: [0, T/64, T/16, T/4, T] (the first places, whose tokens see
    almost no context, up to the last three quarters), without empty buckets."""
    inner = {seq_len // d for d in (64, 16, 4)} - {0, seq_len}
    return [0, *sorted(inner), seq_len]


def position_profile(
    ckpt: Path,
    data: str | None,
    batch_size: int,
    seq_len: int,
    n_batches: int,
    edges: list[int] | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    """A trained model's held-out loss (causal routing) by place in the context, on the batches
    training validated on: the mean over the places in each bucket (`edges`, by default
    `position_buckets`). Loss that
    falls with the place is what the model learns from its context (repeats, copying). On the
    CPU in float32, as the study trains, the place-weighted mean of the buckets is the run's
    causal validation loss (the trainer autocasts on a GPU; this runs in float32 on the CPU),
    except under random routing, which draws its decisions anew. `device`: where the forwards
    run, in float32 there too (the GPU plan, `studies.gpu`, profiles on its GPU)."""
    model, _ = load_model(ckpt, map_location=device)
    model.eval()
    val = load_splits(data, load_tokenizer(ckpt))[1]
    sums = torch.zeros(seq_len, dtype=torch.float64)
    rows = 0
    with torch.no_grad():
        for x, y in eval_batches(val, batch_size, seq_len, n_batches):
            x, y = x.to(device), y.to(device)
            logits = model(x, routing="causal").logits.float()
            nll = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
            sums += nll.view_as(y).double().sum(0).cpu()
            rows += len(x)
    per_place = sums / rows
    edges = position_buckets(seq_len) if edges is None else edges
    return {
        "edges": edges,
        "loss": [float(per_place[a:b].mean()) for a, b in zip(edges, edges[1:], strict=False)],
    }


def place_edges(seq_len: int) -> list[int]:
    """Edges of the places the loss is profiled over: the first 8 tokens, then doubling
    buckets (8-15, 16-31, ...) up to the end of the context."""
    edges, e = [0], 8
    while e < seq_len:
        edges.append(e)
        e *= 2
    return [*edges, seq_len]


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
    # the first half fits, the second measures (round 3 began so; `mod calibrate` now
    # alternates batches, `calibrate.fit_and_held`), kept for one method across the rounds
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


KEPT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "trainer.json")


def keep(ckpt: Path, kept: Path) -> Path:
    """Copy the model of checkpoint `ckpt` (weights, config, tokenizer) to `kept`, for
    measures taken later, at a quiet moment (decode timings, probes); returns `kept`."""
    kept.mkdir(parents=True, exist_ok=True)
    for name in KEPT_FILES:
        if (ckpt / name).exists():
            shutil.copyfile(ckpt / name, kept / name)
    return kept


def kept_folder(run_folder: Path) -> Path:
    """Where a run's model is kept: beside the work folder, ``<work>-kept/<run name>``."""
    return run_folder.parent.with_name(run_folder.parent.name + "-kept") / run_folder.name


def long_context_profile(spec: Any, grid: Any, folder: Path, data: str | None) -> dict[str, Any]:
    """What rounds 3 and 4 measure of each trained model before its folder goes: the held-out
    loss by place (`place_edges`), for a routed model its causal thresholds calibrated, its
    attention's reach, and a copy of the model kept (`kept_folder`)."""
    seq_len = spec.seq_len or grid.seq_len
    ckpt = folder / "checkpoint"
    row: dict[str, Any] = {
        "loss_by_position": position_profile(
            ckpt, data, spec.batch_size or grid.batch_size, seq_len, grid.eval_batches,
            edges=place_edges(seq_len),
        )
    }  # fmt: skip
    if "R" in spec.model.get("layer_pattern", "D"):
        row["calibration"] = calibration(ckpt, data)
    row["attention_reach"] = reach(ckpt, data)
    keep(ckpt, kept_folder(folder))
    return row
