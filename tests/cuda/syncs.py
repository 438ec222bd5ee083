"""Host syncs counted on a CPU as a GPU would have them (docs/bench.md, "The audit").

On a CPU every tensor is on the host, so a `.item()` costs nothing and no sync shows up. This
counter tells the tensors that would live on the GPU from those that stay on the host: the
model's parameters and inputs, and whatever an op computes from them, are "device" tensors
(tracked through a `TorchFunctionMode`); so are tensors made with an explicit ``device=`` or
moved with ``.to(device)``, as they would be on a GPU. Reading a device tensor's value on the
host (`.item()`, `.tolist()`, `bool()`, `int()`, `float()`, `.cpu()`, `.nonzero()`, boolean
indexing, ...) is a sync; moving a host tensor to the device is an upload (not a sync, counted
apart). The library names the host with `.cpu()` only (never ``.to("cpu")``), so every
``.to(device)`` here is a move to the device. Gradients are made by the autograd engine,
outside the mode: `mark_grads` marks them.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

# Reading a device tensor's value on the host: the device must finish first.
READS = {
    "item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy",
    "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive",
}  # fmt: skip
FACTORIES = {
    "zeros", "ones", "empty", "full", "arange", "tensor", "as_tensor", "rand", "randn",
    "randint", "linspace", "eye", "zeros_like", "ones_like", "empty_like", "full_like",
}  # fmt: skip


class SyncCounter(TorchFunctionMode):
    """``with SyncCounter(model, idx) as c: ...``; then ``c.syncs`` (a Counter by the op that
    read a device value) and ``c.uploads`` (host tensors moved to the device)."""

    def __init__(self, *device_tensors: Any) -> None:
        super().__init__()
        self.device: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.syncs: Counter[str] = Counter()
        self.uploads = 0
        self.where: Counter[str] = Counter()  # "op at file:function", the reader
        for obj in device_tensors:
            self.mark(obj)

    def mark(self, obj: Any) -> None:
        """Mark tensors (or a module's parameters and buffers) as living on the device."""
        if isinstance(obj, torch.nn.Module):
            for t in (*obj.parameters(), *obj.buffers()):
                self.device[t] = True
        elif isinstance(obj, torch.Tensor):
            self.device[obj] = True

    def mark_grads(self, module: torch.nn.Module) -> None:
        for p in module.parameters():
            if p.grad is not None:
                self.device[p.grad] = True

    @property
    def total(self) -> int:
        return sum(self.syncs.values())

    def _on_device(self, args: Any, kwargs: dict) -> bool:
        leaves, _ = tree_flatten((args, kwargs))
        return any(isinstance(t, torch.Tensor) and t in self.device for t in leaves)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        on_device = self._on_device(args, kwargs)
        to_device = name in {"to", "cuda"} and _names_a_device(args[1:], kwargs)
        read = name if on_device and name in READS else None
        if on_device and name == "__getitem__" and _bool_index(args[1], self.device):
            read = "boolean index"
        if read is not None:
            self.syncs[read] += 1
            self.where[f"{read} at {_caller()}"] += 1
        elif not on_device and to_device and isinstance(args[0], torch.Tensor):
            self.uploads += 1
        out = func(*args, **kwargs)
        if (name == "cpu" or to_device) and out is args[0]:
            # On a CPU both return the tensor itself; on a GPU, a copy on the other side.
            out = out.view_as(out)
        device_out = (on_device or to_device or _factory_on_device(name, kwargs)) and (
            name not in READS
        )
        if device_out:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.device[t] = True
        return out


def _caller() -> str:
    """The innermost frame outside this file and torch's overrides: where the read is."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename in (__file__, overrides_file):
        f = f.f_back
    if f is None:
        return "?"
    return f"{Path(f.f_code.co_filename).name}:{f.f_code.co_name}"


overrides_file = torch.overrides.__file__


def _names_a_device(args: tuple, kwargs: dict) -> bool:
    cands = [*args, kwargs.get("device")]
    return any(isinstance(a, (str, torch.device)) for a in cands if a is not None)


def _factory_on_device(name: str, kwargs: dict) -> bool:
    return name in FACTORIES and kwargs.get("device") is not None


def _bool_index(index: Any, device: WeakIdKeyDictionary) -> bool:
    leaves, _ = tree_flatten(index)
    return any(
        isinstance(t, torch.Tensor) and t.dtype == torch.bool and t in device for t in leaves
    )
