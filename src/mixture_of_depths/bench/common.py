"""Helpers shared by the benchmarks."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm

from ..precision import autocast_for


def cpu_snapshot() -> tuple[float, float, float] | None:
    """(wall-clock seconds of all CPUs, busy seconds of all CPUs, CPU seconds of this process and
    of its finished children, such as `bench.memory`'s measuring processes).

    Two snapshots give the share of the machine other processes used in between (Linux
    /proc/stat; None elsewhere): on a shared CPU they make timings noisy and unfair.
    """
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        hz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    idle = ticks[3] + ticks[4]  # idle + iowait
    t = os.times()
    return (
        sum(ticks) / hz,
        (sum(ticks) - idle) / hz,
        t.user + t.system + t.children_user + t.children_system,
    )


def others_busy(before: tuple | None, after: tuple | None) -> float | None:
    """Share of all CPUs that other processes kept busy between two `cpu_snapshot`s."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    total, busy, mine = (a - b for a, b in zip(after, before, strict=True))
    return min(1.0, max(0.0, (busy - mine) / total))


def fmt_bytes(n: float | None, digits: int = 2) -> str:
    """Bytes in B / KiB / MiB / GiB; "-" for None (not measured)."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    raise AssertionError


# -- timing ---------------------------------------------------------------------------------------
def interleaved(
    fns: dict[str, Callable[[], Any]],
    warmup: int,
    repeats: int,
    sync: Callable[[], None],
    bar: tqdm | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each function over `repeats` rounds after `warmup` untimed rounds;
    every round runs each function once, in an order that rotates every round."""
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rnd in range(warmup + repeats):
        order = names[rnd % len(names) :] + names[: rnd % len(names)]
        for name in order:
            sync()
            t0 = time.perf_counter()
            fns[name]()
            sync()
            if rnd >= warmup:
                times[name].append(time.perf_counter() - t0)
            if bar is not None:
                bar.update(1)
    return times


def median_ms(ts: list[float]) -> float:
    """The median of `interleaved`'s seconds per call, in milliseconds."""
    return 1e3 * statistics.median(ts)


def spread(ts: list[float]) -> float:
    """(max - min) / median of the times: how far one run's rounds disagree."""
    return (max(ts) - min(ts)) / statistics.median(ts)


def train_step_fn(
    model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor, dtype: str
) -> Callable[[], None]:
    """One timed training step: forward and backward under `dtype` autocast, gradients dropped
    (the optimizer step costs the same for every model, so it is left out)."""

    def step() -> None:
        with autocast_for(idx.device, dtype):
            loss = model(idx, targets, routing="topk").loss
        loss.backward()
        for p in model.parameters():
            p.grad = None

    return step


def token_batch(
    args: argparse.Namespace, batch: int, seq_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The seeded batch every model of a comparison trains on: (inputs, targets)."""
    gen = torch.Generator().manual_seed(args.seed)
    data = torch.randint(0, 257, (batch, seq_len + 1), generator=gen).to(device)
    return data[:, :-1], data[:, 1:]
