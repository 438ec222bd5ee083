"""Training on several processes with PyTorch's own engine: `torchrun` starts them, this module
reads what torchrun set and joins the process group.

Launch (docs: README, "Distributed training"): ``torchrun --nproc_per_node N -m
mixture_of_depths train ...``. `mod train` sees torchrun's environment (``WORLD_SIZE`` > 1) and
trains data-parallel with DDP: every rank holds the whole model, reads the same global batch
(``--batch-size`` stays the global batch, so hyperparameters do not change with the number of
processes) and runs its own rows of it, ``batch_size / world_size`` of them, in ``--grad-accum``
micro-batches; gradients are averaged across ranks. Losses, routing metrics and evaluation are
averaged over ranks, so the log is the whole batch's, not rank 0's. Rank 0 alone writes files.

The backend is gloo on the CPU and NCCL on CUDA (each rank on ``cuda:LOCAL_RANK``); multi-node
is the same command with torchrun's rendezvous flags.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job: one process is rank 0 of a world of 1."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1


def env_from_torchrun() -> DistEnv:
    """What torchrun set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``); one process without it."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError as exc:
        raise ValueError(
            f"torchrun's RANK / WORLD_SIZE / LOCAL_RANK must be integers: {exc}"
        ) from None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} must be in [0, WORLD_SIZE={world})")
    return DistEnv(rank, world, local)


def init(env: DistEnv, device: torch.device) -> None:
    """Join the process group (gloo on the CPU, NCCL on CUDA) unless one process or joined."""
    if not env.active or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size)


def shutdown(env: DistEnv) -> None:
    if env.active and dist.is_initialized():
        dist.destroy_process_group()


def barrier(env: DistEnv) -> None:
    if env.active:
        dist.barrier()


def local_rows(env: DistEnv, batch_size: int) -> slice:
    """This rank's rows of a global batch of `batch_size` (which the world size divides)."""
    per = batch_size // env.world_size
    return slice(env.rank * per, (env.rank + 1) * per)


def mean_over_ranks(env: DistEnv, values: dict[str, float]) -> dict[str, float]:
    """Each value averaged over the ranks (in float64, in sorted key order on every rank)."""
    if not env.active or not values:
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return {k: float(v) / env.world_size for k, v in zip(keys, t.tolist(), strict=True)}


def max_over_ranks(env: DistEnv, value: int) -> int:
    """The largest of the ranks' `value`."""
    if not env.active:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def mean_nested(env: DistEnv, values: dict) -> dict:
    """`mean_over_ranks` of the numbers in a dict of numbers and dicts of numbers (an
    evaluation's result); other entries are kept as this rank has them."""
    if not env.active:
        return values
    flat = {}
    for k, v in values.items():
        if isinstance(v, dict):
            flat.update({f"{k}\x00{kk}": vv for kk, vv in v.items()})
        elif isinstance(v, int | float) and not isinstance(v, bool):
            flat[k] = v
    mean = mean_over_ranks(env, flat)
    out = dict(values)
    for key, v in mean.items():
        if "\x00" in key:
            outer, inner = key.split("\x00", 1)
            out[outer] = {**out[outer], inner: v}
        else:
            out[key] = v
    return out


def broadcast_object(env: DistEnv, obj: object) -> object:
    """Rank 0's `obj` on every rank."""
    if not env.active:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
