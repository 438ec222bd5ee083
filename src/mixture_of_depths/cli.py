"""The `mod` command: train, evaluate and inspect Mixture-of-Depths models."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

from .config import PRESETS, MoDConfig

DEFAULT_PRESET = "small"


def _field_type(annotation: Any) -> Any:
    """The scalar type of a dataclass field annotation such as ``int | None``."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def _add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, skip: set[str]) -> None:
    """One flag per field, default None so that only flags the user gave override anything."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        typ = _field_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        if typ is bool:
            parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"(default: {default})",
            )
        else:
            parser.add_argument(
                flag,
                type=typ,
                default=None,
                metavar=typ.__name__.upper(),
                help=f"(default: {default})",
            )


def _given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def build_parser() -> argparse.ArgumentParser:
    from .train import TrainConfig

    parser = argparse.ArgumentParser(
        prog="mod", description="Mixture-of-Depths transformers: train, evaluate, inspect."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "train",
        help="train a model (default: a small MoD model on the Python standard library)",
        description="Train a MoD (or dense) language model. Model flags override the preset; "
        "with --resume the model comes from the checkpoint in --out.",
    )
    p.add_argument(
        "--preset",
        default=None,
        choices=sorted(PRESETS),
        help=f"model preset (default: {DEFAULT_PRESET})",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its last checkpoint, exactly",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the final summary as JSON")
    model_group = p.add_argument_group("model (MoDConfig fields)")
    _add_dataclass_flags(model_group, MoDConfig, skip={"vocab_size"})
    train_group = p.add_argument_group("training")
    _add_dataclass_flags(train_group, TrainConfig, skip=set())

    p = sub.add_parser("eval", help="validation loss (top-k and causal) and routing accuracy")
    p.add_argument("checkpoint", help="checkpoint directory (e.g. runs/mod/checkpoint)")
    p.add_argument("--data", default=None, help="text file or folder (default: the run's data)")
    p.add_argument("--batches", type=int, default=16, help="validation batches (default: 16)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true", help="print the result as JSON")

    p = sub.add_parser("presets", help="list the model presets")
    p.add_argument("--json", action="store_true")
    return parser


def cmd_train(args: argparse.Namespace) -> int:
    from .train import TrainConfig, format_summary, train

    model_over = _given(args, MoDConfig)
    train_over = _given(args, TrainConfig)
    if args.resume:
        from .checkpoint import read_json, resolve_checkpoint

        out = train_over.get("out", TrainConfig.out)
        ckpt = resolve_checkpoint(Path(out) / "checkpoint")
        if model_over or args.preset:
            print(
                "note: --resume takes the model from the checkpoint; model flags are ignored",
                file=sys.stderr,
            )
        saved = read_json(ckpt / "trainer.json")["train_config"]
        tc = TrainConfig(**{**saved, **train_over})
        summary = train(None, tc, resume=True, progress=not args.no_progress)
    else:
        cfg = MoDConfig.preset(args.preset or DEFAULT_PRESET, **model_over)
        tc = TrainConfig(**train_over)
        summary = train(cfg, tc, progress=not args.no_progress)
    print(json.dumps(summary) if args.json else format_summary(summary))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from .train import evaluate_checkpoint

    res = evaluate_checkpoint(
        args.checkpoint,
        data=args.data,
        n_batches=args.batches,
        batch_size=args.batch_size,
        device=args.device,
    )
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"checkpoint: {res['checkpoint']}")
    print(
        f"validation loss (nats/token): top-k {res['val_loss_topk']:.4f}   "
        f"causal {res['val_loss_causal']:.4f}"
    )
    for k, v in res["routing_accuracy"].items():
        take = res["causal_take_rate"].get(k)
        extra = f", causal take-rate {take:.1%}" if take is not None else ""
        print(f"routing accuracy layer {k}: {v:.2%}{extra}")
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    from .model import MoDTransformer

    rows = {}
    for name in sorted(PRESETS):
        cfg = MoDConfig.preset(name)
        import torch

        with torch.device("meta"):
            n = MoDTransformer(cfg).num_params()
        rows[name] = {**PRESETS[name], "params": n}
    if args.json:
        print(json.dumps(rows))
    else:
        for name, row in rows.items():
            cfg = MoDConfig.preset(name)
            print(
                f"{name:12s} {row['params'] / 1e6:6.2f}M params  d_model={cfg.d_model} "
                f"n_layers={cfg.n_layers} n_heads={cfg.n_heads}/{cfg.n_kv_heads} "
                f"max_seq_len={cfg.max_seq_len} layers={cfg.layer_kinds} capacity={cfg.capacity}"
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {"train": cmd_train, "eval": cmd_eval, "presets": cmd_presets}
    try:
        return handlers[args.command](args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"mod {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
