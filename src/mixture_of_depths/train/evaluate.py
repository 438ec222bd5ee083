"""Validation in both routing modes: top-k (what training computes) and causal (what sampling
computes), with each router's routing accuracy and causal take-rate; `mod eval` on a checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..checks import Range
from ..data import eval_batches, load_splits, load_tokenizer
from ..experts import ran_real_expert, slot_shares
from ..generate import prefill_calibration as calibrate_prefill
from ..model import MoDOutput, MoDTransformer
from ..precision import autocast_for
from ..probes import copy_probe
from ..routing import causal_takes, confusion, decision_scores
from ..runtime.checkpoint import corrupt, load_model, read_json_file, resolve_checkpoint
from ..runtime.device import resolve_device
from .config import TrainConfig


@torch.no_grad()
def evaluate(
    model: MoDTransformer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    progress: bool = False,
    on_batch: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Validation loss in top-k and causal routing; per router, how its causal decisions match
    top-k membership on the top-k forward (`routing_recall`, `routing_precision`,
    `routing_balanced_accuracy`, and the paper's `routing_accuracy`: `routing.decision_scores`,
    pooled over the batches) and the causal take-rate (the share of tokens that took it in the
    causal forward: near the capacity once the causal router has learned top-k). `progress`: a
    bar on stderr (`mod eval`; a training run has its own); `on_batch`, called after each
    batch, ticks a caller's bar instead.
    """
    was_training = model.training
    model.eval()
    sums: dict[str, float] = {"topk": 0.0, "causal": 0.0}
    counts: dict[str, torch.Tensor] = {}
    take: dict[str, float] = {}
    experts: dict[str, float] = {}
    dense = model.config.is_dense
    try:
        shown = None if progress else True  # None: on a terminal only
        for x, y in tqdm(batches, desc="evaluating", unit="batch", disable=shown, leave=False):
            x, y = x.to(device), y.to(device)
            with autocast_for(device):
                out = model(x, y, routing="topk")
            sums["topk"] += out.lm_loss.item()
            for r, t in causal_takes(out.routes):
                counts[r.name] = counts.get(r.name, 0) + confusion(t, r.target)
            if not dense:  # both modes are the same computation for a dense model
                with autocast_for(device):
                    out = model(x, y, routing="causal")
                for r in out.routes:
                    take[r.name] = take.get(r.name, 0.0) + r.mask.float().mean().item()
            sums["causal"] += out.lm_loss.item()
            _add_expert_take(experts, out)
            if on_batch is not None:
                on_batch()
    finally:
        model.train(was_training)
    n = max(1, len(batches))
    scores = {k: decision_scores(c) for k, c in counts.items()}
    pick = lambda key: {k: s[key] for k, s in scores.items()}  # noqa: E731
    return {
        "val_loss_topk": sums["topk"] / n,
        "val_loss_causal": sums["causal"] / n,
        "routing_recall": pick("recall"),
        "routing_precision": pick("precision"),
        "routing_balanced_accuracy": pick("balanced_accuracy"),
        "routing_accuracy": pick("accuracy"),
        "causal_take_rate": {k: v / n for k, v in take.items()},
        **({"expert_take_rate": {k: v / n for k, v in experts.items()}} if experts else {}),
    }


def _add_expert_take(acc: dict[str, float], out: MoDOutput) -> None:
    """Per expert layer, add the share of the sequence's tokens that ran a real expert."""
    for er in out.expert_routes:
        key = str(er.layer)
        acc[key] = acc.get(key, 0.0) + ran_real_expert(er, out.routes).float().mean().item()


def expert_slot_shares(out: MoDOutput) -> dict[str, float]:
    """Per expert layer of a forward, the share of its token slots that ran a real expert (the
    rest chose a no-op expert or were dropped): what `estimate_flops(expert_share=...)` takes."""
    shares = slot_shares(
        out.expert_routes, out.expert_routes[-1].layer + 1 if out.expert_routes else 0
    )
    return {str(er.layer): shares[er.layer] for er in out.expert_routes}


def run_batches(
    ckpt: Path,
    tokenizer: Any,
    max_seq_len: int,
    data: str | None = None,
    n_batches: int | None = None,
    batch_size: int | None = None,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """The validation batches a checkpoint's run evaluated on (its data, sequence length, batch
    size and number of batches, from ``trainer.json``; a given value overrides the run's, and
    each must be >= 1), and the sequence length."""
    for name, value in (("n_batches", n_batches), ("batch_size", batch_size)):
        Range(lo=1, integer=True, optional=True).check(name, value)
    saved: dict[str, Any] = {}
    if (ckpt / "trainer.json").exists():
        saved = read_json_file(ckpt / "trainer.json").get("train_config", {})
        if not isinstance(saved, dict):
            raise corrupt(ckpt / "trainer.json", "'train_config' must be an object")

    def run_setting(name: str, given: Any, default: Any) -> Any:
        value = given if given is not None else saved.get(name)
        return default if value is None else value

    data = run_setting("data", data, None)
    seq_len = run_setting("seq_len", None, max_seq_len)
    batch_size = run_setting("batch_size", batch_size, TrainConfig.batch_size)
    n_batches = run_setting("eval_batches", n_batches, TrainConfig.eval_batches)
    _, val_tokens, _ = load_splits(data, tokenizer)
    return eval_batches(val_tokens, batch_size, seq_len, n_batches), seq_len


def evaluate_checkpoint(
    checkpoint: str | Path,
    data: str | None = None,
    n_batches: int | None = None,
    batch_size: int | None = None,
    device: str = "auto",
    prefill_calibration: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """`mod eval`: validation loss in both modes and routing accuracy of a saved model.

    `n_batches` / `batch_size` None: the run's own (from the checkpoint), so the numbers match
    its last evaluation; a given value must be >= 1. `prefill_calibration` (MoD models): also
    `generate.prefill_calibration` on the first batch, prompts of half the sequence. The copy
    probe (`probes.copy_probe`) runs at the run's sequence length.
    """
    for name, value in (("n_batches", n_batches), ("batch_size", batch_size)):
        Range(lo=1, integer=True, optional=True).check(name, value)
    dev = resolve_device(device)
    ckpt = resolve_checkpoint(checkpoint)
    model, cfg = load_model(ckpt, map_location=dev)
    tokenizer = load_tokenizer(ckpt)
    # Evaluate as the run did: its data and its sequence length (k = floor(capacity * T)).
    batches, seq_len = run_batches(ckpt, tokenizer, cfg.max_seq_len, data, n_batches, batch_size)
    out = {"checkpoint": str(ckpt), **evaluate(model, batches, dev, progress)}
    if seq_len >= 4:  # in-context copying at the run's length
        with autocast_for(dev):
            out["copy_probe"] = copy_probe(model, length=seq_len)
    if prefill_calibration:
        if cfg.is_dense:
            raise ValueError(
                "prefill calibration compares routing decisions: a dense model has none"
            )
        x = batches[0][0]
        out["prefill_calibration"] = calibrate_prefill(model, x, max(1, x.shape[1] // 2))
    return out
