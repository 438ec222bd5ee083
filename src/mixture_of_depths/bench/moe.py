"""`mod bench --sections experts`: expert layers and MoDE against the dense twin at equal active
parameters (every expert has the dense MLP's hidden size; token-choice top-1).

- One layer, forward + backward on the same tokens: the dense SwiGLU MLP against the expert
  layer (its default path, and the expert loop where the grouped-matmul fast path runs), with no
  dropping, with capacity 0.5 and with no-op experts. The bar: at T >= 1024 the expert layer keeps
  at least 80% of its FLOP-predicted efficiency (measured speed-up over the dense MLP / the
  predicted one; the dense MLP is 100%).
- Whole models, a training step: the dense twin, MoE, MoE dropping at capacity 0.5, staged MoDE
  (MoD's routing, every other block, at the smallest --capacities) and integrated MoDE (as many
  no-op experts as real ones).

The FLOPs of an expert layer depend on how many slots ran a real expert: each row's prediction
uses the share measured on its own input (`estimate_flops(expert_share=...)`).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm

from ..config import MoDConfig
from ..experts import ExpertMLP, grouped_mm_supported, slot_shares
from ..flops import estimate_flops
from ..layers import MLP, price
from ..model import MoDTransformer
from ..precision import autocast_for
from .common import interleaved, median_ms, spread, token_batch, train_step_fn

EXPERT_EFFICIENCY_BAR = 0.80  # the expert layer's fwd+bwd efficiency at T >= 1024
EXPERTS = dict(n_experts=4, experts_per_token=1)


def base_config(args: argparse.Namespace, seq_len: int) -> MoDConfig:
    """The preset's dense model, sized for `seq_len` (an expert preset: its dense twin)."""
    cfg = MoDConfig.preset(args.preset)
    cfg = cfg.dense_twin() if cfg.has_experts else cfg
    return dataclasses.replace(cfg, layer_pattern="D", max_seq_len=max(seq_len, cfg.max_seq_len))


def layer_configs(base: MoDConfig) -> dict[str, MoDConfig]:
    """The dense MLP and the expert layers timed against it, one layer each."""
    n = EXPERTS["n_experts"]
    return {
        "MLP": base,
        "MoE": dataclasses.replace(base, **EXPERTS),
        "MoE drop 0.5": dataclasses.replace(base, **EXPERTS, expert_capacity_factor=0.5),
        "MoE +no-ops": dataclasses.replace(base, **EXPERTS, n_noop_experts=n),
    }


def model_configs(args: argparse.Namespace, seq_len: int) -> dict[str, MoDConfig]:
    """The dense twin and the MoE / MoDE models trained against it."""
    base = base_config(args, seq_len)
    cap = min(args.capacities)
    return {
        "dense": base,
        "MoE": dataclasses.replace(base, **EXPERTS),
        "MoE drop 0.5": dataclasses.replace(base, **EXPERTS, expert_capacity_factor=0.5),
        "staged MoDE": dataclasses.replace(
            base, **EXPERTS, layer_pattern=args.layer_pattern, capacity=cap
        ),
        "integrated": dataclasses.replace(base, **EXPERTS, n_noop_experts=EXPERTS["n_experts"]),
    }


def _layer(cfg: MoDConfig, seed: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(seed)
    if not cfg.has_experts:
        return MLP(cfg).to(device).train()
    layer = ExpertMLP(cfg, 0)
    layer.reset_parameters(cfg.init_std, cfg.init_std)
    return layer.to(device).train()


def _layer_step(layer: torch.nn.Module, x: torch.Tensor, dtype: str) -> Callable[[], None]:
    xg = x.clone().requires_grad_(True)

    def step() -> None:
        with autocast_for(x.device, dtype):
            y = layer(xg, drop=True)[0] if isinstance(layer, ExpertMLP) else layer(xg)
        y.backward(torch.ones_like(y))
        xg.grad = None
        for p in layer.parameters():
            p.grad = None

    return step


@torch.no_grad()
def _share(layer: torch.nn.Module, x: torch.Tensor) -> float:
    """The share of slots that ran a real expert on `x` (training forward: the capacity drops)."""
    return float(layer.choose(x, drop=True).kept.float().mean())


def bench_layers(
    args: argparse.Namespace, device: torch.device, sync: Callable, bar: tqdm
) -> list[dict[str, Any]]:
    """Each expert layer (and its loop path where grouped matmul runs) against the dense MLP."""
    rows = []
    for seq_len in args.seq_lens:
        batch = args.tokens // seq_len
        base = base_config(args, seq_len)
        gen = torch.Generator().manual_seed(args.seed)
        x = torch.randn(batch, seq_len, base.d_model, generator=gen).to(device)
        fns, flops, shares, paths = {}, {}, {}, {}
        for name, cfg in layer_configs(base).items():
            layer = _layer(cfg, args.seed, device)
            # The share and the fast path's support as the timed step sees them: under autocast.
            with autocast_for(device, args.dtype):
                share = _share(layer, x) if cfg.has_experts else 1.0
                grouped = isinstance(layer, ExpertMLP) and grouped_mm_supported(
                    x, layer.w13, layer.w2
                )
            fwd = price(cfg, 0, batch * seq_len, 0, expert_share=share).flops
            variants = [(name, True)]
            if grouped:
                variants.append((f"{name} (loop)", False))  # the reference path beside it
            for label, grouped in variants:
                if isinstance(layer, ExpertMLP):
                    layer = _layer(cfg, args.seed, device)
                    layer.use_grouped_mm = grouped
                    paths[label] = "grouped_mm" if grouped and len(variants) > 1 else "loop"
                else:
                    paths[label] = "dense"
                fns[label] = _layer_step(layer, x, args.dtype)
                flops[label], shares[label] = 3 * fwd, share
        bar.set_postfix_str(f"experts layer T={seq_len}")
        times = interleaved(fns, args.warmup, args.repeats, sync, bar)
        dense_ms = median_ms(times["MLP"])
        for label in fns:
            ms = median_ms(times[label])
            predicted = flops["MLP"] / flops[label]
            rows.append(
                {
                    "seq_len": seq_len,
                    "batch_size": batch,
                    "model": label,
                    "path": paths[label],
                    "expert_share": None if label == "MLP" else shares[label],
                    "ms": ms,
                    "speedup": dense_ms / ms,
                    "speedup_flop_predicted": predicted,
                    "efficiency": dense_ms / ms / predicted,
                    "range_rel": spread(times[label]),
                }
            )
    return rows


def bench_models(
    args: argparse.Namespace,
    device: torch.device,
    sync: Callable,
    bar: tqdm,
) -> list[dict[str, Any]]:
    """A training step of each of `model_configs` against the dense twin, at each length."""
    rows = []
    for seq_len in args.seq_lens:
        batch = args.tokens // seq_len
        idx, targets = token_batch(args, batch, seq_len, device)
        fns, flops, shares = {}, {}, {}
        for name, cfg in model_configs(args, seq_len).items():
            torch.manual_seed(args.seed)
            model = MoDTransformer(cfg).to(device).train()
            share = None
            if cfg.has_experts:
                with torch.no_grad(), autocast_for(device, args.dtype):
                    share = slot_shares(
                        model(idx, targets, routing="topk").expert_routes, cfg.n_layers
                    )
            fns[name] = train_step_fn(model, idx, targets, args.dtype)
            rep = estimate_flops(cfg, seq_len, batch, with_dense=False, expert_share=share)
            flops[name], shares[name] = rep.train_causal, share
        bar.set_postfix_str(f"experts models T={seq_len}")
        times = interleaved(fns, args.warmup, args.repeats, sync, bar)
        dense_ms = median_ms(times["dense"])
        for name in fns:
            ms = median_ms(times[name])
            predicted = flops["dense"] / flops[name]
            sh = shares[name]
            rows.append(
                {
                    "seq_len": seq_len,
                    "batch_size": batch,
                    "model": name,
                    "expert_share": None if sh is None else sum(sh) / len(sh),
                    "ms_per_step": ms,
                    "tokens_per_s": batch * seq_len / (ms / 1e3),
                    "speedup": dense_ms / ms,
                    "speedup_flop_predicted": predicted,
                    "efficiency": dense_ms / ms / predicted,
                    "range_rel": spread(times[name]),
                }
            )
    return rows


def bars(rows: list[dict[str, Any]], min_len: int) -> dict[str, Any]:
    """The expert layer's (default path, no dropping) worst efficiency at T >= `min_len`."""
    long = [r for r in rows if r["model"] == "MoE" and r["seq_len"] >= min_len]
    if not long:
        return {}
    worst = min(r["efficiency"] for r in long)
    return {
        "expert_layer_efficiency": {
            "value": worst,
            "bar": EXPERT_EFFICIENCY_BAR,
            "pass": worst >= EXPERT_EFFICIENCY_BAR,
        }
    }
