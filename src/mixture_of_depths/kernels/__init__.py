"""Fused kernels for the routed block (optional; the PyTorch path is the reference): the gather
of the chosen rows fused into the first projection (RMSNorm and QKV, or the MLP's first matmul:
a matmul whose A rows are read through an index vector) and the gated scatter-add of the
block's output fused into the last projection's epilogue (``out[idx[i]] += g[i] * (A @ W)[i]``).

Off by default. `enable()` switches the routed block's top-k path (training) to them where they
apply (`fused.applies`); `available()` says whether they can run here: Triton installed (the
``[gpu]`` extra) and a CUDA device, or Triton's interpreter (``TRITON_INTERPRET=1``, how the
tests run them on a CPU). docs/bench.md, "GPU", says what they save.

`reference`: the same ops in PyTorch (the oracle); `ops`: the Triton kernels and their autograd
functions; `fused`: the routed block's forward built on them.
"""

from __future__ import annotations

import importlib.util
import os

import torch

_ENABLED = [False]


def available() -> bool:
    """Triton is installed and has somewhere to run (a CUDA device, or its interpreter)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def enable(on: bool = True) -> None:
    """Route the routed blocks' top-k gather and scatter through the fused kernels (or back)."""
    if on and not available():
        raise RuntimeError(
            "the fused kernels need Triton (pip install '.[gpu]') and a CUDA device, or "
            "TRITON_INTERPRET=1 to run them (slowly) on a CPU"
        )
    _ENABLED[0] = on


def enabled() -> bool:
    return _ENABLED[0]


__all__ = ["available", "enable", "enabled"]
