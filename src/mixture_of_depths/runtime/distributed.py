"""Training on several processes with PyTorch's own engine: `torchrun` starts them, this module
reads what torchrun set and joins the process group.

Launch (docs/distributed.md): ``torchrun --nproc_per_node N -m
mixture_of_depths train ...``. `mod train` sees torchrun's environment (``WORLD_SIZE`` > 1) and
trains data-parallel with DDP: every rank holds the whole model, reads the same global batch
(``--batch-size`` stays the global batch, so hyperparameters do not change with the number of
processes) and runs its own rows of it, ``batch_size / world_size`` of them, in ``--grad-accum``
micro-batches; gradients are averaged across ranks. Losses, routing metrics and evaluation are
averaged over ranks, so the log is the whole batch's, not rank 0's. Rank 0 writes the log and
whole checkpoints; every rank writes its shard of a sharded one (`checkpoint`, `sharded`).

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


def restarted() -> bool:
    """Whether torchrun (``--max-restarts``) restarted this job after a worker failed."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")


def init(env: DistEnv, device: torch.device) -> None:
    """Join the process group unless one process or joined: gloo on the CPU; on CUDA, NCCL for
    CUDA tensors and gloo for the CPU ones (the metrics averaged over ranks, the objects rank 0
    broadcasts, DCP's plans), each rank on its own GPU."""
    if not env.active or dist.is_initialized():
        return
    backend = "gloo"
    if device.type == "cuda":
        # Before the group: NCCL and object collectives use the current device, cuda:0 unless set.
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    if not restarted():
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size)
        return
    # After a restart the rendezvous store still holds the dead attempt's addresses under the
    # default group's keys: join under keys of this attempt's own.
    from datetime import timedelta

    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        env.world_size,
        is_master=not agent and env.is_main,
        timeout=timedelta(minutes=10),
    )
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    prefixed = dist.PrefixStore(f"mixture_of_depths/attempt_{attempt}", store)
    dist.init_process_group(backend, store=prefixed, rank=env.rank, world_size=env.world_size)


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


# -- FSDP2 ---------------------------------------------------------------------------------------
def choose_parallel(env: DistEnv, choice: str, model: torch.nn.Module, device: torch.device) -> str:
    """The data-parallel mode: "none" for one process; else `choice`, where "auto" is DDP unless
    the weights, gradients and two AdamW moments of the whole model would fill more than half of
    a GPU's memory."""
    if not env.active:
        return "none"
    if choice != "auto":
        return choice
    if device.type == "cuda":
        need = 4 * sum(p.numel() * p.element_size() for p in model.parameters())
        if need > 0.5 * torch.cuda.get_device_properties(device).total_memory:
            return "fsdp"
    return "ddp"


def shard(model: torch.nn.Module, env: DistEnv, device: torch.device) -> None:
    """FSDP2 in place: each block one unit, the rest (embedding, final norm, the tied head) the
    root's. On the CPU the mesh is an explicit CPU mesh. Every rank calls every block each step
    (a routed block that takes no token still runs its forward), so the units' all-gathers line
    up across ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (env.world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def shard_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """After loading a whole (single-file) optimizer state into a sharded model's optimizer:
    each moment sharded as its parameter is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for group in opt.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor) or p not in opt.state:
                continue
            st = opt.state[p]
            for k, v in list(st.items()):
                if torch.is_tensor(v) and not isinstance(v, DTensor) and v.shape == p.shape:
                    st[k] = distribute_tensor(v.to(p.device), p.device_mesh, p.placements)


def full(x: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return x.full_tensor() if isinstance(x, DTensor) else x


def full_state(
    model: torch.nn.Module, opt: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor] | None, dict | None]:
    """The whole weights (tied ones once) and optimizer state of a sharded model, gathered on
    every rank (collectives, in the same order everywhere); (None, None) when nothing is
    sharded, for the plain path."""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return None, None
    weights, seen = {}, set()
    for name, t in model.state_dict().items():
        key = id(t)
        if key in seen:  # a tied parameter: stored once, as the plain path does
            continue
        seen.add(key)
        weights[name] = full(t).detach().cpu()
    sd = opt.state_dict()
    state = {
        pid: {k: full(v).detach().cpu() if torch.is_tensor(v) else v for k, v in st.items()}
        for pid, st in sd["state"].items()
    }
    return weights, {"state": state, "param_groups": sd["param_groups"]}
