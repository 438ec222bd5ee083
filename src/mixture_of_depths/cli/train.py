"""`mod train` and `mod tune-routers`: a run, new, resumed, or from a checkpoint's weights."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..config import MoDConfig
from ..fileio import json_text
from ..runtime.distributed import env_from_torchrun, restarted
from ..train import (
    TRAIN_CHOICES,
    TrainConfig,
    format_summary,
    has_checkpoint,
    resume_config,
    train,
)
from ..train.setup import refuse_other_tokenizer
from .flags import DEFAULT_PRESET, ShowDefaults, add_dataclass_flags, add_preset_flag, given


def add_train(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="train a model (default: a small MoD model on the Python standard library)",
        formatter_class=ShowDefaults,
        description="Train a MoD (or dense) language model. Model flags override the preset; "
        "with --resume the model comes from the checkpoint in --out.",
    )
    add_preset_flag(p)
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its last checkpoint, exactly",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="start over even if --out already holds a run"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_no_calibrate(p)
    p.add_argument("--json", action="store_true", help="print the final summary as JSON, alone on "
                   "stdout (evaluation lines and the bar go to stderr)")  # fmt: skip
    model_group = p.add_argument_group("model (MoDConfig fields)")
    add_dataclass_flags(
        model_group, MoDConfig, skip={"vocab_size", "causal_thresholds"}, preset=True
    )
    train_group = p.add_argument_group("training")
    add_dataclass_flags(train_group, TrainConfig, skip={"calibrate"}, choices=TRAIN_CHOICES)


def add_no_calibrate(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-calibrate",
        action="store_true",
        help="end without calibrating: by default the run ends by fitting each causal router's "
        "threshold so that its take-rate on held-out validation windows is the capacity (mod "
        "calibrate), stores them in the checkpoint's config and prints the take-rates before "
        "and after",
    )


def add_tune_routers(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="train only the routers (and predictors) of a checkpoint, the rest frozen",
        formatter_class=ShowDefaults,
        description="A new run from CHECKPOINT's weights (e.g. a dense model converted by `mod "
        "convert`) that trains only its routers and predictors, by the LM loss (through the "
        "straight-through gate) and the causal-router loss; --distill W adds W x KL(frozen dense "
        "model || MoD model); the capacity goes from 1.0 down to the model's over the first 10% "
        "of the steps (--capacity-warmup-ratio) or N steps (--capacity-warmup N). The same as "
        "`mod train --init-from CHECKPOINT --tune routers`.",
    )
    p.add_argument("checkpoint", help="checkpoint to start from")
    p.add_argument("--resume", action="store_true", help="continue this run in --out")
    p.add_argument("--overwrite", action="store_true", help="start over in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_no_calibrate(p)
    p.add_argument("--json", action="store_true", help="print the final summary as JSON, alone on "
                   "stdout (evaluation lines and the bar go to stderr)")  # fmt: skip
    p.set_defaults(preset=None)
    skip = {"init_from", "calibrate"}
    add_dataclass_flags(p, TrainConfig, skip=skip, choices=TRAIN_CHOICES, shown=TUNED)


# what tune-routers sets where the user gives nothing (`run`), as its help shows it
TUNED = {"tune": "routers", "out": "runs/tuned", "tokenizer": "the checkpoint's"}


def run(args: argparse.Namespace) -> int:
    model_over = given(args, MoDConfig)
    train_over = given(args, TrainConfig)
    train_over["calibrate"] = not args.no_calibrate  # the command's default: calibrated
    if restarted():
        # torchrun restarted the job after a worker died: go on from the last complete
        # checkpoint, or start over the folder the dead attempt began (nothing was saved yet).
        out = Path(train_over.get("out", TrainConfig.out))
        args.resume, args.overwrite = has_checkpoint(out), not has_checkpoint(out)
        print(
            f"note: restarted by torchrun; {'resuming' if args.resume else 'starting over'}",
            file=sys.stderr,
        )
    if getattr(args, "command", "") == "tune-routers":
        train_over = {"tune": TUNED["tune"], "out": TUNED["out"], **train_over}
        train_over["init_from"] = args.checkpoint
    if (args.resume or train_over.get("init_from")) and (model_over or args.preset):
        print(
            "note: the model comes from the checkpoint; model flags are ignored",
            file=sys.stderr,
        )
    if args.resume:
        tc = resume_config(train_over.get("out", TrainConfig.out), train_over)
        summary = train(None, tc, resume=True, progress=not args.no_progress)
    elif train_over.get("init_from"):
        if "tokenizer" in train_over:  # given on the command line: not silently another one
            refuse_other_tokenizer(train_over["init_from"], train_over["tokenizer"])
        tc = TrainConfig(**train_over)
        summary = train(None, tc, overwrite=args.overwrite, progress=not args.no_progress)
    else:
        cfg = MoDConfig.preset(args.preset or DEFAULT_PRESET, **model_over)
        tc = TrainConfig(**train_over)
        note = long_context_note(cfg, tc.seq_len or cfg.max_seq_len)
        if note and env_from_torchrun().is_main:
            print(note, file=sys.stderr)
        summary = train(cfg, tc, overwrite=args.overwrite, progress=not args.no_progress)

    if env_from_torchrun().is_main:  # under torchrun, rank 0 reports for the job
        print(json_text(summary) if args.json else format_summary(summary))
    return 0


LONG_CONTEXT = 1024  # where rounds 3 and 4 measured it (experiments/round3, experiments/round4)


def long_context_note(cfg: MoDConfig, seq_len: int) -> str | None:
    """Advice for a routed model trained on long sequences. At 1024 tokens and 1.5e14 training
    FLOPs, against dense at its best rate and size (rounds 3 and 4 of the study,
    docs/semantics.md): routing that takes attention from the tokens that skip a routed layer
    (joint, staggered) or lets them read only the takers' keys (mlp_kv) trailed dense by about
    0.6 nats; routing only the MLP came level with dense within the seed spread, but only at a
    larger model than dense's best, at more FLOPs per token."""
    if seq_len < LONG_CONTEXT or not cfg.routed_layers or cfg.routing == "mlp":
        return None
    skipped = (
        "reads only the takers' keys there" if cfg.routing == "mlp_kv"
        else "computes no attention there"
    )  # fmt: skip
    return (
        f"note: routing={cfg.routing!r} at {seq_len} tokens: a token that skips a routed layer "
        f"{skipped}, and at 1024 tokens and 1.5e14 training FLOPs the study found such models "
        "about 0.6 nats behind dense at equal FLOPs; --routing mlp (attention for every token, "
        "only the MLP routed; --preset small-long) came level with dense within the seed "
        "spread, but only at a larger model than dense's best, at more FLOPs per token: "
        "compare with dense at your budget (docs/semantics.md, 'What a routed layer can and "
        "cannot see')"
    )
