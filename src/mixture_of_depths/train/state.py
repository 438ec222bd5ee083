"""What a training run holds while it trains, and what of it a checkpoint keeps.

`Run` is built by `setup.start`; `Run.state_dict()` is the trainer state written beside the
weights (``trainer.json``) and `Run.load_state_dict` restores it, so that a resumed run goes on
exactly where the saved one stopped: the data position, the training time, the capacity warm-up,
the routing probe's last decisions and the global generators' states.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import MoDConfig
from ..data import BatchSampler, Tokenizer
from ..fileio import atomic_write_text, json_text
from ..model import MoDTransformer
from ..runtime import distributed as D
from ..runtime.checkpoint import corrupt
from .config import TrainConfig

CHECKPOINT_NAME = "checkpoint"


@dataclass
class Clock:
    """Training seconds, evaluation and checkpoints kept out, and the tokens/s window."""

    elapsed: float = 0.0  # training seconds up to the start of the current window
    window_t: float = 0.0  # start of the current tokens/s window
    window_tokens: int = 0

    def start(self) -> None:
        self.window_t = time.perf_counter()

    def lap(self) -> float:
        """Close the window (a log step): its tokens/s; the next window starts now."""
        now = time.perf_counter()
        tok_s = self.window_tokens / max(now - self.window_t, 1e-9)
        self.elapsed += now - self.window_t
        self.window_t, self.window_tokens = now, 0
        return tok_s

    @contextlib.contextmanager
    def paused(self) -> Iterator[float]:
        """Time spent inside is not training time. Yields the training seconds so far (those
        logged and the window not yet logged: what a checkpoint between log steps keeps)."""
        t0 = time.perf_counter()
        try:
            yield self.elapsed + (t0 - self.window_t)
        finally:
            self.window_t += time.perf_counter() - t0


@dataclass
class FiniteWatch:
    """The first step whose loss or a gradient norm was not finite (0: none yet) and those
    values (loss, the LM's norm, the predictor's), kept on the device: watching costs no host
    sync, so accelerators run ahead; `first_bad` looks, at log and eval boundaries."""

    bad_step: torch.Tensor
    bad_values: torch.Tensor

    @classmethod
    def on(cls, device: torch.device) -> FiniteWatch:
        return cls(torch.zeros((), dtype=torch.int64, device=device), torch.zeros(3, device=device))

    def record(self, done: int, loss: torch.Tensor, *grad_norms: torch.Tensor) -> None:
        """Remember step `done` if it is the first with a non-finite value: device ops only."""
        values = torch.stack([loss.detach().float(), *(g.detach().float() for g in grad_norms)])
        values = torch.cat([values, values.new_zeros(3 - len(values))])
        first = (self.bad_step == 0) & ~torch.isfinite(values).all()
        self.bad_step = torch.where(first, done, self.bad_step)
        self.bad_values = torch.where(first, values, self.bad_values)

    def first_bad(self, env: D.DistEnv) -> int:
        """The first bad step on any rank (0: none): the host sync, once per boundary."""
        return D.max_over_ranks(env, int(self.bad_step))


@dataclass
class Run:
    """A training run in progress: what `setup.start` built, and what changes as it trains."""

    tc: TrainConfig
    out_dir: Path
    device: torch.device
    model: MoDTransformer
    model_config: MoDConfig
    opt: torch.optim.AdamW
    sampler: BatchSampler
    val: list[tuple[torch.Tensor, torch.Tensor]]
    tokenizer: Tokenizer
    fingerprint: str  # of the training token stream: a resume must read the same tokens
    log: MetricsLog | NoLog
    step_fn: Any  # what a step calls: the model, or DDP / compiled / distilled around it
    env: D.DistEnv
    parallel: str  # "none" (one process), "ddp" or "fsdp"
    capacity_warmup: int  # steps of capacity warm-up (`config.capacity_warmup_steps`)
    start_step: int = 0
    saved_step: int = 0  # the step of the last checkpoint written (or resumed from)
    clock: Clock = dataclasses.field(default_factory=Clock)
    watch: FiniteWatch | None = None
    # The routing decisions on the probe batch at the last evaluation, to count the flips at the
    # next one (`routing_diag` in the log); saved with the checkpoint so a resume counts alike.
    probe_masks: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    # With `tc.calibrate`: the validation windows the end-of-run calibration reads, or why it
    # is skipped (`calibrate.calibration_set`); once done, the thresholds it fitted and those
    # the run trained with (kept in trainer.json: a resume goes on with the latter).
    calib_batches: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)
    calib_skip: str | None = None
    calibration: dict[str, Any] | None = None
    # The predictor is clipped on its own: its gradient must not rescale the LM's update.
    lm_params: list[torch.nn.Parameter] = dataclasses.field(init=False)
    predictor_params: list[torch.nn.Parameter] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.watch = self.watch or FiniteWatch.on(self.device)
        named = list(self.model.named_parameters())
        self.lm_params = [p for n, p in named if ".predictor." not in n]
        self.predictor_params = [p for n, p in named if ".predictor." in n]

    @property
    def ckpt_dir(self) -> Path:
        return self.out_dir / CHECKPOINT_NAME

    @property
    def seq_len(self) -> int:
        return self.tc.seq_len or self.model_config.max_seq_len

    @property
    def tokens_per_step(self) -> int:
        return self.tc.batch_size * self.seq_len

    @property
    def sharded_checkpoints(self) -> bool:
        fmt = self.tc.checkpoint_format
        return fmt == "sharded" or (fmt == "auto" and self.parallel == "fsdp")

    def state_dict(self, step: int, elapsed: float) -> dict[str, Any]:
        """The trainer state after `step` steps and `elapsed` training seconds."""
        return {
            "step": step,
            "sampler": self.sampler.state_dict(),
            "data_fingerprint": self.fingerprint,
            "elapsed_s": elapsed,
            "train_config": dataclasses.asdict(self.tc),
            # How it was written (informational: any world size and mode resumes either kind).
            "checkpoint_format": "sharded" if self.sharded_checkpoints else "whole",
            "world_size": self.env.world_size,
            "parallel": self.parallel,
            "routing_probe": pack_masks(self.probe_masks),
            "capacity_warmup_steps": self.capacity_warmup,
            "rng": _rng_state(self.device),
            **({"calibration": self.calibration} if self.calibration else {}),
        }

    def load_state_dict(self, state: dict[str, Any], path: Path) -> None:
        """Go on from a saved trainer state (read from `path`, which errors name). The
        generators are set last: loading a teacher draws from them too."""
        self.start_step = self.saved_step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self.clock.elapsed = float(state.get("elapsed_s", 0.0))
        # Fixed at the start: a resume that extends --steps keeps the warm-up it began with.
        self.capacity_warmup = int(state.get("capacity_warmup_steps", self.tc.capacity_warmup))
        self.probe_masks = unpack_masks(state.get("routing_probe", {}))
        if "rng" in state:
            _restore_rng(path, state["rng"], self.device)


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


class NoLog:
    """The metrics log of a rank other than 0: rank 0 writes the (rank-averaged) lines."""

    def write(self, record: dict[str, Any]) -> None:
        pass


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
    tensors = rng_tensors(path, states)
    torch.set_rng_state(tensors["cpu"])
    if device.type == "cuda" and "cuda" in tensors:
        try:
            torch.cuda.set_rng_state(tensors["cuda"], device)
        except RuntimeError as exc:
            raise corrupt(path, f"its 'rng' CUDA state cannot be restored ({exc})") from None


def rng_tensors(path: Path, states: Any) -> dict[str, torch.Tensor]:
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
