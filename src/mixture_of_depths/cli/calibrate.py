"""`mod calibrate`: fit each router's causal threshold so that its take-rate on held-out text is
the capacity, and write the checkpoint with the thresholds in its config."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..calibrate import causal_take_rates, fit_and_held, fit_thresholds, targets
from ..checks import POSITIVE_INT
from ..data import load_tokenizer
from ..fileio import check_out_folder, json_text
from ..runtime.checkpoint import load_model, read_json_file, resolve_checkpoint, save_checkpoint
from ..runtime.device import resolve_device
from ..train import evaluate
from ..train.evaluate import run_batches


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="fit each router's causal threshold so that its take-rate is the capacity",
        description="Fit, router by router in forward order, the threshold on the causal score "
        "(the aux-loss router's logit, or the predictor's) that makes the causal take-rate on "
        "held-out text equal the capacity, and write CHECKPOINT again to --out with the "
        "thresholds in its config: causal evaluation, generation and the Hugging Face model "
        "use them. The run's validation batches are split, alternately: one half fits, the "
        "other measures take-rates and loss before and after.",
    )
    p.add_argument("checkpoint", help="checkpoint directory (e.g. runs/mod/checkpoint)")
    p.add_argument("--out", required=True, help="new checkpoint directory (must not exist)")
    p.add_argument("--data", default=None, help="text file or folder (default: the run's data)")
    p.add_argument(
        "--batches",
        type=int,
        default=32,
        help="validation batches (of the run's batch size and length), at least 2: a short "
        "validation text gives fewer. Take-rates vary much from one batch to the next, so the "
        "default is more than a run's usual evaluation (default: 32)",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    check_out_folder(out, "--out")  # before the work, not after it
    POSITIVE_INT.check("--batches", args.batches)
    device = resolve_device(args.device)
    ckpt = resolve_checkpoint(args.checkpoint)
    model, cfg = load_model(ckpt, map_location=device)
    tokenizer = load_tokenizer(ckpt)
    batches, _ = run_batches(ckpt, tokenizer, cfg.max_seq_len, args.data, args.batches)
    if len(batches) < 2:
        raise ValueError(f"calibration needs at least 2 validation batches, got {len(batches)}")
    fit, held = fit_and_held(batches)
    before = _measure(model, held, device)
    thresholds = fit_thresholds(model, [x for x, _ in fit])
    after = _measure(model, held, device)
    trainer = read_json_file(ckpt / "trainer.json") if (ckpt / "trainer.json").exists() else None
    save_checkpoint(out, model, model.config, tokenizer=tokenizer, trainer_state=trainer)
    names = list(after["take_rate"])
    result = {
        "checkpoint": str(out),
        "capacity": cfg.capacity,
        "target_take_rate": dict(zip(names, targets(cfg), strict=True)),
        "thresholds": dict(zip(names, thresholds, strict=True)),
        "before": before,
        "after": after,
    }
    print(json_text(result) if args.json else "\n".join(_lines(result)))
    return 0


def _measure(model: Any, batches: list, device: Any) -> dict[str, Any]:
    ev = evaluate(model, batches, device)
    return {
        "take_rate": causal_take_rates(model, [x for x, _ in batches]),
        "val_loss_causal": ev["val_loss_causal"],
        "routing_accuracy": ev["routing_accuracy"],
    }


def _lines(r: dict[str, Any]) -> list[str]:
    b, a = r["before"], r["after"]
    lines = [f"{r['checkpoint']}: causal thresholds fitted to each router's capacity"]
    for name, thr in r["thresholds"].items():
        lines.append(
            f"router {name}: target {r['target_take_rate'][name]:.1%}, threshold {thr:+.4f}, "
            f"causal take-rate {b['take_rate'][name]:.1%} "
            f"-> {a['take_rate'][name]:.1%} on held-out batches, routing accuracy "
            f"{b['routing_accuracy'][name]:.2%} -> {a['routing_accuracy'][name]:.2%}"
        )
    lines.append(
        f"causal validation loss (held-out half) {b['val_loss_causal']:.4f} -> "
        f"{a['val_loss_causal']:.4f}"
    )
    return lines
