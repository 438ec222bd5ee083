"""Input checks shared by the configs, the CLI and the model: one place for every number's range
and every token id's type and range, so bad input gets the same clear error wherever it enters.

Comparisons such as ``x <= 0`` let NaN through (every comparison with NaN is false), so a range
here is checked as ``lo <= x <= hi`` being true, and finiteness separately.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

IGNORE_INDEX = -100  # targets with this value do not count in the loss (torch's convention)


@dataclass(frozen=True)
class Range:
    """An allowed interval for a number; `integer` asks for an int (never a bool)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False
    optional: bool = False  # None is allowed (it means "the default")

    def describe(self) -> str:
        """E.g. "in (0, 1]", "a finite number > 0", "a positive integer"."""
        none = " or None" if self.optional else ""
        lo = None if self.lo is None else f"{self.lo:,}" if self.integer else f"{self.lo:g}"
        hi = None if self.hi is None else f"{self.hi:,}" if self.integer else f"{self.hi:g}"
        if self.integer and self.lo == 1 and hi is None:
            return "a positive integer" + none
        if lo is not None and hi is not None:
            kind = "an integer " if self.integer else ""
            left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
            return f"{kind}in {left}{lo}, {hi}{right}{none}"
        kind = "an integer" if self.integer else "a finite number"
        if lo is not None:
            return f"{kind} {'>' if self.lo_open else '>='} {lo}{none}"
        if hi is not None:
            return f"{kind} {'<' if self.hi_open else '<='} {hi}{none}"
        return kind + none

    def admits(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return False
        if self.integer and not isinstance(value, numbers.Integral):
            return False
        if not math.isfinite(value):
            return False
        if self.lo is not None and not (value > self.lo if self.lo_open else value >= self.lo):
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)

    def check(self, name: str, value: Any) -> None:
        if not self.admits(value):
            raise ValueError(f"{name} must be {self.describe()}, got {value!r}")


POSITIVE_INT = Range(lo=1, integer=True)
NONNEGATIVE_INT = Range(lo=0, integer=True)
POSITIVE = Range(lo=0, lo_open=True)
NONNEGATIVE = Range(lo=0)
UNIT = Range(lo=0, hi=1)  # [0, 1]
SHARE = Range(lo=0, hi=1, lo_open=True)  # (0, 1]: a capacity, a take-rate, top-p


def check_fields(obj: Any, ranges: dict[str, Range]) -> None:
    """Check the attributes of `obj` named in `ranges` (a config's one table of ranges)."""
    for name, allowed in ranges.items():
        allowed.check(name, getattr(obj, name))


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def token_tensor(ids: Any, vocab_size: int, name: str = "idx") -> Tensor:
    """Token ids as an int64 tensor, checked: integers only (a float or bool tensor, or a float
    in a list, is refused rather than truncated), every id in ``[0, vocab_size)``.

    Accepts a tensor of any integer dtype (uint8 included: it is widened, since the embedding
    takes int32/int64 only) or nested sequences of Python/NumPy integers. On an accelerator the
    range check is an asynchronous device assert, so it costs no host sync.
    """
    if isinstance(ids, Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
        t = ids if ids.dtype == torch.int64 else ids.to(torch.int64)
    else:
        _check_integer_items(ids, name)
        t = torch.as_tensor(ids, dtype=torch.int64)
    check_id_range(t, vocab_size, name)
    return t


def _check_integer_items(ids: Any, name: str) -> None:
    stack = [ids]
    while stack:
        item = stack.pop()
        if isinstance(item, Tensor):
            if item.dtype.is_floating_point or item.dtype.is_complex or item.dtype == torch.bool:
                raise ValueError(f"{name} must hold integer token ids, got dtype {item.dtype}")
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, bool) or not isinstance(item, numbers.Integral):
            raise ValueError(f"{name} must hold integer token ids, got {item!r}")


def check_id_range(
    t: Tensor, vocab_size: int, name: str = "idx", ignore: int | None = None
) -> None:
    """Every id in ``[0, vocab_size)`` (or equal to `ignore`)."""
    if t.numel() == 0 or torch.compiler.is_compiling():  # a value check would break the graph
        return
    ok = (t >= 0) & (t < vocab_size)
    if ignore is not None:
        ok |= t == ignore
    if t.device.type != "cpu":  # no host sync on accelerators: an async device assert instead
        torch._assert_async(ok.all(), f"{name} ids must be in [0, {vocab_size})")
        return
    if not bool(ok.all()):
        bad = int(t[~ok][0])
        extra = f" or {ignore} (ignored)" if ignore is not None else ""
        raise ValueError(
            f"{name} has id {bad} out of range: ids must be in [0, {vocab_size}){extra}"
        )


def check_targets(targets: Tensor, vocab_size: int) -> Tensor:
    """Targets as int64, checked: integer ids in ``[0, vocab_size)`` or IGNORE_INDEX, at least
    one not ignored (with none the mean loss is 0/0 = NaN)."""
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"targets must hold integer token ids, got dtype {targets.dtype}")
    targets = targets if targets.dtype == torch.int64 else targets.to(torch.int64)
    check_id_range(targets, vocab_size, "targets", ignore=IGNORE_INDEX)
    if torch.compiler.is_compiling() or targets.numel() == 0:
        return targets
    counted = (targets != IGNORE_INDEX).any()
    if targets.device.type != "cpu":
        torch._assert_async(counted, f"every target is {IGNORE_INDEX}: no token to predict")
    elif not bool(counted):
        raise ValueError(
            f"every target is {IGNORE_INDEX} (ignored): no token to predict, the loss would be NaN"
        )
    return targets
