"""Keep freed memory in the process for reuse: the CLI's one process-wide setting.

A training step frees and re-allocates the same large buffers every step, the biggest being
the logits and their gradient: batch x seq_len x vocab floats, 64 MiB at 4,096 tokens a step and
a 4,096-token vocabulary. glibc serves any block over its mmap threshold (32 MiB at most) with
a fresh ``mmap`` and hands it back to the kernel on ``free``, so every step page-faults those
pages in again and the kernel zeroes them. On our 2-core CPU machine that was a third of a
BPE training step's time, spent in the kernel (``benchmarks/malloc.py`` measures it). With
mmap off and trimming off, glibc keeps freed blocks on its heap and the next step reuses them.

The cost: the process keeps its peak memory until it exits instead of returning it between
steps. That suits a training or evaluation process, so `mod` applies it to every command; a
library import never changes the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Mapping

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1

# glibc's malloc variables end in "_" (MALLOC_MMAP_THRESHOLD_, MALLOC_TOP_PAD_, ...) but these two
_NO_UNDERSCORE = frozenset({"MALLOC_ARENA_MAX", "MALLOC_ARENA_TEST"})

ENV = "MOD_KEEP_FREED_MEMORY"  # "0" leaves glibc's defaults alone


def user_malloc_settings(env: Mapping[str, str]) -> list[str]:
    """Names of the variables in ``env`` that tune glibc's malloc, which ``keep_freed_memory``
    leaves alone: ``MALLOC_*_`` variables, ``MALLOC_ARENA_MAX`` / ``MALLOC_ARENA_TEST``, and a
    ``GLIBC_TUNABLES`` that sets ``glibc.malloc``."""
    names = [k for k in env if k.startswith("MALLOC_") and (k.endswith("_") or k in _NO_UNDERSCORE)]
    if "glibc.malloc" in env.get("GLIBC_TUNABLES", ""):
        names.append("GLIBC_TUNABLES")
    return names


def keep_freed_memory() -> bool:
    """Turn off glibc's mmap for large blocks and its heap trimming, for this process.

    Returns whether it did. It does nothing off Linux/glibc, when ``MOD_KEEP_FREED_MEMORY=0``,
    or when the user already tunes glibc's malloc (a glibc ``MALLOC_*`` variable or a
    ``glibc.malloc`` tunable): their choice stands.
    """
    setting = os.environ.get(ENV, "1")
    if setting not in ("0", "1"):
        raise ValueError(f"{ENV} must be '0' or '1', got {setting!r}")
    if setting == "0" or not sys.platform.startswith("linux"):
        return False
    if user_malloc_settings(os.environ):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return False
    # glibc only: musl has no gnu_get_libc_version and its mallopt ignores these parameters
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success. Large blocks then come from the heap (another thread's
    # arena still falls back to mmap when its heap cannot grow), and freed ones stay there.
    return bool(mallopt(_M_TRIM_THRESHOLD, _INT_MAX)) and bool(mallopt(_M_MMAP_MAX, 0))
