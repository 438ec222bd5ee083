"""`mod calibrate`: fit each router's causal threshold so that its take-rate on held-out text is
the capacity, and write the checkpoint with the thresholds in its config."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..checks import POSITIVE_INT
from ..data import load_tokenizer
from ..fileio import check_out_folder, json_text
from ..runtime.checkpoint import load_model, read_json_file, resolve_checkpoint, save_checkpoint
from ..runtime.device import resolve_device
from ..train.calibrate import BATCHES, calibrate_model, calibration_header, format_calibration
from ..train.evaluate import run_batches
from .flags import OUT_CHECKPOINT, ShowDefaults


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="fit each router's causal threshold so that its take-rate is the capacity",
        formatter_class=ShowDefaults,
        description="Fit, router by router in forward order, the threshold on the causal score "
        "(the aux-loss router's logit, or the predictor's) that makes the causal take-rate on "
        "held-out text equal the capacity, and write CHECKPOINT again to --out with the "
        "thresholds in its config: causal evaluation, generation and the Hugging Face model "
        "use them. The run's validation batches are split, alternately: one half fits, the "
        "other measures take-rates and loss before and after. `mod train` ends with this "
        "(unless --no-calibrate).",
    )
    p.add_argument("checkpoint", help="checkpoint directory, or a run folder (e.g. runs/mod)")
    p.add_argument("--out", required=True, help=OUT_CHECKPOINT)
    p.add_argument("--data", default=None, help="text file or folder (default: the run's data)")
    p.add_argument(
        "--batches",
        type=int,
        default=BATCHES,
        help="validation batches (of the run's batch size and length), at least 2: a short "
        "validation text gives fewer. Take-rates vary much from one batch to the next, so the "
        f"default is more than a run's usual evaluation (default: {BATCHES})",
    )
    p.add_argument("--device", default="auto", help="auto: cuda if there is one, else cpu")
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
    result = calibrate_model(model, batches, device, progress=True)  # on a terminal, as eval's
    trainer = read_json_file(ckpt / "trainer.json") if (ckpt / "trainer.json").exists() else None
    if trainer is not None and "calibration" in trainer:  # `mod train` calibrated it before
        trainer["calibration"]["thresholds"] = list(result["thresholds"].values())
    save_checkpoint(out, model, model.config, tokenizer=tokenizer, trainer_state=trainer)
    result = {"checkpoint": str(out), **result}
    if args.json:
        print(json_text(result))
    else:
        print(f"{out}: causal thresholds in its config.json")
        print("\n".join([calibration_header(result), *format_calibration(result)]))
    return 0
