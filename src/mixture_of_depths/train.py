"""Training loop, evaluation in both routing modes, checkpoints and exact resume.

`train(model_config, train_config)` trains a `MoDTransformer` on a token stream with AdamW, linear
warm-up then cosine decay, and gradient clipping before the optimizer step. Every `eval_every` steps
it measures validation loss in top-k and causal routing and the routing accuracy of each router
(causal decision vs top-k membership), logs a JSON line to ``<out>/metrics.jsonl`` and writes an
atomic checkpoint to ``<out>/checkpoint`` (also every `checkpoint_every` steps, when set).
`resume=True` continues from that checkpoint and reproduces the losses of an uninterrupted run:
weights, AdamW moments and the data position are all restored, and batches are a pure function
of (seed, step).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from . import distributed as D
from .checkpoint import (
    CheckpointError,
    corrupt,
    is_sharded,
    load_config,
    load_model,
    load_optimizer_state,
    load_sharded,
    model_tensors,
    nonfinite_tensors,
    read_json_file,
    resolve_checkpoint,
    save_checkpoint,
    save_sharded_checkpoint,
)
from .checks import (
    NONNEGATIVE,
    NONNEGATIVE_INT,
    POSITIVE,
    POSITIVE_INT,
    UNIT,
    Range,
    check_choice,
    check_fields,
)
from .config import MoDConfig
from .data import BatchSampler, Tokenizer, eval_batches, load_splits, load_tokenizer
from .experts import ran_real_expert, slot_shares
from .fileio import atomic_write_text, fsync_dir, json_text, write_json
from .model import MoDOutput, MoDTransformer
from .precision import autocast_for
from .routing import decision_flips, routing_accuracy, routing_diagnostics
from .runlock import RunLock
from .sharded import local_tensors
from .tune import (
    Distilled,
    capacity_at,
    dense_teacher,
    freeze_all_but_routers,
    set_capacity,
    warmup_steps,
)

CHECKPOINT_NAME = "checkpoint"
# What a run writes in its folder beside the checkpoint (removed by --overwrite).
RUN_FILES = ("metrics.jsonl", "run.json", "summary.json", "loss.png")


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm stopped being finite; nothing after it was saved."""


@dataclass
class TrainConfig:
    """Everything about a training run that is not the model."""

    out: str = "runs/mod"
    data: str | None = None  # None: the Python standard library's source (embedded, no download)
    tokenizer: str = "byte"  # "byte" or "bpe" (trained on the training split, saved with the model)
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
    # docs/study/round2: 10% lowered the causal loss on both seeds), or over `capacity_warmup`
    # steps when that is > 0. Its extra compute is spent like any other; 0 and 0.0: none.
    capacity_warmup: int = 0
    capacity_warmup_ratio: float = 0.1

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
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be true or false, got {self.compile!r}")


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


def resolve_device(name: str) -> torch.device:
    """``"auto"`` (cuda if available, else cpu) or a device torch knows and can use here."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device {name!r} is not a device: use auto, cpu, cuda or cuda:N ({exc})"
        ) from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "was built without CUDA" if torch.version.cuda is None else "sees no GPU"
            raise ValueError(
                f"device {name!r}: this torch ({torch.__version__}) {why}; use --device cpu "
                "(or auto)"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {name!r}: there are only {torch.cuda.device_count()} GPUs "
                f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})"
            )
        return dev
    backend = getattr(torch, dev.type, None) if dev.type != "mps" else torch.backends.mps
    if backend is None or not getattr(backend, "is_available", lambda: False)():
        raise ValueError(f"device {name!r} is not available here; use --device cpu (or auto)")
    return dev


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


@torch.no_grad()
def evaluate(
    model: MoDTransformer, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> dict[str, Any]:
    """Validation loss in top-k and causal routing; routing accuracy and take-rate per router.

    Routing accuracy compares each token's causal decision with its top-k membership on the top-k
    forward. The take-rate is the share of tokens that chose a router in the causal forward; it
    should sit near the configured capacity when the causal router has learned top-k.
    """
    was_training = model.training
    model.eval()
    sums: dict[str, float] = {"topk": 0.0, "causal": 0.0}
    acc: dict[str, float] = {}
    take: dict[str, float] = {}
    experts: dict[str, float] = {}
    dense = model.config.is_dense
    try:
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            with autocast_for(device):
                out = model(x, y, routing="topk")
            sums["topk"] += out.lm_loss.item()
            for key, a in routing_accuracy(out.routes).items():
                acc[key] = acc.get(key, 0.0) + a
            if dense:  # both modes are the same computation for a dense model
                sums["causal"] += out.lm_loss.item()
                _add_expert_take(experts, out)
                continue
            with autocast_for(device):
                out = model(x, y, routing="causal")
            sums["causal"] += out.lm_loss.item()
            for r in out.routes:
                take[r.name] = take.get(r.name, 0.0) + r.mask.float().mean().item()
            _add_expert_take(experts, out)
    finally:
        model.train(was_training)
    n = max(1, len(batches))
    return {
        "val_loss_topk": sums["topk"] / n,
        "val_loss_causal": sums["causal"] / n,
        "routing_accuracy": {k: v / n for k, v in acc.items()},
        "causal_take_rate": {k: v / n for k, v in take.items()},
        **({"expert_take_rate": {k: v / n for k, v in experts.items()}} if experts else {}),
    }


def _add_expert_take(acc: dict[str, float], out: MoDOutput) -> None:
    """Per expert layer, add the share of the sequence's tokens that ran a real expert."""
    for er in out.expert_routes:
        key = str(er.layer)
        acc[key] = acc.get(key, 0.0) + ran_real_expert(er, out.routes).float().mean().item()


def expert_slot_shares(out: MoDOutput) -> dict[str, float]:
    """Per expert layer of a forward, the share of its token slots that ran a real expert (the
    rest chose a no-op expert or were dropped): what `estimate_flops(expert_share=...)` takes."""
    shares = slot_shares(
        out.expert_routes, out.expert_routes[-1].layer + 1 if out.expert_routes else 0
    )
    return {str(er.layer): shares[er.layer] for er in out.expert_routes}


class MetricsLog:
    """Append-only JSONL log; on resume it drops records written after the checkpoint's step."""

    def __init__(self, path: Path, keep_until_step: int | None) -> None:
        self.path = path
        if keep_until_step is None:
            atomic_write_text(path, "")
        elif path.exists():
            kept = [
                line
                for line in path.read_text().splitlines()
                if _step_of(line) is not None and _step_of(line) <= keep_until_step
            ]
            atomic_write_text(path, "".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json_text(record) + "\n")


def _step_of(line: str) -> int | None:
    """The step of a log line, None for a line cut short by a crash (it can only be the last)."""
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return None


# Training settings a resumed run must share with the run it continues, or it is not the same run.
# (`steps` may change, e.g. to train longer; the LR schedule then follows the new length.)
_RESUME_FIXED = (
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


def _check_resume_config(saved: dict[str, Any], tc: TrainConfig) -> None:
    changed = [
        f"{k}: {saved.get(k)!r} -> {getattr(tc, k)!r}"
        for k in _RESUME_FIXED
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


def _prepare_data(
    tc: TrainConfig, tokenizer: Tokenizer | None
) -> tuple[torch.Tensor, torch.Tensor, Tokenizer]:
    if tokenizer is None and tc.tokenizer == "bpe":
        from .data import corpus_files, make_tokenizer, split_files

        train_files, _ = split_files(corpus_files(tc.data))
        tokenizer = make_tokenizer("bpe", train_files, vocab_size=tc.bpe_vocab_size)
    return load_splits(tc.data, tokenizer)


@dataclass
class _Run:
    """What a training run holds while it trains (built by `_start`)."""

    tc: TrainConfig
    out_dir: Path
    device: torch.device
    model: MoDTransformer
    model_config: MoDConfig
    opt: torch.optim.AdamW
    sampler: BatchSampler
    val: list[tuple[torch.Tensor, torch.Tensor]]
    tokenizer: Tokenizer
    fingerprint: str
    log: MetricsLog
    start_step: int
    elapsed: float  # training seconds so far (evaluation and checkpoints excluded)
    step_fn: Any = None
    lm_params: list[torch.nn.Parameter] = dataclasses.field(default_factory=list)
    predictor_params: list[torch.nn.Parameter] = dataclasses.field(default_factory=list)
    window_t: float = 0.0  # start of the current tokens/s window
    window_tokens: int = 0
    saved_step: int = 0  # the step of the last checkpoint written (or resumed from)
    # The first step whose loss or gradient norm was not finite (0: none yet) and those two
    # values, kept on the device so that watching costs no host sync (`_check_finite` reads it).
    bad_step: torch.Tensor | None = None
    bad_values: torch.Tensor | None = None
    env: D.DistEnv = dataclasses.field(default_factory=D.DistEnv)
    parallel: str = "none"  # "none" (one process), "ddp" or "fsdp"
    sharded_checkpoints: bool = False
    # The routing decisions on the probe batch at the last evaluation, to count the flips at the
    # next one (`routing_diag` in the log); saved with the checkpoint so a resume counts alike.
    probe_masks: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    capacity_warmup: int = 0  # steps of capacity warm-up (`capacity_warmup_steps`)

    @property
    def ckpt_dir(self) -> Path:
        return self.out_dir / CHECKPOINT_NAME

    @property
    def seq_len(self) -> int:
        return self.tc.seq_len or self.model_config.max_seq_len

    @property
    def tokens_per_step(self) -> int:
        return self.tc.batch_size * self.seq_len


def has_checkpoint(out_dir: Path) -> bool:
    """Whether the run folder `out_dir` holds a checkpoint to resume."""
    try:
        resolve_checkpoint(out_dir / CHECKPOINT_NAME)
    except FileNotFoundError:
        return False
    return True


class NoCheckpointError(FileNotFoundError, ValueError):
    """There is no checkpoint to resume (a missing file, and a bad request)."""


def _no_checkpoint(out_dir: Path) -> NoCheckpointError:
    """The one piece of advice for a folder whose run has no checkpoint to resume."""
    if any((out_dir / name).exists() for name in RUN_FILES):
        return NoCheckpointError(
            f"{out_dir} holds a run that stopped before its first checkpoint, so there is "
            "nothing to resume: start over (--overwrite) or pick another --out"
        )
    return NoCheckpointError(f"there is no run in {out_dir} to resume: start one without --resume")


def _check_out(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is a file, not a folder: give a folder for the run")


def _read_trainer_state(ckpt: Path) -> dict[str, Any]:
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
        _rng_tensors(path, state["rng"])
    return state


def resume_config(out: str | Path, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """The `TrainConfig` of the run in `out`, as its checkpoint saved it, with `overrides` (for
    `--resume`: settings that may change, such as `steps`, and those that must not, which
    `train` then refuses with the list of differences)."""
    out_dir = Path(out)
    _check_out(out_dir)
    # A run in progress there is the first thing to say (rank 0's to check, under torchrun).
    if out_dir.is_dir() and D.env_from_torchrun().is_main:
        RunLock(out_dir).acquire().release()
    if not has_checkpoint(out_dir):
        raise _no_checkpoint(out_dir)
    ckpt = resolve_checkpoint(out_dir / CHECKPOINT_NAME)
    saved = _read_trainer_state(ckpt)["train_config"]
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


def _load_resume(tc: TrainConfig) -> tuple[Path, dict[str, Any]]:
    """The checkpoint to resume from and its trainer state, checked against `tc`."""
    out_dir = Path(tc.out)
    if not has_checkpoint(out_dir):
        raise _no_checkpoint(out_dir)
    ckpt = resolve_checkpoint(out_dir / CHECKPOINT_NAME)
    trainer_state = _read_trainer_state(ckpt)
    _check_resume_config(trainer_state["train_config"], tc)
    if tc.steps < trainer_state["step"]:
        raise ValueError(
            f"--steps {tc.steps} is less than the checkpoint's step {trainer_state['step']}: a "
            f"resumed run trains on to --steps, so give --steps >= {trainer_state['step']} "
            "(to measure the checkpoint as it is, use mod eval)"
        )
    return ckpt, trainer_state


def _clear_run(out_dir: Path) -> None:
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


def _remove_stale_temps(out_dir: Path) -> None:
    """Temporary files and folders of writes a crash cut short (``.<name>.*.tmp``): a checkpoint
    copy, a log being rewritten, an --overwrite's trash. Only under the run's lock."""
    for tmp in out_dir.glob(".*.tmp"):
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


class _NoLog:
    """The metrics log of a rank other than 0: rank 0 writes the (rank-averaged) lines."""

    def write(self, record: dict[str, Any]) -> None:
        pass


def _start(
    model_config: MoDConfig | None,
    tc: TrainConfig,
    resume: bool,
    overwrite: bool,
    env: D.DistEnv | None = None,
    device: torch.device | None = None,
) -> _Run:
    """Set up a new run, or restore one exactly from its checkpoint (`resume`). The caller holds
    the folder's lock (rank 0, under torchrun; the other ranks write nothing)."""
    out_dir = Path(tc.out)
    env = D.DistEnv() if env is None else env
    device = resolve_device(tc.device) if device is None else device
    if tc.batch_size % (env.world_size * tc.grad_accum):
        raise ValueError(
            f"batch_size {tc.batch_size} (the global batch) must split evenly over "
            f"{env.world_size} process(es) x grad_accum {tc.grad_accum}"
        )
    if env.is_main:
        _remove_stale_temps(out_dir)
    ckpt, trainer_state, tokenizer = None, None, None
    if resume:
        ckpt, trainer_state = _load_resume(tc)
        if is_sharded(ckpt):  # read after sharding, below, each rank its own slices
            model_config = load_config(ckpt)
            model = MoDTransformer(model_config).to(device)
        else:
            model, model_config = load_model(ckpt, map_location=device)
            _refuse_nonfinite(ckpt, nonfinite_tensors(model_tensors(model)))
        tokenizer = load_tokenizer(ckpt)
    elif tc.init_from is not None:  # a new run from another run's weights
        start = resolve_checkpoint(tc.init_from)
        model, model_config = load_model(start, map_location=device)
        _refuse_nonfinite(start, nonfinite_tensors(model_tensors(model)))
        tokenizer = load_tokenizer(start)
    if has_checkpoint(out_dir) and not overwrite and not resume:
        raise ValueError(
            f"{out_dir} already holds a run with a checkpoint: resume it (--resume), start over "
            "(--overwrite), or pick another --out"
        )
    elif any((out_dir / name).exists() for name in RUN_FILES) and not overwrite and not resume:
        raise _no_checkpoint(out_dir)
    torch.manual_seed(tc.seed)
    if not env.is_main:  # rank 0 fills the token cache first; the others then read it
        D.barrier(env)
    train_tokens, val_tokens, tokenizer = _prepare_data(tc, tokenizer)
    if env.is_main:
        D.barrier(env)
    fingerprint = stream_fingerprint(train_tokens)
    if trainer_state is not None and trainer_state.get("data_fingerprint", fingerprint) != (
        fingerprint
    ):
        raise ValueError(
            "the training data differ from the checkpoint's (another Python's standard library, "
            "or edited files?): a resumed run would read other tokens at the same step"
        )
    assert model_config is not None
    if tc.init_from is not None and not resume and tokenizer.vocab_size > model_config.vocab_size:
        raise ValueError(
            f"{tc.init_from}: its tokenizer has {tokenizer.vocab_size} tokens, its model only "
            f"{model_config.vocab_size}"
        )
    if model_config.vocab_size != tokenizer.vocab_size and tc.init_from is None:
        if resume:
            raise ValueError(
                f"checkpoint vocab_size {model_config.vocab_size} does not match its "
                f"tokenizer's {tokenizer.vocab_size}"
            )
        model_config = dataclasses.replace(model_config, vocab_size=tokenizer.vocab_size)
    seq_len = tc.seq_len or model_config.max_seq_len
    if seq_len > model_config.max_seq_len:
        raise ValueError(
            f"seq_len {seq_len} exceeds the model's max_seq_len {model_config.max_seq_len}"
        )
    if not resume and tc.init_from is None:
        model = MoDTransformer(model_config).to(device)
    model = model.to(getattr(torch, tc.dtype)).train()
    if tc.tune == "routers":
        freeze_all_but_routers(model)
    parallel = D.choose_parallel(env, tc.parallel, model, device)
    if parallel == "fsdp":  # shard in place before the optimizer sees the parameters
        D.shard(model, env, device)
    opt = make_optimizer(model, tc)
    sampler = BatchSampler(train_tokens, tc.batch_size, seq_len, seed=tc.seed)
    if resume and is_sharded(ckpt):
        load_sharded(ckpt, model, opt, alone=not env.active)
        bad = nonfinite_tensors(local_tensors(model, None))  # this rank's shards
        if D.max_over_ranks(env, len(bad)):
            _refuse_nonfinite(ckpt, bad or ["on another rank"])
        sampler.load_state_dict(trainer_state["sampler"])
    elif resume:
        opt_state = load_optimizer_state(ckpt)
        if opt_state is None:
            raise ValueError(f"{ckpt} has no optimizer state: cannot resume exactly")
        try:
            opt.load_state_dict(opt_state)
            if parallel == "fsdp":
                D.shard_optimizer_state(opt)
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise corrupt(
                ckpt / "optimizer.safetensors", f"it does not fit the model ({exc!r})"
            ) from None
        sampler.load_state_dict(trainer_state["sampler"])
    try:
        val = eval_batches(val_tokens, tc.batch_size, seq_len, tc.eval_batches)
    except ValueError as exc:
        raise ValueError(
            f"the validation split is too short for seq_len {seq_len} ({exc}); use a smaller "
            "--seq-len or more data"
        ) from exc
    start_step = int(trainer_state["step"]) if trainer_state else 0
    # Fixed at the start: a resume that extends --steps keeps the warm-up it began with.
    warmup = capacity_warmup_steps(tc, model_config)
    if trainer_state:
        warmup = int(trainer_state.get("capacity_warmup_steps", tc.capacity_warmup))
    if overwrite and not resume and env.is_main:  # only now that the run has passed every check
        _clear_run(out_dir)
    log: Any = _NoLog()
    if env.is_main:
        log = MetricsLog(out_dir / "metrics.jsonl", start_step if resume else None)
    if not resume and env.is_main:
        write_json(
            out_dir / "run.json", {"model": model_config.to_dict(), "train": dataclasses.asdict(tc)}
        )
    run = _Run(
        tc=tc,
        out_dir=out_dir,
        device=device,
        model=model,
        model_config=model_config,
        opt=opt,
        sampler=sampler,
        val=val,
        tokenizer=tokenizer,
        fingerprint=fingerprint,
        log=log,
        start_step=start_step,
        elapsed=float(trainer_state.get("elapsed_s", 0.0)) if trainer_state else 0.0,
        step_fn=_step_module(_with_teacher(model, tc, device), tc, env, device, parallel),
        saved_step=start_step,
        env=env,
        parallel=parallel,
        sharded_checkpoints=tc.checkpoint_format == "sharded"
        or (tc.checkpoint_format == "auto" and parallel == "fsdp"),
        bad_step=torch.zeros((), dtype=torch.int64, device=device),
        bad_values=torch.zeros(3, device=device),
        probe_masks=unpack_masks(trainer_state.get("routing_probe", {})) if trainer_state else {},
        capacity_warmup=warmup,
    )
    # The predictor is clipped on its own: its gradient must not rescale the LM's update.
    for name, param in model.named_parameters():
        (run.predictor_params if ".predictor." in name else run.lm_params).append(param)
    if trainer_state and "rng" in trainer_state:  # last: loading a teacher draws from it too
        _restore_rng(ckpt / "trainer.json", trainer_state["rng"], device)
    return run


def _rng_state(device: torch.device) -> dict[str, str]:
    """The global generators' states (base64), which random routing draws its scores from:
    without them a resumed random-routing run would draw other scores than an unbroken one.
    Every rank seeds and draws alike, so rank 0's state stands for all."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return {k: base64.b64encode(v.numpy().tobytes()).decode("ascii") for k, v in states.items()}


def _restore_rng(path: Path, states: Any, device: torch.device) -> None:
    """Set the generators `_rng_state` saved; a CUDA state is skipped on a run resumed off
    CUDA (its draws then differ, as they would on another device anyway)."""
    tensors = _rng_tensors(path, states)
    torch.set_rng_state(tensors["cpu"])
    if device.type == "cuda" and "cuda" in tensors:
        try:
            torch.cuda.set_rng_state(tensors["cuda"], device)
        except RuntimeError as exc:
            raise corrupt(path, f"its 'rng' CUDA state cannot be restored ({exc})") from None


def _rng_tensors(path: Path, states: Any) -> dict[str, torch.Tensor]:
    """The saved generator states, checked: each base64 text, the CPU one a state that
    `torch.set_rng_state` takes (tried, then the current state put back)."""
    if (
        not isinstance(states, dict)
        or not isinstance(states.get("cpu"), str)
        or not all(k in ("cpu", "cuda") and isinstance(v, str) for k, v in states.items())
    ):
        raise corrupt(path, "'rng' must be an object of base64 texts: 'cpu', and 'cuda' if any")
    now = torch.get_rng_state()
    try:
        tensors = {k: _state_tensor(v) for k, v in states.items()}
        torch.set_rng_state(tensors["cpu"])
    except (ValueError, RuntimeError) as exc:
        raise corrupt(path, f"its 'rng' state cannot be restored ({exc})") from None
    finally:
        torch.set_rng_state(now)
    return tensors


def _state_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def _with_teacher(model: MoDTransformer, tc: TrainConfig, device: torch.device) -> Any:
    """The model, or with `distill` the model and its frozen dense teacher (the dense twin of
    the checkpoint the run started from: the original model, however far training has moved)."""
    if tc.distill == 0:
        return model
    if tc.init_from is None:
        raise ValueError("distill needs a teacher: start from a checkpoint (init_from)")
    start, _ = load_model(resolve_checkpoint(tc.init_from), map_location=device)
    teacher = dense_teacher(start.to(getattr(torch, tc.dtype)))
    return Distilled(model, teacher, tc.distill)


def _refuse_nonfinite(ckpt: Path, bad: list[str]) -> None:
    if bad:
        raise CheckpointError(
            f"checkpoint {ckpt} holds weights that are NaN or infinite ({', '.join(bad[:3])}): "
            "it was written by a run that diverged. Start over (--overwrite) with a lower --lr"
        )


def _step_module(
    model: MoDTransformer, tc: TrainConfig, env: D.DistEnv, device: torch.device, parallel: str
) -> torch.nn.Module:
    """What a training step calls: the model, compiled or not, wrapped in DDP under torchrun
    (gradients averaged over ranks; a model sharded by FSDP2 averages its own). Unused
    parameters are searched for: a routed block at k = 0, an expert no token chose, or
    random-score routers give some parameters no gradient on some steps, and DDP would
    otherwise wait for them forever."""
    module: torch.nn.Module = model
    if env.active and parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        module = DDP(model, device_ids=ids, find_unused_parameters=True)
    return torch.compile(module) if tc.compile else module


def _autocast(run: _Run) -> torch.autocast:
    return autocast_for(run.device, None if run.tc.dtype == "float32" else "float32")


def _train_step(run: _Run, step: int) -> tuple[MoDOutput, torch.Tensor, float]:
    """One optimizer step: the batch of `step` (this rank's rows of it, in `grad_accum`
    micro-batches), forward, backward, clipping, AdamW. Returns the output (its losses the means
    over the micro-batches), the (pre-clip) gradient norm of the LM parameters and the learning
    rate."""
    tc = run.tc
    lr = lr_at(step, tc)
    for group in run.opt.param_groups:
        group["lr"] = lr
    if run.capacity_warmup:
        set_capacity(run.model, capacity_at(step, run.model_config.capacity, run.capacity_warmup))
    # Compiled code would recompile for each warm-up capacity (a new k, new shapes) until
    # dynamo's limit left the rest of the run eager: the warm-up steps run eager instead.
    step_fn = run.step_fn
    if tc.compile and step < run.capacity_warmup:
        step_fn = run.step_fn._orig_mod
    x, y = run.sampler.next_batch()
    rows = D.local_rows(run.env, tc.batch_size)
    x, y = x[rows].to(run.device, non_blocking=True), y[rows].to(run.device, non_blocking=True)
    n = tc.grad_accum
    if n == 1:
        with _autocast(run):
            out = step_fn(x, y)
        out.loss.backward()
    else:
        outs = []
        for i, (xm, ym) in enumerate(zip(x.chunk(n), y.chunk(n), strict=True)):
            # DDP reduces gradients on the last micro-batch only
            sync = i == n - 1 or not hasattr(step_fn, "no_sync")
            with contextlib.nullcontext() if sync else step_fn.no_sync(), _autocast(run):
                out = step_fn(xm, ym)
                (out.loss / n).backward()
            outs.append(out)
        out = _mean_output(outs)
    # Clip before the step: clipping after it would be a no-op on this update.
    max_norm = tc.grad_clip if tc.grad_clip > 0 else float("inf")
    grad_norm = D.full(torch.nn.utils.clip_grad_norm_(run.lm_params, max_norm))
    norms = [grad_norm]
    if run.predictor_params:
        norms.append(D.full(torch.nn.utils.clip_grad_norm_(run.predictor_params, max_norm)))
    _watch_finite(run, step + 1, out.loss, *norms)
    run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    run.window_tokens += run.tokens_per_step
    return out, grad_norm, lr


def _mean_output(outs: list[MoDOutput]) -> MoDOutput:
    """The micro-batches' outputs as one: losses averaged (detached), the last one's routes."""

    def mean(name: str) -> torch.Tensor | None:
        vals = [getattr(o, name) for o in outs]
        return None if vals[0] is None else torch.stack([v.detach() for v in vals]).mean()

    last = outs[-1]
    return dataclasses.replace(
        last,
        loss=mean("loss"),
        lm_loss=mean("lm_loss"),
        aux_loss=mean("aux_loss"),
        moe_loss=mean("moe_loss"),
        distill_loss=mean("distill_loss"),
    )


def _watch_finite(run: _Run, done: int, loss: torch.Tensor, *grad_norms: torch.Tensor) -> None:
    """Remember the first step whose loss or a gradient norm (the LM's, the predictor's) is not
    finite: device ops only, no host sync, so accelerators run ahead; `_check_finite` looks at
    log and eval boundaries."""
    values = torch.stack([loss.detach().float(), *(g.detach().float() for g in grad_norms)])
    values = torch.cat([values, values.new_zeros(3 - len(values))])  # (loss, lm, predictor)
    first = (run.bad_step == 0) & ~torch.isfinite(values).all()
    run.bad_step = torch.where(first, done, run.bad_step)
    run.bad_values = torch.where(first, values, run.bad_values)


def _check_finite(run: _Run, done: int) -> None:
    """Stop the run if a step since the last look had a non-finite loss or gradient norm: the
    weights after it are garbage and must never reach a checkpoint (the last good one stays)."""
    bad = int(run.bad_step)  # the host sync, once per log or eval boundary
    bad = D.max_over_ranks(run.env, bad)  # a rank's non-finite loss stops every rank
    if not bad:
        return
    loss, grad_norm, predictor_norm = run.bad_values.tolist()
    if run.saved_step:
        kept = f"the checkpoint in {run.ckpt_dir} (step {run.saved_step}) is the last good one"
    else:
        first = min(run.tc.eval_every, run.tc.checkpoint_every or run.tc.steps, run.tc.steps)
        kept = f"no checkpoint was written (the first would have come at step {first})"
    msg = (
        f"training diverged at step {bad}: loss {loss}, gradient norm {grad_norm}"
        + (f", predictor's {predictor_norm}" if run.predictor_params else "")
        + " (learning rate "
        f"{lr_at(bad - 1, run.tc):.3g}); stopped at step {done} and saved nothing after it: "
        f"{kept}. Lower --lr or lengthen --warmup-steps, and start over (--overwrite)"
    )
    run.log.write({"step": bad, "diverged": msg})
    raise TrainingDiverged(msg)


def _log_step(
    run: _Run, done: int, out: MoDOutput, grad_norm: torch.Tensor, lr: float, bar: tqdm
) -> None:
    """A JSON line of the step's losses, learning rate, gradient norm and tokens/s."""
    now = time.perf_counter()
    tok_s = run.window_tokens / max(now - run.window_t, 1e-9)
    run.elapsed += now - run.window_t
    run.window_t, run.window_tokens = now, 0
    losses = {"loss": out.loss.item(), "lm_loss": out.lm_loss.item()}
    losses["aux_loss"] = out.aux_loss.item()
    if out.moe_loss is not None:
        losses["moe_loss"] = out.moe_loss.item()
    if out.distill_loss is not None:
        losses["distill_loss"] = out.distill_loss.item()
    if run.capacity_warmup:
        losses["capacity"] = run.model.config.capacity
    if out.expert_routes:
        losses["expert_share"] = expert_slot_shares(out)
    rec = {
        "step": done,
        **D.mean_nested(run.env, losses),  # the whole batch's, not this rank's
        "lr": lr,
        "grad_norm": grad_norm.item(),
        "tokens_per_s": tok_s,
        "tokens": done * run.tokens_per_step,
    }
    run.log.write(rec)
    bar.set_postfix(  # no forced redraw: the bar's own mininterval decides
        loss=f"{rec['lm_loss']:.3f}",
        aux=f"{rec['aux_loss']:.3f}",
        tok_s=f"{tok_s:,.0f}",
        refresh=False,
    )


def _evaluate_and_save(run: _Run, done: int, bar: tqdm) -> dict[str, Any]:
    """Validation in both routing modes, logged, then an atomic checkpoint; the time this takes
    is kept out of the tokens/s window."""
    t0 = time.perf_counter()
    set_capacity(run.model, run.model_config.capacity)  # evaluate and save at the target
    ev = _evaluate(run)
    losses = (ev["val_loss_topk"], ev["val_loss_causal"])
    if not all(math.isfinite(v) for v in losses):
        msg = (
            f"validation loss is not finite at step {done} (top-k {losses[0]}, causal "
            f"{losses[1]}) although training's was: no checkpoint written; the last good one "
            f"is step {run.saved_step} in {run.ckpt_dir}"
        )
        run.log.write({"step": done, "diverged": msg})
        raise TrainingDiverged(msg)
    diag = _routing_probe(run)
    run.log.write({"step": done, **ev, **({"routing_diag": diag} if diag else {})})
    bar.write(format_eval(done, ev))
    _checkpoint(run, done, run.elapsed + (t0 - run.window_t))
    run.window_t += time.perf_counter() - t0
    return ev


def _checkpoint(run: _Run, done: int, elapsed: float) -> None:
    """An atomic checkpoint of the run after `done` steps and `elapsed` training seconds (the
    logged time plus the window not yet logged: a checkpoint between log steps keeps it too);
    a collective under torchrun."""
    if run.sharded_checkpoints:  # every rank writes its shards
        save_sharded_checkpoint(
            run.ckpt_dir,
            run.model,
            run.opt,
            run.model_config,
            run.env,
            trainer_state=_trainer_state(run, done, elapsed),
            tokenizer=run.tokenizer,
        )
    else:
        weights, opt_state = D.full_state(run.model, run.opt)  # a collective when sharded
        if run.env.is_main:
            _save(run, weights, opt_state, _trainer_state(run, done, elapsed))
    D.barrier(run.env)  # no rank runs ahead of a checkpoint being written
    run.saved_step = done


@torch.no_grad()
def _routing_probe(run: _Run) -> dict[str, dict[str, float]]:
    """`routing_diagnostics` on the first validation batch (every rank runs it whole: the same
    weights give the same numbers, and a sharded model's forward is collective), with the share
    of decisions that flipped since the last evaluation."""
    if run.model_config.is_dense:
        return {}
    x = run.val[0][0].to(run.device)
    was = run.model.training
    run.model.eval()
    try:
        with autocast_for(run.device):
            topk = run.model(x, routing="topk").routes
            causal = run.model(x, routing="causal").routes
    finally:
        run.model.train(was)
    stats, masks = routing_diagnostics(run.model_config, topk, causal)
    flips = decision_flips(run.probe_masks, masks)
    for name, row in stats.items():
        for mode in ("topk", "causal"):
            row[f"{mode}_flips"] = flips.get(f"{name}/{mode}", float("nan"))
    run.probe_masks = masks
    return stats


def pack_masks(masks: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Bool masks as JSON: shape and the bits, packed 8 to a byte, in hex."""
    out = {}
    for key, m in masks.items():
        bits = m.flatten().to(torch.uint8)
        bits = torch.cat([bits, bits.new_zeros(-len(bits) % 8)]).reshape(-1, 8)
        packed = (bits << torch.arange(7, -1, -1, dtype=torch.uint8)).sum(1, dtype=torch.uint8)
        out[key] = {"shape": list(m.shape), "bits": bytes(packed.tolist()).hex()}
    return out


def unpack_masks(packed: dict[str, dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The inverse of `pack_masks`."""
    out = {}
    for key, v in packed.items():
        raw = torch.tensor(list(bytes.fromhex(v["bits"])), dtype=torch.uint8)
        bits = (raw[:, None] >> torch.arange(7, -1, -1, dtype=torch.uint8)) & 1
        n = math.prod(v["shape"])
        out[key] = bits.flatten()[:n].bool().reshape(v["shape"])
    return out


def _evaluate(run: _Run) -> dict[str, Any]:
    """`evaluate` on this rank's rows of every validation batch, averaged over the ranks (every
    rank evaluates whole batches when the world size does not divide them)."""
    env, batches = run.env, run.val
    if env.active and all(len(x) % env.world_size == 0 for x, _ in batches):
        batches = [(x[D.local_rows(env, len(x))], y[D.local_rows(env, len(y))]) for x, y in batches]
        return D.mean_nested(env, evaluate(run.model, batches, run.device))
    return evaluate(run.model, batches, run.device)


def _save(
    run: _Run, weights: dict[str, torch.Tensor] | None, opt_state: dict | None, state: dict
) -> None:
    save_checkpoint(
        run.ckpt_dir,
        run.model,
        run.model_config,
        weights=weights,
        optimizer=run.opt if opt_state is None else opt_state,
        tokenizer=run.tokenizer,
        trainer_state=state,
    )


def _trainer_state(run: _Run, done: int, elapsed: float) -> dict[str, Any]:
    return {
        "step": done,
        "sampler": run.sampler.state_dict(),
        "data_fingerprint": run.fingerprint,
        "elapsed_s": elapsed,
        "train_config": dataclasses.asdict(run.tc),
        # How it was written (informational: any world size and mode resumes either kind).
        "checkpoint_format": "sharded" if run.sharded_checkpoints else "whole",
        "world_size": run.env.world_size,
        "parallel": run.parallel,
        "routing_probe": pack_masks(run.probe_masks),
        "capacity_warmup_steps": run.capacity_warmup,
        "rng": _rng_state(run.device),
    }


def mean_expert_share(metrics_path: Path) -> dict[str, float]:
    """Per expert layer, the mean over the logged training steps of the share of slots that ran
    a real expert (read from the log, so a resumed run counts its steps before the resume)."""
    sums: dict[str, float] = {}
    n = 0
    for line in metrics_path.read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if "expert_share" in rec:
            n += 1
            for k, v in rec["expert_share"].items():
                sums[k] = sums.get(k, 0.0) + v
    return {k: v / n for k, v in sums.items()}


def _finish(run: _Run, last_eval: dict[str, Any]) -> dict[str, Any]:
    """The run's summary (also written to summary.json) and its loss plot."""
    tc = run.tc
    summary = {
        "out": str(run.out_dir),
        "checkpoint": str(run.ckpt_dir),
        "steps": tc.steps,
        "tokens": tc.steps * run.tokens_per_step,
        "train_time_s": run.elapsed,
        "params": run.model.num_params(),
        "layer_kinds": run.model_config.layer_kinds,
        "capacity": run.model_config.capacity,
        **last_eval,
    }
    if not run.env.is_main:  # rank 0 writes the summary and the plot
        return summary
    if run.model_config.has_experts:
        summary["train_expert_share"] = mean_expert_share(run.out_dir / "metrics.jsonl")
    write_json(run.out_dir / "summary.json", summary)
    try:
        plot_metrics(run.out_dir / "metrics.jsonl", run.out_dir / "loss.png")
        summary["plot"] = str(run.out_dir / "loss.png")
    except Exception as exc:  # a plot is a convenience: never lose a finished run over it
        summary["plot_error"] = repr(exc)
    return summary


def train(
    model_config: MoDConfig | None,
    tc: TrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Train (or resume) and return a summary. With `resume`, `model_config` may be None.

    A new run refuses an `out` that already holds a run unless `overwrite`, which deletes that
    run first. One run per folder: a lock (`runlock.RunLock`) refuses a second process. A loss or
    gradient norm that is not finite stops the run with `TrainingDiverged` at the next log or
    eval boundary, before anything after it is saved. On the CPU a resumed run reproduces an
    uninterrupted one bit for bit; on CUDA, nondeterministic kernels (flash-attention backward,
    index_add) make even two uninterrupted runs differ slightly.
    """
    out_dir = Path(tc.out)
    _check_out(out_dir)
    env = D.env_from_torchrun()
    device = resolve_device(tc.device)  # a bad device is an error before anything is created
    if env.active and device.type == "cuda":
        device = torch.device("cuda", env.local_rank)
    D.init(env, device)
    try:
        # One run per folder: rank 0 holds the lock for the job.
        with RunLock(out_dir) if env.is_main else contextlib.nullcontext():
            run = _start(model_config, tc, resume, overwrite, env, device)
            summary = _train_loop(run, progress and env.is_main)
        # Every rank done before the group is torn down: gloo aborts a process whose peers
        # destroy the group while it still runs ("terminate called without an active exception").
        D.barrier(env)
        return summary
    finally:
        D.shutdown(env)


def _train_loop(run: _Run, progress: bool) -> dict[str, Any]:
    tc = run.tc
    last_eval: dict[str, Any] = {}
    bar = tqdm(
        total=tc.steps,
        initial=run.start_step,
        disable=not progress,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        # In a log file (CI, nohup) a redraw every 0.1 s is noise: one line every 30 s instead.
        mininterval=0.1 if sys.stderr.isatty() else 30.0,
    )
    try:
        run.window_t = time.perf_counter()
        for step in range(run.start_step, tc.steps):
            out, grad_norm, lr = _train_step(run, step)
            done = step + 1
            if done % tc.log_every == 0 or done == tc.steps:
                _check_finite(run, done)
                _log_step(run, done, out, grad_norm, lr, bar)
            bar.update(1)
            if done % tc.eval_every == 0 or done == tc.steps:
                _check_finite(run, done)
                last_eval = _evaluate_and_save(run, done, bar)
            elif tc.checkpoint_every and done % tc.checkpoint_every == 0:
                _check_finite(run, done)
                t0 = time.perf_counter()
                _checkpoint(run, done, run.elapsed + (t0 - run.window_t))
                run.window_t += time.perf_counter() - t0  # kept out of tokens/s, as evals are
    finally:
        bar.close()
    if not last_eval:  # resumed at the final step: nothing left to train
        last_eval = _evaluate(run)
    return _finish(run, last_eval)


def format_eval(step: int, ev: dict[str, Any]) -> str:
    parts = [
        f"step {step}: val loss top-k {ev['val_loss_topk']:.4f}, causal {ev['val_loss_causal']:.4f}"
    ]
    if ev["routing_accuracy"]:
        acc = ", ".join(f"L{k} {v:.1%}" for k, v in ev["routing_accuracy"].items())
        parts.append(f"routing accuracy {acc}")
    if ev["causal_take_rate"]:
        take = ", ".join(f"L{k} {v:.1%}" for k, v in ev["causal_take_rate"].items())
        parts.append(f"causal take-rate {take}")
    if ev.get("expert_take_rate"):
        rate = ", ".join(f"L{k} {v:.1%}" for k, v in ev["expert_take_rate"].items())
        parts.append(f"tokens running a real expert {rate}")
    return " | ".join(parts)


def format_eval_lines(ev: dict[str, Any]) -> list[str]:
    """Validation loss in both modes, then routing accuracy and take-rate per router."""
    lines = [
        f"validation loss (nats/token): top-k {ev['val_loss_topk']:.4f}   "
        f"causal {ev['val_loss_causal']:.4f}"
    ]
    for k, v in ev["routing_accuracy"].items():
        take = ev["causal_take_rate"].get(k)
        extra = f", causal take-rate {take:.1%}" if take is not None else ""
        lines.append(f"routing accuracy layer {k}: {v:.2%}{extra}")
    if ev.get("expert_take_rate"):
        rate = ", ".join(f"L{k} {v:.1%}" for k, v in ev["expert_take_rate"].items())
        lines.append(f"tokens running a real expert (causal forward): {rate}")
    if ev.get("prefill_calibration"):
        pc = ev["prefill_calibration"]
        lines.append(
            f"prefill calibration (teacher-forced second half): causal prefill "
            f"{pc['loss_causal_prefill']:.4f}, top-k prefill {pc['loss_topk_prefill']:.4f} "
            f"({pc['loss_gap']:+.4f}); prompt decisions that differ {pc['decisions_differ']:.1%}"
        )
    if ev.get("train_expert_share"):
        share = ", ".join(f"L{k} {v:.1%}" for k, v in ev["train_expert_share"].items())
        lines.append(f"expert slots run in training (mean over logged steps): {share}")
    return lines


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"trained {s['steps']} steps, {s['tokens']:,} tokens in {s['train_time_s']:.0f} s "
        f"({s['params'] / 1e6:.2f}M parameters, layers {s['layer_kinds']}, "
        f"capacity {s['capacity']})",
        *format_eval_lines(s),
    ]
    lines.append(f"checkpoint: {s['checkpoint']}")
    if "plot" in s:
        lines.append(f"loss curve: {s['plot']}")
    return "\n".join(lines)


def plot_metrics(metrics_path: Path, png_path: Path) -> None:
    """Training and validation loss curves to a PNG (matplotlib, headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train_rows = [r for r in rows if "lm_loss" in r]
    eval_rows = [r for r in rows if "val_loss_topk" in r]
    routed = bool(eval_rows and eval_rows[-1]["routing_accuracy"])
    fig, axes = plt.subplots(
        1, 2 if routed else 1, figsize=(12 if routed else 7, 4), dpi=120, squeeze=False
    )
    ax = axes[0, 0]
    ax.plot(
        [r["step"] for r in train_rows],
        [r["lm_loss"] for r in train_rows],
        lw=1,
        label="train LM loss (top-k)",
    )
    for key, style in (("val_loss_topk", "o-"), ("val_loss_causal", "s--")):
        ax.plot(
            [r["step"] for r in eval_rows],
            [r[key] for r in eval_rows],
            style,
            label=key.replace("_", " "),
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    if routed:  # causal decision vs top-k, per router: how honest causal sampling will be
        ax = axes[0, 1]
        for name in eval_rows[-1]["routing_accuracy"]:
            ax.plot(
                [r["step"] for r in eval_rows],
                [100 * r["routing_accuracy"].get(name, float("nan")) for r in eval_rows],
                "o-",
                label=f"layer {name}",
            )
        ax.set_xlabel("step")
        ax.set_ylabel("routing accuracy (%)")
        ax.set_title("causal decision vs top-k membership", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    tmp = png_path.with_name(f".{png_path.name}.tmp")  # a kill leaves it for the next start
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(png_path)


def evaluate_checkpoint(
    checkpoint: str | Path,
    data: str | None = None,
    n_batches: int | None = None,
    batch_size: int | None = None,
    device: str = "auto",
    prefill_calibration: bool = False,
) -> dict[str, Any]:
    """`mod eval`: validation loss in both modes and routing accuracy of a saved model.

    `n_batches` / `batch_size` None: the run's own (from the checkpoint), so the numbers match
    its last evaluation; a given value must be >= 1. `prefill_calibration` (MoD models): also
    `generate.prefill_calibration` on the first batch, prompts of half the sequence.
    """
    for name, value in (("n_batches", n_batches), ("batch_size", batch_size)):
        Range(lo=1, integer=True, optional=True).check(name, value)
    dev = resolve_device(device)
    ckpt = resolve_checkpoint(checkpoint)
    model, cfg = load_model(ckpt, map_location=dev)
    tokenizer = load_tokenizer(ckpt)
    # Evaluate as the run did: its data and its sequence length (k = floor(capacity * T)).
    saved: dict[str, Any] = {}
    if (ckpt / "trainer.json").exists():
        saved = read_json_file(ckpt / "trainer.json").get("train_config", {})
        if not isinstance(saved, dict):
            raise corrupt(ckpt / "trainer.json", "'train_config' must be an object")

    def run_setting(name: str, given: Any, default: Any) -> Any:
        value = given if given is not None else saved.get(name)
        return default if value is None else value

    data = run_setting("data", data, None)
    seq_len = run_setting("seq_len", None, cfg.max_seq_len)
    batch_size = run_setting("batch_size", batch_size, TrainConfig.batch_size)
    n_batches = run_setting("eval_batches", n_batches, TrainConfig.eval_batches)
    _, val_tokens, _ = load_splits(data, tokenizer)
    batches = eval_batches(val_tokens, batch_size, seq_len, n_batches)
    out = {"checkpoint": str(ckpt), **evaluate(model, batches, dev)}
    if prefill_calibration:
        if cfg.is_dense:
            raise ValueError(
                "prefill calibration compares routing decisions: a dense model has none"
            )
        from .generate import prefill_calibration as calibrate

        x = batches[0][0]
        out["prefill_calibration"] = calibrate(model, x, max(1, x.shape[1] // 2))
    return out
