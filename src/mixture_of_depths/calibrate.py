"""Calibrated causal thresholds (`mod calibrate`): per router, the threshold on its causal score
that makes its causal take-rate on held-out text equal the capacity.

A router's causal decision is "score > threshold", the score being the aux-loss router's logit
or the predictor's (docs/semantics.md). Training teaches the score to mimic top-k membership, but
nothing makes its rate match the capacity: trained models take 6-12% of tokens where the
capacity is 12.5%, so sampling spends less compute than training planned, and the equal-FLOPs
comparison does not hold at sampling time. Fitting the thresholds moves no weight; they are
stored in the model's config (`MoDConfig.causal_thresholds`), so causal evaluation, `generate`,
the Hugging Face model and anything else that runs the forward use them.

Routers are fitted in forward order: a router's score depends on the decisions of the routers
before it (they change its input), never on its own threshold, so each is fitted exactly once
the ones before it are set.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from .config import MoDConfig
from .model import MoDTransformer
from .precision import autocast_for


def set_config(model: nn.Module, **changes: Any) -> MoDConfig:
    """Give `model` and every module of it holding the config the config with `changes`."""
    cfg = dataclasses.replace(model.config, **changes)
    model.config = cfg
    for m in model.modules():
        if isinstance(getattr(m, "cfg", None), MoDConfig):
            m.cfg = cfg
    return cfg


B = TypeVar("B")


def fit_and_held(batches: Sequence[B]) -> tuple[list[B], list[B]]:
    """Split validation batches into those that fit the thresholds and those that measure them:
    alternate batches. Evaluation windows are spread over the text in order, so both halves then
    cover all of it; the first half against the second would count a shift between parts of the
    text (other files, other code) as calibration error."""
    return list(batches[0::2]), list(batches[1::2])


def threshold_at(scores: Tensor, take: float) -> float:
    """A threshold that a share `take` of `scores` lies above, put midway across the widest gap
    between neighbouring scores near that share (within 0.1% of them, at least one), so that no
    score sits on or near it: a token whose score ties the threshold would be decided by
    round-off. Where the scores near that share are all equal, the nearest gap: the share above
    moves as little as the ties allow."""
    z = scores.flatten().double().sort().values
    n = len(z)
    if n < 2 or float(z[-1] - z[0]) == 0:
        raise ValueError(f"calibration needs at least 2 different scores, got {n} all equal")
    cut = min(max(round(n * (1 - take)), 1), n - 1)  # z[cut:] is the share above
    gaps = z[1:] - z[:-1]  # gaps[j] lies between z[j] and z[j + 1]
    reach = max(1, n // 1000)
    near = range(max(0, cut - 1 - reach), min(n - 1, cut + reach))
    j = max(near, key=lambda j: (float(gaps[j]), -abs(j + 1 - cut)))
    if float(gaps[j]) == 0:  # all tied here: the nearest gap anywhere
        j = min(torch.nonzero(gaps > 0).flatten().tolist(), key=lambda j: abs(j + 1 - cut))
    return float((z[j] + z[j + 1]) / 2)


def nothing_to_calibrate(cfg: MoDConfig) -> str | None:
    """Why `cfg` has no causal threshold to fit, or None where it has one per router."""
    if cfg.recursive and cfg.recursion_router == "token":
        return ("token-choice recursion assigns each token its depth with no threshold on a "
                "score to move: nothing to calibrate")  # fmt: skip
    if cfg.is_dense:
        experts = " (its expert layers choose by token, causal as they are)" * cfg.has_experts
        return f"the model is dense{experts}: no causal router, nothing to calibrate"
    if cfg.router_scores == "random":
        return "random router scores decide by their own noise: nothing to calibrate"
    return None


def targets(cfg: MoDConfig, take: float | None = None) -> list[float]:
    """Each router's take-rate to calibrate to: `take` if given, else its capacity (a MoD
    router's `capacity`; a recursion step's `recursion_capacities` entry, as a share of all
    tokens)."""
    if cfg.recursive and cfg.recursion_router == "token":
        raise ValueError(nothing_to_calibrate(cfg))
    if take is not None:
        return [take] * cfg.n_routers
    if cfg.recursive:
        return [cfg.recursion_capacity(r) for r in cfg.recursion_routed_steps]
    return [cfg.capacity] * cfg.n_routers


def _scores(
    model: MoDTransformer,
    batches: Sequence[Tensor],
    i: int,
    device: Any,
    on_batch: Callable[[], None] | None = None,
) -> tuple[Tensor, int]:
    """Router `i`'s causal scores (forward order of the routes) over the tokens of `batches`
    that can take it, and the number of tokens. For a recursion step those are the tokens still
    active after the step before (the decision is "active and score > threshold"); for a MoD
    router, every token."""
    out, n = [], 0
    nested = model.config.recursive and i > 0
    for x in batches:
        with autocast_for(device):
            routes = model(x.to(device), routing="causal").routes
        score = routes[i].decision_logits.detach().float()
        out.append((score[routes[i - 1].mask] if nested else score).flatten().cpu())
        n += x.numel()
        if on_batch is not None:
            on_batch()
    return torch.cat(out), n


@torch.no_grad()
def fit_thresholds(
    model: MoDTransformer,
    batches: Sequence[Tensor],
    take: float | None = None,
    on_batch: Callable[[], None] | None = None,
) -> list[float]:
    """Fit, in forward order, the threshold of every router of `model` so that its causal
    take-rate over the tokens of `batches` (token ids, (B, T) each) is `take` (default: its
    capacity, `targets`); set them on the model (its config's `causal_thresholds`) and return
    them. A recursion step continues only tokens still active, so its threshold is fitted among
    those, for its share of all tokens (below every active score when they are fewer).
    `on_batch` is called after each forward (one per router and batch): a progress bar's tick."""
    cfg = model.config
    reason = nothing_to_calibrate(cfg)
    if reason:
        raise ValueError(f"calibrating thresholds: {reason}")
    if take is not None and not 0 < take < 1:
        raise ValueError(f"take must be in (0, 1), got {take}")
    goal = targets(cfg, take)
    if not batches:
        raise ValueError("calibration needs at least one batch of held-out tokens")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    thresholds = [0.0] * cfg.n_routers
    try:
        for i in range(cfg.n_routers):
            set_config(model, causal_thresholds=tuple(thresholds))
            scores, n = _scores(model, batches, i, device, on_batch)
            share = goal[i] * n / max(len(scores), 1)  # of the tokens that can take it
            if len(scores) and share >= 1:  # fewer active than the step keeps: all continue
                thresholds[i] = float(scores.min()) - 1.0
            else:
                thresholds[i] = threshold_at(scores, share)
        set_config(model, causal_thresholds=tuple(thresholds))
    finally:
        model.train(was_training)
    return thresholds


@torch.no_grad()
def causal_take_rates(model: MoDTransformer, batches: Sequence[Tensor]) -> dict[str, float]:
    """Per router, the share of the tokens of `batches` its causal decision sends through."""
    device = next(model.parameters()).device
    sums: dict[str, float] = {}
    n = 0
    for x in batches:
        with autocast_for(device):
            routes = model(x.to(device), routing="causal").routes
        for r in routes:
            sums[r.name] = sums.get(r.name, 0.0) + float(r.mask.double().sum())
        n += x.numel()
    return {k: v / n for k, v in sums.items()}
