"""Checkpoints: safetensors for tensors, JSON for everything else, every write atomic.

A checkpoint is a directory::

    config.json        MoDConfig
    model.safetensors  weights (tied weights stored once)
    optimizer.safetensors + optimizer.json   AdamW moments and hyper-parameters (training only)
    trainer.json       step, data-loader state, training arguments (training only)
    tokenizer.json     the tokenizer the model was trained with

The directory is written under a temporary name and renamed into place, so a crash leaves either the
old checkpoint or the new one, never a mixture. Nothing is ever unpickled.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from .config import MoDConfig
from .fileio import atomic_save_tensors, fsync_dir, read_json, umask_mode, write_json
from .model import MoDTransformer


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """State dict with shared (tied) tensors stored once: safetensors refuses aliases."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), t.shape, t.stride()) if t.numel() else (name,)
        if key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def optimizer_to_files(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Split an optimizer state dict into tensors (safetensors) and JSON-able rest."""
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, state in sd["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                tensors[f"{pid}.{key}"] = value
            else:
                scalars[f"{pid}.{key}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_files(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for name, value in [*tensors.items(), *meta["scalars"].items()]:
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(
    directory: str | Path,
    model: nn.Module,
    config: MoDConfig,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    trainer_state: dict | None = None,
    tokenizer: Any | None = None,
) -> Path:
    """Write a checkpoint directory atomically (temp directory, then rename)."""
    final = Path(directory)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp"))
    try:
        os.chmod(tmp, umask_mode(0o777))
        write_json(tmp / "config.json", config.to_dict())
        atomic_save_tensors(tmp / "model.safetensors", model_tensors(model), {"format": "pt"})
        if optimizer is not None:
            tensors, meta = optimizer_to_files(optimizer)
            atomic_save_tensors(tmp / "optimizer.safetensors", tensors)
            write_json(tmp / "optimizer.json", meta)
        if trainer_state is not None:
            write_json(tmp / "trainer.json", trainer_state)
        if tokenizer is not None:
            tokenizer.save(tmp)
        fsync_dir(tmp)
        old = final.with_name(f".{final.name}.old")
        if final.exists():
            # `final` is good, so a stale `old` may go; then keep the previous checkpoint as `old`
            # until the new one is in place.
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        # (If only `old` exists, a crash hit between the renames: it stays until `tmp` is placed.)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def resolve_checkpoint(directory: str | Path) -> Path:
    """The checkpoint directory, or its previous version if a crash hit between the two renames."""
    d = Path(directory)
    if (d / "config.json").exists():
        return d
    old = d.with_name(f".{d.name}.old")
    if (old / "config.json").exists():
        return old
    raise FileNotFoundError(f"no checkpoint at {d} (expected {d / 'config.json'})")


def load_model(
    directory: str | Path, map_location: str | torch.device = "cpu"
) -> tuple[MoDTransformer, MoDConfig]:
    """Rebuild a `MoDTransformer` from a checkpoint directory."""
    d = resolve_checkpoint(directory)
    config = MoDConfig.from_dict(read_json(d / "config.json"))
    model = MoDTransformer(config)
    tensors = load_file(d / "model.safetensors")  # to CPU parameters; moved once below
    try:
        missing, unexpected = model.load_state_dict(tensors, strict=False)
    except RuntimeError as exc:  # shape mismatches
        raise ValueError(f"checkpoint {d} does not match its config: {exc}") from exc
    # Tied weights are stored once; anything else missing is a real mismatch.
    tied = {"lm_head.weight"} if config.tie_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"checkpoint {d} does not match its config: missing {sorted(set(missing) - tied)}, "
            f"unexpected {sorted(unexpected)}"
        )
    return model.to(map_location), config


def load_optimizer_state(directory: str | Path) -> dict | None:
    d = resolve_checkpoint(directory)
    if not (d / "optimizer.safetensors").exists():
        return None
    return optimizer_from_files(
        load_file(d / "optimizer.safetensors"), read_json(d / "optimizer.json")
    )
