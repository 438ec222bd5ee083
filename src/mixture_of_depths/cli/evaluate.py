"""`mod eval`: validation loss in top-k and causal routing, and routing accuracy, of a
checkpoint."""

from __future__ import annotations

import argparse
from typing import Any

from ..checks import Range
from ..fileio import json_text
from ..train import evaluate_checkpoint, format_eval_lines
from .flags import ShowDefaults


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="validation loss (top-k and causal) and how causal routing matches top-k",
        formatter_class=ShowDefaults,
    )
    p.add_argument("checkpoint", help="checkpoint directory, or a run folder (e.g. runs/mod)")
    p.add_argument("--data", default=None, help="text file or folder (default: the run's data)")
    p.add_argument(
        "--batches",
        type=int,
        default=None,
        help="validation batches (default: the run's eval_batches)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="(default: the run's batch size, so the numbers match its last eval)",
    )
    p.add_argument(
        "--prefill-calibration",
        action="store_true",
        help="also score the second half of the first validation batch teacher-forced after "
        "prefilling the first half causally and with top-k, and count the prompt decisions that "
        "differ (MoD models; docs/semantics.md, KV strategies)",
    )
    p.add_argument("--device", default="auto", help="auto: cuda if there is one, else cpu")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    for flag, value in (("--batches", args.batches), ("--batch-size", args.batch_size)):
        Range(lo=1, integer=True, optional=True).check(flag, value)  # the flag, not the field
    res = evaluate_checkpoint(
        args.checkpoint,
        data=args.data,
        n_batches=args.batches,
        batch_size=args.batch_size,
        device=args.device,
        prefill_calibration=args.prefill_calibration,
        progress=True,  # on stderr, shown on a terminal only
    )
    if args.json:
        print(json_text(res))
        return 0
    print(f"checkpoint: {res['checkpoint']}")
    print("\n".join(format_eval_lines(res)))
    return 0
