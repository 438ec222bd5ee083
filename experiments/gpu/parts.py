"""What each process of the GPU plan does (`running` starts them, each under a hard timeout):
`prepare` (the BPE tokenizer and the token cache, once, and the corpus's size), `time_arm` (an
arm's training steps and evaluation forwards, timed while the other arms' processes run too) and
`train_run` (one run of the plan, trained, profiled and appended to the results)."""

from __future__ import annotations

import dataclasses
import json
import platform
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from mixture_of_depths.config import MoDConfig
from mixture_of_depths.data import BatchSampler, corpus_files, load_splits
from mixture_of_depths.fileio import atomic_write_text, json_text
from mixture_of_depths.model import MoDTransformer
from mixture_of_depths.precision import autocast_for
from mixture_of_depths.studies import rounds
from mixture_of_depths.studies.profiles import place_edges, position_profile
from mixture_of_depths.studies.runner import RunSpec, run_one
from mixture_of_depths.train import TrainConfig
from mixture_of_depths.train.config import make_optimizer

from .planning import GpuSettings


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def dtype_name() -> str:
    """What the trainer computes in here: bf16 autocast on CUDA (float32 weights and
    optimizer), float32 on a CPU (`precision.autocast_for`)."""
    return "bfloat16 autocast" if torch.cuda.is_available() else "float32"


def prepare(data: str | None, out: Path) -> dict[str, Any]:
    """Train the BPE tokenizer and tokenize the corpus once (cached: the runs' processes load
    them), and write the corpus's size to `out`."""
    t0 = time.perf_counter()
    train, val, tok = load_splits(data, "bpe")
    info = {
        "data": data or "the running Python's standard library",
        "python": platform.python_version(),
        "files": len(corpus_files(data)),
        "train_tokens": len(train),
        "val_tokens": len(val),
        "vocab_size": tok.vocab_size,
        "prepare_s": time.perf_counter() - t0,
    }
    atomic_write_text(out, json_text(info, indent=1) + "\n")
    return info


def time_arm(
    s: GpuSettings,
    spec: RunSpec,
    data: str | None,
    launched: float,
    start_at: float,
    seconds: float,
    out: Path,
) -> dict[str, Any]:
    """Seconds per training step of `spec`'s model (forward, backward, clipping, AdamW, bf16
    autocast on CUDA: the trainer's step) from `start_at` for 3/4 of `seconds` (wall clock,
    so that every arm's process is timed at once), then per evaluation forward for the rest;
    `launched`: when the process was started (its start-up time counts from there)."""
    g = s.round3.grid
    dev = device()
    train_tokens = load_splits(data, "bpe")[0]
    sampler = BatchSampler(train_tokens, g.batch_size, g.seq_len, seed=spec.seed)
    torch.manual_seed(spec.seed)
    model = MoDTransformer(MoDConfig(**spec.model)).to(dev)
    opt = make_optimizer(model, TrainConfig(out="unused", lr=spec.lr or TrainConfig.lr))

    def step() -> None:
        x, y = (t.to(dev, non_blocking=True) for t in sampler.next_batch())
        with autocast_for(dev):
            loss = model(x, y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def forward() -> None:
        x, y = (t.to(dev) for t in sampler.next_batch())
        with torch.no_grad(), autocast_for(dev):
            model(x, y, routing="topk").lm_loss.item()

    for _ in range(3):  # warm-up: allocations, kernels' first launches
        step()
        forward()
    sync()
    startup = time.time() - launched
    time.sleep(max(0.0, start_at - time.time()))
    step_s = timed_until(step, start_at + 0.75 * seconds)
    forward_s = timed_until(forward, start_at + seconds)
    res = {"step_s": step_s, "forward_s": forward_s, "startup_s": startup,
           "tokens_per_s": g.batch_size * g.seq_len / step_s}  # fmt: skip
    atomic_write_text(out, json_text(res) + "\n")
    return res


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_until(fn: Any, until: float, least: int = 3) -> float:
    """Mean seconds of `fn()` over the calls made before wall-clock `until` (at least `least`)."""
    sync()
    t0, n = time.perf_counter(), 0
    while n < least or time.time() < until:
        fn()
        n += 1
    sync()
    return (time.perf_counter() - t0) / n


def train_run(
    s: GpuSettings, job: dict[str, Any], out: Path, work: Path, data: str | None
) -> dict[str, Any]:
    """Train the job's run (resuming from its checkpoint if it has one), profile its loss by
    place on the device, and append its row to ``<out>/results.jsonl`` under the results lock;
    its metrics go to ``<out>/metrics``, its run folder is deleted."""
    spec = RunSpec(**job["spec"])
    t0 = time.perf_counter()
    row = run_one(spec, s.round3.grid, work, data)
    folder = work / spec.name
    g = s.round3.grid
    row["loss_by_position"] = position_profile(
        folder / "checkpoint", data, g.batch_size, g.seq_len, g.eval_batches,
        edges=place_edges(g.seq_len), device=device(),
    )  # fmt: skip
    row.update(job["extra"])
    row.update(
        device=device_name(),
        dtype=dtype_name(),
        run_wall_s=time.perf_counter() - t0,  # wall_s: the training's; this: with the profile
        epochs=row["tokens"] / job["extra"]["corpus_train_tokens"],
    )
    (out / "metrics").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(folder / "metrics.jsonl", out / "metrics" / f"{spec.name}.jsonl")
    with rounds.waiting_lock(work / ".claims", "results"):
        rounds.append_row(out / "results.jsonl", row)
    shutil.rmtree(folder, ignore_errors=True)
    return row


def write_job(path: Path, spec: RunSpec, extra: dict[str, Any]) -> None:
    """The file a run's process reads its spec and its row's extra fields from."""
    atomic_write_text(path, json_text({"spec": dataclasses.asdict(spec), "extra": extra}) + "\n")


def read_job(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())
