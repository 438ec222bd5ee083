"""`mod flops` and `mod presets`: what a model costs, per layer and beside its dense twin, and
the presets to start from."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from ..checks import Range
from ..config import PRESETS, MoDConfig
from ..fileio import json_text
from ..flops import estimate_flops, format_report
from ..model import MoDTransformer
from ..runtime.checkpoint import load_config
from .flags import (
    DEFAULT_PRESET,
    ShowDefaults,
    add_checkpoint,
    add_dataclass_flags,
    add_preset_flag,
    checkpoint_arg,
    given,
)


def add_flops(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="FLOPs per layer and KV-cache bytes, beside the dense twin",
        formatter_class=ShowDefaults,
        description="Analytic FLOPs of a model (training, top-k forward, decode) per layer, "
        "counted the way torch's FlopCounterMode counts them, beside its dense twin.",
    )
    add_checkpoint(p, "take the model config from a checkpoint (default: --preset's)")
    add_preset_flag(p)
    p.add_argument("--seq-len", type=int, default=None, help="(default: the model's max_seq_len)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per forward")
    p.add_argument(
        "--take-rate",
        type=float,
        default=None,
        help="share of generated tokens taking each routed layer (default: capacity)",
    )
    p.add_argument(
        "--decode-context",
        type=int,
        default=None,
        help="context length for the decode estimate (default: --seq-len)",
    )
    p.add_argument(
        "--expert-share",
        type=float,
        default=None,
        help="expert layers: share of token slots that run a real expert (default: the bound, "
        "1 or the capacity factor's)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_dataclass_flags(
        p.add_argument_group("model (MoDConfig fields)"),
        MoDConfig,
        skip={"max_seq_len", "causal_thresholds"},
        preset=True,
    )


def add_presets(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help="list the model presets")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run_flops(args: argparse.Namespace) -> int:
    for flag, value in (("--seq-len", args.seq_len), ("--batch-size", args.batch_size)):
        Range(lo=1, integer=True, optional=True).check(flag, value)  # the flag, not the field
    ckpt = checkpoint_arg(args, "flops", required=False)
    if ckpt is not None:
        cfg = load_config(ckpt)
    else:
        cfg = MoDConfig.preset(args.preset or DEFAULT_PRESET, **given(args, MoDConfig))
    report = estimate_flops(
        cfg,
        cfg.max_seq_len if args.seq_len is None else args.seq_len,
        args.batch_size,
        take_rate=args.take_rate,
        decode_context=args.decode_context,
        expert_share=args.expert_share,
    )
    print(json_text(report.to_dict()) if args.json else format_report(report))
    return 0


def run_presets(args: argparse.Namespace) -> int:
    rows = {}
    for name in sorted(PRESETS):
        cfg = MoDConfig.preset(name)
        with torch.device("meta"):
            n = MoDTransformer(cfg).num_params()
        rows[name] = {**PRESETS[name], "params": n}
    if args.json:
        print(json_text(rows))
    else:
        for name, row in rows.items():
            cfg = MoDConfig.preset(name)
            print(
                f"{name:21s} {row['params'] / 1e6:6.2f}M params  d_model={cfg.d_model} "
                f"n_layers={cfg.n_layers} n_heads={cfg.n_heads}/{cfg.n_kv_heads} "
                f"max_seq_len={cfg.max_seq_len} layers={cfg.layer_kinds}" + _preset_extras(cfg)
            )
    return 0


def _preset_extras(cfg: MoDConfig) -> str:
    """What a preset sets beyond its shape: routing, experts, recursion."""
    out = []
    if cfg.routed_layers:
        out.append(f"capacity={cfg.capacity:g}")
        if cfg.routing != "joint":
            out.append(f"routing={cfg.routing}")
    if cfg.has_experts:
        out.append(
            f"experts={cfg.n_experts}+{cfg.n_noop_experts} no-op top-{cfg.experts_per_token} "
            f"d_ff_expert={cfg.d_ff_expert}"
        )
        if cfg.expert_capacity_factor is not None:
            out.append(f"expert_capacity_factor={cfg.expert_capacity_factor}")
    if cfg.recursive:
        steps = ",".join(f"{c:g}" for c in cfg.recursion_capacities or ())
        out.append(
            f"recursions={cfg.recursions} ({cfg.recursion_sharing}, {cfg.recursion_router} "
            f"choice{', steps ' + steps if steps else ''}, recursion_kv={cfg.recursion_kv})"
        )
    return "".join(" " + x for x in out)
