"""A run folder's life: refusing what would lose a run, resuming one exactly, starting over.

A run folder holds the checkpoint (``checkpoint/``, with ``.checkpoint.old`` for a moment while
it is replaced) and the files in `RUN_FILES`. A resumed run must be the same run: the settings in
`RESUME_FIXED`, the data and the tokenizer are checked against the checkpoint's before anything
changes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..fileio import fsync_dir, remove_temps
from ..runtime import distributed as D
from ..runtime.checkpoint import corrupt, read_json_file, resolve_checkpoint
from ..runtime.runlock import RunLock
from .config import TrainConfig
from .state import CHECKPOINT_NAME, rng_tensors

# What a run writes in its folder beside the checkpoint (removed by --overwrite).
RUN_FILES = ("metrics.jsonl", "run.json", "summary.json", "loss.png")


# Training settings a resumed run must share with the run it continues, or it is not the same run.
# (`steps` may change, e.g. to train longer; the LR schedule then follows the new length.)
RESUME_FIXED = (
    "data",
    "tokenizer",
    "bpe_vocab_size",
    "batch_size",
    "seq_len",
    "lr",
    "min_lr_ratio",
    "warmup_steps",
    "weight_decay",
    "beta1",
    "beta2",
    "grad_clip",
    "seed",
    "dtype",
    "init_from",
    "tune",
    "distill",
    "capacity_warmup",
    "capacity_warmup_ratio",
)


def check_resume_config(saved: dict[str, Any], tc: TrainConfig) -> None:
    changed = [
        f"{k}: {saved.get(k)!r} -> {getattr(tc, k)!r}"
        for k in RESUME_FIXED
        if k in saved and saved[k] != getattr(tc, k)
    ]
    if changed:
        raise ValueError(
            "resume must continue the same run, but these settings differ from the checkpoint's: "
            + "; ".join(changed)
            + ". Start a new run with a new --out instead."
        )


def stream_fingerprint(tokens: torch.Tensor) -> str:
    """sha256 of a token stream, to check that a resumed run reads the same data."""
    data = tokens.contiguous().view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).hexdigest()


def has_checkpoint(out_dir: Path) -> bool:
    """Whether the run folder `out_dir` holds a checkpoint to resume."""
    try:
        resolve_checkpoint(out_dir / CHECKPOINT_NAME)
    except FileNotFoundError:
        return False
    return True


class NoCheckpointError(FileNotFoundError, ValueError):
    """There is no checkpoint to resume (a missing file, and a bad request)."""


def no_checkpoint(out_dir: Path) -> NoCheckpointError:
    """The one piece of advice for a folder whose run has no checkpoint to resume."""
    if any((out_dir / name).exists() for name in RUN_FILES):
        return NoCheckpointError(
            f"{out_dir} holds a run that stopped before its first checkpoint, so there is "
            "nothing to resume: start over (--overwrite) or pick another --out"
        )
    return NoCheckpointError(f"there is no run in {out_dir} to resume: start one without --resume")


def check_out(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is a file, not a folder: give a folder for the run")


def read_trainer_state(ckpt: Path) -> dict[str, Any]:
    path = ckpt / "trainer.json"
    state = read_json_file(path, ("step", "sampler", "train_config"))
    step, sampler = state["step"], state["sampler"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise corrupt(path, f"'step' must be an integer >= 0, got {step!r}")
    if not isinstance(sampler, dict) or not all(
        isinstance(sampler.get(k), int) for k in ("seed", "step")
    ):
        raise corrupt(path, f"'sampler' must hold integer 'seed' and 'step', got {sampler!r}")
    if not isinstance(state["train_config"], dict):
        raise corrupt(path, "'train_config' must be an object")
    if "rng" in state:  # checked now, before a resume changes anything; set at the end of setup
        rng_tensors(path, state["rng"])
    return state


def resume_config(out: str | Path, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """The `TrainConfig` of the run in `out`, as its checkpoint saved it, with `overrides` (for
    `--resume`: settings that may change, such as `steps`, and those that must not, which
    `train` then refuses with the list of differences)."""
    out_dir = Path(out)
    check_out(out_dir)
    # A run in progress there is the first thing to say (rank 0's to check, under torchrun).
    if out_dir.is_dir() and D.env_from_torchrun().is_main:
        RunLock(out_dir).acquire().release()
    if not has_checkpoint(out_dir):
        raise no_checkpoint(out_dir)
    ckpt = resolve_checkpoint(out_dir / CHECKPOINT_NAME)
    saved = read_trainer_state(ckpt)["train_config"]
    saved.setdefault("capacity_warmup_ratio", 0.0)  # written before the ratio: steps only
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    try:
        return TrainConfig(
            **{**{k: v for k, v in saved.items() if k in known}, **(overrides or {})}
        )
    except (ValueError, TypeError) as exc:
        if overrides and any(k in str(exc) for k in overrides):
            raise
        raise ValueError(
            f"{ckpt / 'trainer.json'}: its saved train_config is not valid ({exc}); was it "
            "written by an older version or edited?"
        ) from None


def load_resume(tc: TrainConfig) -> tuple[Path, dict[str, Any]]:
    """The checkpoint to resume from and its trainer state, checked against `tc`."""
    out_dir = Path(tc.out)
    if not has_checkpoint(out_dir):
        raise no_checkpoint(out_dir)
    ckpt = resolve_checkpoint(out_dir / CHECKPOINT_NAME)
    trainer_state = read_trainer_state(ckpt)
    check_resume_config(trainer_state["train_config"], tc)
    if tc.steps < trainer_state["step"]:
        raise ValueError(
            f"--steps {tc.steps} is less than the checkpoint's step {trainer_state['step']}: a "
            f"resumed run trains on to --steps, so give --steps >= {trainer_state['step']} "
            "(to measure the checkpoint as it is, use mod eval)"
        )
    return ckpt, trainer_state


def clear_run(out_dir: Path) -> None:
    """Delete the run in `out_dir` (--overwrite), checkpoint first: its files are moved into
    one trash folder by atomic renames and that folder is then removed, so a kill at any moment
    leaves no checkpoint of the old run for a later --resume to continue under the new run's
    settings (a trash folder left by a kill goes with the next start's stale temporaries)."""
    trash = Path(tempfile.mkdtemp(dir=out_dir, prefix=".overwritten.", suffix=".tmp"))
    # .checkpoint.old before checkpoint: with both present, moving the newer one first could
    # leave the older for --resume to find.
    for name in (f".{CHECKPOINT_NAME}.old", CHECKPOINT_NAME, *RUN_FILES):
        if (out_dir / name).exists() or (out_dir / name).is_symlink():
            os.replace(out_dir / name, trash / name.lstrip("."))
    fsync_dir(out_dir)
    shutil.rmtree(trash, ignore_errors=True)


def remove_stale_temps(out_dir: Path) -> None:
    """Temporary files and folders of writes a crash cut short (``.<name>.*.tmp``): a checkpoint
    copy, a log being rewritten, an --overwrite's trash. Only under the run's lock."""
    remove_temps(out_dir, ".*.tmp")
