"""The tensors of a sharded checkpoint: each rank writes its own shard of the weights and AdamW
moments with `torch.distributed.checkpoint` (DCP), and any number of ranks reads them back, each
taking the slices its own sharding needs (DCP reshards on load: save with 2 ranks, resume with 1
or 3).

The files are DCP's Hugging Face storage: one safetensors file per writing rank, each tensor
slice's offset in the file's JSON header. Nothing is pickled (DCP's default storage pickles its
metadata; this one rebuilds it from the headers). Tensors are keyed by name, not by position:
``model.<parameter>`` and ``optim.<parameter>.<moment>``, so a checkpoint written under FSDP2
loads into a plain model and back. Everything that is not a tensor (the optimizer's parameter
groups) is the caller's to keep, as JSON. `checkpoint.save_sharded_checkpoint` makes the folder
atomic around these files.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

SHARDS_DIR = "shards"


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Each second name of a shared (tied) parameter, mapped to the first: stored once."""
    first: dict[int, str] = {}
    alias = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            alias[name] = first[id(p)]
        else:
            first[id(p)] = name
    return alias


def _state(
    model: nn.Module, opt: torch.optim.Optimizer | None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The model's (and optimizer's) state dicts keyed by parameter name, tensors as the model
    holds them (DTensor shards under FSDP2), tied parameters once."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if opt is None:
        msd, osd = get_model_state_dict(model), None
    else:
        msd, osd = get_state_dict(model, opt)
    for name in tied_aliases(model):
        msd.pop(name, None)
    return msd, osd


def local_tensors(model: nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """What this rank holds of the weights and optimizer moments (its shards under FSDP2)."""
    from torch.distributed.tensor import DTensor

    msd, osd = _state(model, opt)
    out = {f"model.{k}": v for k, v in msd.items()}
    for fqn, st in (osd or {"state": {}})["state"].items():
        out.update({f"optim.{fqn}.{k}": v for k, v in st.items() if torch.is_tensor(v)})
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in out.items()}


def write_shards(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Write this rank's shards under `path` (a collective: every rank calls it, with `path` on
    a filesystem they all see). Returns the optimizer's JSON part: its parameter groups (naming
    parameters) and any state that is not a tensor."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    msd, osd = _state(model, opt)
    assert osd is not None
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    scalars: dict[str, Any] = {}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors.setdefault(fqn, {})[k] = v
            else:
                scalars[f"{fqn}.{k}"] = v
    with _quiet():
        dcp.save(
            {"model": msd, "optim": tensors},
            storage_writer=HuggingFaceStorageWriter(str(path), save_distributed=True),
            no_dist=not _joined(),
        )
    # Parameters that never had a gradient have no AdamW state: say which do, so that a load
    # leaves the others without state too (not with the zero state DCP's loader makes).
    return {"param_groups": osd["param_groups"], "scalars": scalars, "with_state": sorted(tensors)}


def read_shards(
    path: Path,
    model: nn.Module,
    opt: torch.optim.Optimizer | None = None,
    optimizer_meta: dict[str, Any] | None = None,
    *,
    alone: bool = False,
) -> None:
    """Load the shards under `path` into `model` (and `opt`, given the JSON part `write_shards`
    returned), each rank reading the slices its own parameters hold. A collective unless
    `alone` (one process reading the whole checkpoint, with or without a process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_state_dict,
    )

    if not any(Path(path).glob("*.safetensors")):
        raise FileNotFoundError(f"no shard files (*.safetensors) in {path}")
    msd, osd = _state(model, opt)
    state: dict[str, Any] = {"model": msd}
    if osd is not None:
        if optimizer_meta is not None and "with_state" in optimizer_meta:
            keep = set(optimizer_meta["with_state"])
            osd["state"] = {k: v for k, v in osd["state"].items() if k in keep}
        state["optim"] = osd["state"]
    with _quiet():
        dcp.load(
            state,
            storage_reader=HuggingFaceStorageReader(str(path)),
            no_dist=alone or not _joined(),
        )
    for name, kept in tied_aliases(model).items():
        msd[name] = msd[kept]
    if osd is None:
        set_model_state_dict(model, msd)
        return
    assert optimizer_meta is not None, "the optimizer's parameter groups are needed with it"
    for key, v in optimizer_meta["scalars"].items():
        fqn, k = key.rsplit(".", 1)
        osd["state"].setdefault(fqn, {})[k] = v
    osd["param_groups"] = optimizer_meta["param_groups"]
    # Not strict: parameters without saved state (never had a gradient) are meant to have none.
    options = StateDictOptions(strict=False)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=options)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that one process without a process group works alone: that is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _joined() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
