"""Which device a run uses: a name given by the user, checked against this machine."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """``"auto"`` (cuda if available, else cpu) or a device torch knows and can use here."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device {name!r} is not a device: use auto, cpu, cuda or cuda:N ({exc})"
        ) from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "was built without CUDA" if torch.version.cuda is None else "sees no GPU"
            raise ValueError(
                f"device {name!r}: this torch ({torch.__version__}) {why}; use --device cpu "
                "(or auto)"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {name!r}: there are only {torch.cuda.device_count()} GPUs "
                f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})"
            )
        return dev
    backend = getattr(torch, dev.type, None) if dev.type != "mps" else torch.backends.mps
    if backend is None or not getattr(backend, "is_available", lambda: False)():
        raise ValueError(f"device {name!r} is not available here; use --device cpu (or auto)")
    return dev
