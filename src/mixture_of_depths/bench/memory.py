"""Peak memory of one training step (forward + backward), measured in a fresh process.

Run as ``python -m mixture_of_depths.bench.memory '<json>'`` by `sections` (the memory section of
``mod bench``); prints one JSON line.

Two figures per model:

- ``saved_bytes``: bytes of the tensors autograd saves for the backward pass (activations),
  counted once per storage and without the parameters. Exact and deterministic: this is where
  "skipped tokens keep no activations in a routed block" shows.
- ``peak_bytes``: the step's peak memory above what was live before it (parameters, their
  gradients of the warm-up step freed). On CUDA `torch.cuda.max_memory_allocated`; on Linux CPUs
  the process's resident-set high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``)
  with glibc told to return freed blocks at once (``MALLOC_MMAP_THRESHOLD_``), so the mark
  follows live tensors rather than the allocator's cache. Elsewhere ``None``.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from ..config import MoDConfig
from ..fileio import json_text
from ..model import MoDTransformer
from ..precision import autocast_for

# glibc settings for the child process: big blocks mmapped and unmapped on free, heap trimmed.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def saved_activation_bytes(model: torch.nn.Module, run: Any) -> tuple[int, Any]:
    """Bytes of the distinct storages autograd saves while `run()` runs (parameters excluded),
    and what `run()` returned."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(seen.values()), out


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure(
    config: dict[str, Any],
    batch_size: int,
    seq_len: int,
    device: str = "cpu",
    dtype: str = "float32",
) -> dict:
    """Peak and saved-activation bytes of one top-k training step of `config` (under bf16
    autocast when `dtype` is "bfloat16", as the timed steps run)."""
    torch.manual_seed(0)
    dev = torch.device(device)
    cfg = MoDConfig(**config)
    model = MoDTransformer(cfg).to(dev).train()
    data = torch.randint(0, cfg.vocab_size, (batch_size, seq_len + 1), device=dev)
    idx, targets = data[:, :-1], data[:, 1:]

    def step() -> int:
        with autocast_for(dev, dtype):
            saved, out = saved_activation_bytes(
                model, lambda: model(idx, targets, routing="topk").loss
            )
        out.backward()
        return saved

    step()  # warm-up: allocator pools, lazy initialisation
    model.zero_grad(set_to_none=True)
    peak = None
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        saved = step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        _trim()
        if _reset_hwm() and (base := _status_kib("VmRSS")) is not None:
            saved = step()
            hwm = _status_kib("VmHWM")
            peak = None if hwm is None else 1024 * max(0, hwm - base)
        else:
            saved = step()
    return {"saved_bytes": saved, "peak_bytes": peak, "params": model.num_params()}


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(int(os.environ.get("MOD_BENCH_THREADS", "1")))
    args = (spec["config"], spec["batch_size"], spec["seq_len"], spec["device"])
    print(json_text(measure(*args, spec.get("dtype", "float32"))))
