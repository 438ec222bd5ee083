"""Checkpoints: safetensors for tensors, JSON for everything else, every write atomic.

A checkpoint is a directory::

    config.json        MoDConfig
    model.safetensors  weights (tied weights stored once)
    optimizer.safetensors + optimizer.json   AdamW moments and hyper-parameters (training only)
    trainer.json       step, data-loader state, training arguments (training only)
    tokenizer.json     the tokenizer the model was trained with

or, written by every rank of a job at once (`save_sharded_checkpoint`, the default under FSDP2),
a sharded one: ``shards/`` (one safetensors file per rank, see `sharded`) in place of the two
safetensors files, ``optimizer.json`` naming parameters, and ``shards.json`` listing the shard
files and their sizes. Every reader here takes both kinds;
`consolidate_checkpoint` turns a sharded checkpoint into the single-file kind.

The directory is written under a temporary name and renamed into place, so a crash leaves either the
old checkpoint or the new one, never a mixture; the temporary folder a crash leaves behind is
removed by the next save. An existing empty folder (or a symlink's target) is filled instead of
replaced, and a `.NAME.old` that mod did not move aside is never deleted (`fileio.place_folder`).
Weights that are not finite are never written. Nothing is ever unpickled, and a damaged or foreign
file is a `CheckpointError` that names it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from ..config import MoDConfig
from ..fileio import (
    DiskFullError,
    atomic_save_tensors,
    fsync_dir,
    is_disk_full,
    place_folder,
    read_json,
    remove_temps,
    staging,
    umask_mode,
    write_json,
)
from ..model import MoDTransformer
from . import distributed as D
from .sharded import SHARDS_DIR, local_tensors, read_shards, write_shards


class CheckpointError(ValueError):
    """A checkpoint file is damaged, truncated, or not a checkpoint file at all."""


def corrupt(path: Path, reason: str) -> CheckpointError:
    return CheckpointError(f"checkpoint file {path} is corrupt or not a checkpoint: {reason}")


def read_json_file(path: Path, keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """A checkpoint's JSON file: an object holding `keys`, or a `CheckpointError` naming it."""
    try:
        obj = read_json(path)
    except FileNotFoundError:
        raise corrupt(path, "the file is missing") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise corrupt(path, f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise corrupt(path, f"expected a JSON object, found {type(obj).__name__}")
    missing = [k for k in keys if k not in obj]
    if missing:
        raise corrupt(path, f"it has no {', '.join(map(repr, missing))}")
    return obj


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file, or a `CheckpointError` naming it (never unpickled: a pickle or a
    `torch.save` file under this name is refused, not run)."""
    if not path.is_file():
        raise corrupt(path, "the file is missing")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        reason = str(exc) or type(exc).__name__
        if path.stat().st_size < 8:
            reason = f"{path.stat().st_size} bytes, too short for a safetensors header"
        raise corrupt(path, f"not a readable safetensors file ({reason})") from None


def nonfinite_tensors(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an infinity."""
    by_device: dict[torch.device, list[str]] = {}
    for n, t in tensors.items():  # AdamW keeps its step counts on the CPU beside CUDA moments
        if t.is_floating_point():
            by_device.setdefault(t.device, []).append(n)
    bad = []
    for names in by_device.values():  # one host sync per device
        flags = torch.stack([torch.isfinite(tensors[n]).all() for n in names]).tolist()
        bad += [n for n, ok in zip(names, flags, strict=True) if not ok]
    return bad


def remove_stale_temps(final: Path) -> None:
    """Remove ``.<name>.*.tmp`` folders beside `final`: checkpoint writes cut short by a crash
    (each can be a whole model and optimizer copy)."""
    remove_temps(final.parent, f".{final.name}.*.tmp")


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


def optimizer_to_files(
    opt: torch.optim.Optimizer | dict,
) -> tuple[dict[str, torch.Tensor], dict]:
    """Split an optimizer's state dict (or a state dict) into tensors (safetensors) and the
    JSON-able rest."""
    sd = opt if isinstance(opt, dict) else opt.state_dict()
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


def _check_optimizer_meta(path: Path, meta: dict) -> None:
    groups, scalars = meta["param_groups"], meta["scalars"]
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise corrupt(path, "'param_groups' must be a list of objects")
    if not isinstance(scalars, dict):
        raise corrupt(path, "'scalars' must be an object")
    names = meta.get("with_state", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise corrupt(path, "'with_state' must be a list of parameter names")


def save_checkpoint(
    directory: str | Path,
    model: nn.Module,
    config: MoDConfig,
    *,
    optimizer: torch.optim.Optimizer | dict | None = None,
    trainer_state: dict | None = None,
    tokenizer: Any | None = None,
    weights: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write a checkpoint directory atomically (temp directory, then rename). `weights` and an
    `optimizer` given as a state dict replace `model_tensors(model)` and its state dict (a
    sharded model's, gathered whole).

    Refuses (ValueError) weights or optimizer moments that are not finite, so a diverged model
    never replaces a good checkpoint. Stale temporary folders of earlier, interrupted writes of
    this checkpoint are removed first: one writer per folder (`runlock.RunLock`) is assumed.
    """
    final = Path(directory)
    weights = model_tensors(model) if weights is None else weights
    opt_files = optimizer_to_files(optimizer) if optimizer is not None else None
    bad = nonfinite_tensors({**weights, **(opt_files[0] if opt_files else {})})
    if bad:
        raise ValueError(
            f"refusing to write checkpoint {final}: {len(bad)} tensors hold NaN or infinity "
            f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})"
        )
    final, tmp = staging(final)
    try:
        os.chmod(tmp, umask_mode(0o777))
        write_json(tmp / "config.json", config.to_dict())
        atomic_save_tensors(tmp / "model.safetensors", weights, {"format": "pt"})
        if opt_files is not None:
            tensors, meta = opt_files
            atomic_save_tensors(tmp / "optimizer.safetensors", tensors)
            write_json(tmp / "optimizer.json", meta)
        if trainer_state is not None:
            write_json(tmp / "trainer.json", trainer_state)
        if tokenizer is not None:
            tokenizer.save(tmp)
        place_folder(tmp, final)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(exc):  # one line naming the file and what survived, not a traceback
            where = exc.path if isinstance(exc, DiskFullError) else tmp
            name = final / where.relative_to(tmp) if where.is_relative_to(tmp) else where
            raise DiskFullError(name, f"; {previous_checkpoint(final)}") from exc
        raise
    return final


def previous_checkpoint(final: Path) -> str:
    """What a failed write of checkpoint `final` left: the checkpoint before it, with its step."""
    try:
        d = resolve_checkpoint(final)
    except FileNotFoundError:
        return f"no earlier checkpoint was in {final}"
    try:
        step = f" (step {read_json(d / 'trainer.json')['step']})"
    except (OSError, ValueError, KeyError, TypeError):  # a weights-only checkpoint has no step
        step = ""
    return f"the previous checkpoint {d}{step} is intact"


def save_sharded_checkpoint(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: MoDConfig,
    env: D.DistEnv,
    *,
    trainer_state: dict,
    tokenizer: Any | None = None,
) -> Path:
    """Write a sharded checkpoint: every rank calls this (a collective) and writes its own
    shards into one temporary folder that rank 0 made, then rank 0 writes the JSON files and
    renames the folder into place. A rank killed at any point leaves the previous checkpoint
    whole; the temporary folder is removed by the next save. The run folder must be on a
    filesystem every rank sees (on several nodes: a shared one).

    Refuses (ValueError, on every rank) weights or moments that are not finite on any rank.
    """
    final = Path(directory)
    bad = nonfinite_tensors(local_tensors(model, optimizer))
    if D.max_over_ranks(env, len(bad)):
        raise ValueError(
            f"refusing to write checkpoint {final}: tensors hold NaN or infinity "
            f"({', '.join(bad[:3]) or 'on another rank'}{', ...' if len(bad) > 3 else ''})"
        )
    made, setup_error = None, None
    if env.is_main:
        try:
            final, made = staging(final)
            os.chmod(made, umask_mode(0o777))
        except OSError as exc:  # every rank must learn of it, not wait for a folder
            setup_error = exc
    made, error = D.broadcast_object(
        env, (made, None if setup_error is None else repr(setup_error))
    )
    if setup_error is not None:
        raise setup_error
    if error is not None:
        raise RuntimeError(f"rank 0 could not start checkpoint {final}: {error}")
    tmp = Path(str(made))
    if D.max_over_ranks(env, int(not tmp.is_dir())):
        if env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(
            f"not every rank sees the checkpoint folder {final.parent}: a sharded checkpoint "
            "needs a filesystem all nodes share (or --checkpoint-format whole, written by rank 0)"
        )
    failure: BaseException | None = None
    try:
        meta = write_shards(tmp / SHARDS_DIR, model, optimizer)
        if env.is_main:
            fsync_dir(tmp / SHARDS_DIR)
            # What the ranks wrote, so that a load notices a shard file lost or cut short (DCP
            # would take the tensor's size from the files left and read the gaps as they are).
            write_json(tmp / SHARDS_INDEX, {"files": _shard_files(tmp)})
            write_json(tmp / "config.json", config.to_dict())
            write_json(tmp / "optimizer.json", meta)
            write_json(tmp / "trainer.json", trainer_state)
            if tokenizer is not None:
                tokenizer.save(tmp)
            place_folder(tmp, final)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        failure = exc
        if env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
    # Rank 0's own steps can fail after the collective write: every rank learns of it.
    error = D.broadcast_object(env, None if failure is None else repr(failure))
    if failure is not None:
        raise failure
    if error is not None:
        raise RuntimeError(f"rank 0 could not complete checkpoint {final}: {error}")
    return final


SHARDS_INDEX = "shards.json"


def _shard_files(d: Path) -> dict[str, int]:
    """The shard files of checkpoint folder `d`, with their sizes in bytes."""
    return {f.name: f.stat().st_size for f in sorted((d / SHARDS_DIR).glob("*.safetensors"))}


def _check_shard_files(d: Path) -> None:
    """The shard files are those `shards.json` lists, at their sizes, or a `CheckpointError`."""
    index = d / SHARDS_INDEX
    want = read_json_file(index, ("files",))["files"]
    if not isinstance(want, dict):
        raise corrupt(index, "'files' must be an object of file names and sizes")
    have = _shard_files(d)
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    resized = sorted(n for n in set(want) & set(have) if want[n] != have[n])
    if missing or extra or resized:
        raise corrupt(
            d / SHARDS_DIR,
            f"its files are not those {SHARDS_INDEX} lists (missing {missing}, unexpected "
            f"{extra}, another size {resized})",
        )


def resolve_checkpoint(directory: str | Path) -> Path:
    """The checkpoint directory, or its previous version if a crash hit between the two renames.
    A run folder (`mod train --out`) stands for the checkpoint inside it: `mod eval runs/mod`."""
    d = Path(directory)
    for where in (d, d / "checkpoint"):
        real = where.resolve() if where.is_symlink() else where  # a link's `.old` is its target's
        for ckpt in (where, real.with_name(f".{real.name}.old")):
            if (ckpt / "config.json").exists():
                return ckpt
    raise FileNotFoundError(
        f"no checkpoint at {d} (expected {d / 'config.json'}, or a run folder's "
        f"{d / 'checkpoint' / 'config.json'})"
    )


def is_sharded(directory: str | Path) -> bool:
    """Whether a checkpoint directory holds shards (`save_sharded_checkpoint`)."""
    return (resolve_checkpoint(directory) / SHARDS_DIR).is_dir()


def load_sharded(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    alone: bool = True,
) -> None:
    """Read a sharded checkpoint into `model` (and `optimizer`), whatever the number of ranks
    that wrote it: one process (`alone`) reads everything; under a job every rank calls it with
    `alone=False` and reads the slices its own sharding holds. Errors are `CheckpointError`."""
    d = resolve_checkpoint(directory)
    _check_shard_files(d)
    meta = None
    if optimizer is not None:
        meta_path = d / "optimizer.json"
        meta = read_json_file(meta_path, ("param_groups", "scalars"))
        _check_optimizer_meta(meta_path, meta)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        read_shards(d / SHARDS_DIR, model, optimizer, meta, alone=alone)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        raise corrupt(d / SHARDS_DIR, f"the shards do not load into the model ({exc!r})") from None


def _training_dtype(d: Path) -> torch.dtype:
    """The dtype a run trained in (its trainer.json says; float32 if it has none)."""
    trainer = d / "trainer.json"
    if not trainer.exists():
        return torch.float32
    name = read_json_file(trainer).get("train_config", {}).get("dtype")
    return torch.float64 if name == "float64" else torch.float32


def _optimizer_for(model: nn.Module, meta: dict) -> torch.optim.AdamW:
    """An AdamW with the parameter groups a sharded checkpoint's optimizer.json names."""
    named = dict(model.named_parameters())
    groups = []
    for g in meta["param_groups"]:
        try:
            params = [named[name] for name in g["params"]]
        except (KeyError, TypeError) as exc:
            raise CheckpointError(f"optimizer.json names no parameter {exc} of the model") from None
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": params})
    return torch.optim.AdamW(groups)


def _restore_sharded(
    d: Path, with_optimizer: bool
) -> tuple[MoDTransformer, MoDConfig, torch.optim.AdamW | None]:
    """A sharded checkpoint read whole into one process: the model in its training dtype and,
    with `with_optimizer`, an AdamW holding its state."""
    config = load_config(d)
    model = MoDTransformer(config).to(_training_dtype(d))
    opt = None
    if with_optimizer and (d / "optimizer.json").exists():
        meta = read_json_file(d / "optimizer.json", ("param_groups", "scalars"))
        _check_optimizer_meta(d / "optimizer.json", meta)
        opt = _optimizer_for(model, meta)
    load_sharded(d, model, opt)
    return model, config, opt


class _CopiedFile:
    """A file of one checkpoint to write into another (`save_checkpoint`'s tokenizer)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def save(self, directory: Path) -> None:
        shutil.copyfile(self.path, Path(directory) / self.path.name)


def consolidate_checkpoint(source: str | Path, dest: str | Path) -> Path:
    """Write the sharded checkpoint `source` as a single-file checkpoint `dest` (weights,
    optimizer state, trainer state and tokenizer: `mod eval`, `mod generate` and `--resume` all
    read it), atomically. `dest` must not hold a checkpoint already."""
    d = resolve_checkpoint(source)
    if not is_sharded(d):
        raise ValueError(f"{d} is already a single-file checkpoint (it has no {SHARDS_DIR}/)")
    out = Path(dest)
    if out.resolve() == Path(source).resolve() or out.resolve() == d.resolve():
        raise ValueError(f"write the consolidated checkpoint to another folder than {d}")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: pick another destination")
    trainer = read_json_file(d / "trainer.json") if (d / "trainer.json").exists() else None
    model, config, opt = _restore_sharded(d, with_optimizer=True)
    again = read_json_file(d / "trainer.json") if (d / "trainer.json").exists() else None
    if again != trainer:  # a run saved into it meanwhile: its files may be of two steps
        raise RuntimeError(f"{d} was replaced while it was read (a run saving?): run it again")
    if trainer is not None:
        trainer = {**trainer, "checkpoint_format": "whole", "consolidated_from": str(d)}
    tokenizer = d / "tokenizer.json"
    return save_checkpoint(
        out,
        model,
        config,
        optimizer=opt,
        trainer_state=trainer,
        tokenizer=_CopiedFile(tokenizer) if tokenizer.exists() else None,
    )


def load_model(
    directory: str | Path, map_location: str | torch.device = "cpu"
) -> tuple[MoDTransformer, MoDConfig]:
    """Rebuild a `MoDTransformer` from a checkpoint directory (single-file or sharded; a run
    folder stands for its checkpoint), in eval mode, ready to evaluate or sample, as
    ``from_pretrained`` returns a model: a plain forward then routes causally
    (`MoDTransformer.forward`); call ``.train()`` to train it."""
    d = resolve_checkpoint(directory)
    config = load_config(d)
    model = MoDTransformer(config)
    if is_sharded(d):
        load_sharded(d, model)
        return model.to(map_location).eval(), config
    tensors = load_tensors(d / "model.safetensors")  # to CPU parameters; moved once below
    try:
        missing, unexpected = model.load_state_dict(tensors, strict=False)
    except RuntimeError as exc:  # shape mismatches
        raise CheckpointError(f"checkpoint {d} does not match its config: {exc}") from None
    if (
        unexpected
        and config.router_scores == "random"
        and all(".predictor." in k for k in unexpected)
    ):
        raise CheckpointError(
            f"checkpoint {d} has predictors under random router scores, which decided its causal "
            "routing; this version lets random scores decide by their own noise and builds no "
            "predictor for them (docs/semantics.md), so the model would route differently: "
            "load it with the version that wrote it"
        )
    # Tied weights are stored once; anything else missing is a real mismatch.
    tied = {"lm_head.weight"} if config.tie_embeddings else set()
    if set(missing) - tied or unexpected:
        raise CheckpointError(
            f"checkpoint {d} does not match its config: missing {sorted(set(missing) - tied)}, "
            f"unexpected {sorted(unexpected)}"
        )
    return model.to(map_location).eval(), config


def _foreign(d: Path, config: dict[str, Any]) -> CheckpointError | None:
    """What to do with a transformers folder (its config.json names a model type or classes; or
    it has a weights index, which checkpoints never do) given where a checkpoint was expected."""
    named = {"model_type", "architectures"} & config.keys()
    if not named and not (d / "model.safetensors.index.json").exists():
        return None
    return CheckpointError(
        f"{d} is a Hugging Face folder, not a checkpoint: run `mod convert --from-hf {d} --out "
        "CKPT` first (or load it with transformers after `import mixture_of_depths.hf`)"
    )


def load_config(directory: str | Path) -> MoDConfig:
    """The `MoDConfig` of a checkpoint, with errors that name its config.json (or say how to
    convert the Hugging Face folder given in its place)."""
    path = resolve_checkpoint(directory) / "config.json"
    obj = read_json_file(path)
    foreign = _foreign(path.parent, obj)
    if foreign is not None:
        raise foreign
    try:
        return MoDConfig.from_dict(obj)
    except (ValueError, TypeError) as exc:
        raise corrupt(path, str(exc)) from None


def load_optimizer_state(directory: str | Path) -> dict | None:
    """AdamW's state dict from a checkpoint, or None if it has none (a weights-only one); of
    a sharded checkpoint, the whole state, read into one process."""
    d = resolve_checkpoint(directory)
    if is_sharded(d):
        opt = _restore_sharded(d, with_optimizer=True)[2]
        return None if opt is None else opt.state_dict()
    if not (d / "optimizer.safetensors").exists():
        return None
    meta_path = d / "optimizer.json"
    meta = read_json_file(meta_path, ("param_groups", "scalars"))
    _check_optimizer_meta(meta_path, meta)
    tensors = load_tensors(d / "optimizer.safetensors")
    try:
        return optimizer_from_files(tensors, meta)
    except (ValueError, AttributeError) as exc:
        raise corrupt(d / "optimizer.safetensors", f"unexpected entries ({exc})") from None
