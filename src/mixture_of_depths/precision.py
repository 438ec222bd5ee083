"""The precision rules every path shares: what runs in at least float32, and when to autocast."""

from __future__ import annotations

import torch


def at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """float32 for bf16/fp16, the dtype itself for float32 and float64.

    Losses, rotary tables, router logits and the logits generation hands out use it: bf16
    rounding there would flip routing decisions and blur losses, while a float64 model stays
    float64 end to end (the tests' exact oracles rely on that).
    """
    return torch.promote_types(dtype, torch.float32)


def autocast_for(device: torch.device | str, dtype: str | None = None) -> torch.autocast:
    """The autocast context of a training or benchmark step.

    `dtype` "bfloat16" or "float32"; None picks bf16 on CUDA and float32 elsewhere (the CPU's bf16
    matmuls are slower than its float32 ones).
    """
    device = torch.device(device)
    if dtype is None:
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype must be 'bfloat16' or 'float32', got {dtype!r}")
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")
