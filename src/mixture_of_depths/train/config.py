"""What a training run is, apart from the model: `TrainConfig`, its checked ranges and choices,
the learning-rate and capacity warm-up schedules, and the optimizer they drive."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..checks import (
    NONNEGATIVE,
    NONNEGATIVE_INT,
    POSITIVE,
    POSITIVE_INT,
    UNIT,
    Range,
    check_choice,
    check_fields,
)
from ..config import MoDConfig
from .tune import warmup_steps


@dataclass
class TrainConfig:
    """Everything about a training run that is not the model."""

    out: str = "runs/mod"
    data: str | None = None  # None: the Python standard library's source (embedded, no download)
    # "byte" or "bpe" (trained on the training split, saved with the model). A run from
    # `init_from` uses that checkpoint's tokenizer, and records its kind here.
    tokenizer: str = "byte"
    bpe_vocab_size: int = 4096
    batch_size: int = 16
    seq_len: int | None = None  # None: the model's max_seq_len
    steps: int = 600
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 200
    # Steps between checkpoints written without an evaluation (0: checkpoints come only with the
    # evaluations). Cheap for small models: long runs that may be killed lose less.
    checkpoint_every: int = 0
    eval_batches: int = 8
    log_every: int = 10
    seed: int = 0
    device: str = "auto"  # "auto": cuda if available, else cpu
    compile: bool = False
    # Micro-batches per step (per process under torchrun): the same step in less memory.
    grad_accum: int = 1
    # Under torchrun: "ddp" (every rank holds the whole model and optimizer state), "fsdp"
    # (FSDP2: each rank holds a 1/world shard of each block's weights, gradients and AdamW
    # moments), or "auto": ddp, unless those three would fill more than half a GPU's memory.
    parallel: str = "auto"
    # Parameters and compute: "float32" (CUDA autocasts matmuls to bf16), or "float64" for
    # exactness checks (no autocast).
    dtype: str = "float32"
    # "sharded": every rank writes its own shard (torch.distributed.checkpoint; any number of
    # ranks resumes it; `mod consolidate` makes it single-file); "whole": rank 0 writes one
    # safetensors file of the gathered weights; "auto": sharded under FSDP2, whole otherwise.
    checkpoint_format: str = "auto"
    # Fine-tuning: start a new run from this checkpoint's weights, model config and tokenizer
    # (e.g. a dense model converted by `mod convert`), training "all" parameters or only the
    # "routers" (and predictors); `distill` > 0 adds that weight times KL(frozen dense teacher ||
    # model).
    init_from: str | None = None
    tune: str = "all"
    distill: float = 0.0
    # Capacity warm-up: a routed model's capacity goes linearly from 1.0 down to its own over
    # the first `capacity_warmup_ratio` of the steps (the second round of the isoFLOP study,
    # experiments/round2: 10% lowered the causal loss on both seeds), or over `capacity_warmup`
    # steps when that is > 0. Its extra compute is spent like any other; 0 and 0.0: none.
    capacity_warmup: int = 0
    capacity_warmup_ratio: float = 0.1
    # At the end, fit each causal router's threshold so that its take-rate is the capacity on
    # held-out validation windows (what `mod calibrate` does; train/calibrate.py), and store the
    # thresholds in the checkpoint's config. `mod train` does unless --no-calibrate; off here,
    # so that code calling `train` (the studies) trains and evaluates as it always has.
    calibrate: bool = False

    def __post_init__(self) -> None:
        check_fields(self, TRAIN_RANGES)
        for name, allowed in TRAIN_CHOICES.items():
            check_choice(name, getattr(self, name), allowed)
        for name in ("out", "device"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        if self.init_from is not None and not isinstance(self.init_from, str):
            raise ValueError(f"init_from must be a checkpoint path or None, got {self.init_from!r}")
        if self.data is not None and not isinstance(self.data, str):
            raise ValueError(f"data must be a path (a string) or None, got {self.data!r}")
        for name in ("compile", "calibrate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.capacity_warmup > self.steps:  # (a resume may extend steps: never below it)
            raise ValueError(
                f"--capacity-warmup {self.capacity_warmup} is longer than --steps {self.steps}: "
                "the run would end before the capacity came down to the model's; give "
                f"--capacity-warmup {self.steps} or less (or --capacity-warmup-ratio)"
            )


# The allowed values of the string fields (also the CLI's choices).
TRAIN_CHOICES: dict[str, tuple[str, ...]] = {
    "tokenizer": ("byte", "bpe"),
    "dtype": ("float32", "float64"),
    "parallel": ("auto", "ddp", "fsdp"),
    "checkpoint_format": ("auto", "whole", "sharded"),
    "tune": ("all", "routers"),
}


# The allowed range of every numeric field, checked in one place (`checks.check_fields`).
TRAIN_RANGES: dict[str, Range] = {
    **dict.fromkeys(
        ("batch_size", "steps", "eval_every", "eval_batches", "log_every", "grad_accum"),
        POSITIVE_INT,
    ),
    "bpe_vocab_size": Range(lo=257, integer=True),  # the 256 bytes and the end-of-text token
    "seq_len": Range(lo=1, integer=True, optional=True),
    "warmup_steps": NONNEGATIVE_INT,
    "checkpoint_every": NONNEGATIVE_INT,
    "seed": Range(lo=-(2**63), hi=2**64 - 1, integer=True),  # what torch.manual_seed takes
    "lr": POSITIVE,
    "min_lr_ratio": UNIT,
    "weight_decay": NONNEGATIVE,
    "beta1": Range(lo=0, hi=1, hi_open=True),
    "beta2": Range(lo=0, hi=1, hi_open=True),
    "grad_clip": NONNEGATIVE,  # 0 disables clipping
    "distill": NONNEGATIVE,
    "capacity_warmup": NONNEGATIVE_INT,
    "capacity_warmup_ratio": Range(lo=0, hi=1, hi_open=True),
}


def capacity_warmup_steps(tc: TrainConfig, model_config: MoDConfig) -> int:
    """The steps of capacity warm-up a run of `tc` gives this model: `capacity_warmup` if set,
    else `capacity_warmup_ratio` of the steps; none for a model with no routed block."""
    if model_config.is_dense:
        return 0
    return tc.capacity_warmup or warmup_steps(tc.capacity_warmup_ratio, tc.steps)


def lr_at(step: int, tc: TrainConfig) -> float:
    """Linear warm-up to `lr` over `warmup_steps` steps, then cosine decay that reaches
    `lr * min_lr_ratio` exactly at the last step (`steps - 1`)."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    span = tc.steps - 1 - tc.warmup_steps  # steps from the first decayed one to the last
    progress = 1.0 if span <= 0 else min(1.0, (step - tc.warmup_steps) / span)
    return tc.lr * (
        tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    )


def make_optimizer(model: torch.nn.Module, tc: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms, biases, or router vectors)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_router = ".router." in name
        (decay if p.dim() >= 2 and not is_router else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": tc.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2))
