"""Setting a run up, in named stages: a new one, one started from another run's weights
(`init_from`), or one restored exactly from its own checkpoint (`resume`).

The order of the stages is part of the contract: a new model is built after the seed is set
and the data are read, so a run is a pure function of its settings; nothing in the folder is
deleted (--overwrite) before every check has passed; the generators are restored last.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import MoDConfig
from ..data import (
    BatchSampler,
    BPETokenizer,
    Tokenizer,
    corpus_files,
    eval_batches,
    load_splits,
    load_tokenizer,
    make_tokenizer,
    split_files,
)
from ..fileio import write_json
from ..model import MoDTransformer
from ..runtime import distributed as D
from ..runtime.checkpoint import (
    CheckpointError,
    corrupt,
    is_sharded,
    load_config,
    load_model,
    load_optimizer_state,
    load_sharded,
    model_tensors,
    nonfinite_tensors,
    read_json_file,
    resolve_checkpoint,
)
from ..runtime.device import resolve_device
from ..runtime.sharded import local_tensors
from .calibrate import calibration_set, restore_uncalibrated, uncalibrated
from .config import TrainConfig, capacity_warmup_steps, make_optimizer
from .resume import (
    RUN_FILES,
    clear_run,
    has_checkpoint,
    load_resume,
    no_checkpoint,
    remove_stale_temps,
    stream_fingerprint,
)
from .state import MetricsLog, NoLog, Run
from .tune import Distilled, dense_teacher, freeze_all_but_routers


@dataclass
class _Start:
    """What a run starts from besides its settings: a checkpoint's weights and tokenizer (and,
    to resume, its trainer state), or nothing (a new model)."""

    ckpt: Path | None = None
    state: dict[str, Any] | None = None  # the trainer state of the checkpoint resumed
    model: MoDTransformer | None = None
    config: MoDConfig | None = None
    tokenizer: Tokenizer | None = None


def start(
    model_config: MoDConfig | None,
    tc: TrainConfig,
    resume: bool,
    overwrite: bool,
    env: D.DistEnv | None = None,
    device: torch.device | None = None,
) -> Run:
    """Set up a new run, or restore one exactly from its checkpoint (`resume`). The caller holds
    the folder's lock (rank 0, under torchrun; the other ranks write nothing)."""
    out_dir = Path(tc.out)
    env = D.DistEnv() if env is None else env
    device = resolve_device(tc.device) if device is None else device
    if tc.batch_size % (env.world_size * tc.grad_accum):
        raise ValueError(
            f"batch_size {tc.batch_size} (the global batch) must split evenly over "
            f"{env.world_size} process(es) x grad_accum {tc.grad_accum}"
        )
    if env.is_main:
        remove_stale_temps(out_dir)
    begin = _load_start(tc, resume, device)
    if begin.tokenizer is not None and not resume:  # init_from: its tokenizer is the one used
        tc = dataclasses.replace(tc, tokenizer=tokenizer_kind(begin.tokenizer))
    _refuse_existing_run(out_dir, resume, overwrite)
    torch.manual_seed(tc.seed)
    train_tokens, val_tokens, tokenizer = _load_data(tc, env, begin.tokenizer)
    fingerprint = stream_fingerprint(train_tokens)
    if begin.state is not None and begin.state.get("data_fingerprint", fingerprint) != fingerprint:
        raise ValueError(
            "the training data differ from the checkpoint's (another Python's standard library, "
            "or edited files?): a resumed run would read other tokens at the same step"
        )
    model_config = _fit_vocab(
        model_config if begin.config is None else begin.config, tokenizer, tc, resume
    )
    seq_len = tc.seq_len or model_config.max_seq_len
    if seq_len > model_config.max_seq_len:
        raise ValueError(
            f"seq_len {seq_len} exceeds the model's max_seq_len {model_config.max_seq_len}"
        )
    model = begin.model if begin.model is not None else MoDTransformer(model_config).to(device)
    model = model.to(getattr(torch, tc.dtype)).train()
    if tc.tune == "routers":
        freeze_all_but_routers(model)
    parallel = D.choose_parallel(env, tc.parallel, model, device)
    if parallel == "fsdp":  # shard in place before the optimizer sees the parameters
        D.shard(model, env, device)
    opt = make_optimizer(model, tc)
    if begin.state is not None:
        _restore_weights(begin.ckpt, model, opt, env, parallel)
    val = _val_batches(val_tokens, tc, seq_len)
    calib, calib_skip = calibration_set(tc, model_config, val_tokens, seq_len)
    step_fn = step_module(_with_teacher(model, tc, device), tc, env, device, parallel)
    if overwrite and not resume and env.is_main:  # only now that the run has passed every check
        clear_run(out_dir)
    run = Run(
        tc=tc,
        out_dir=out_dir,
        device=device,
        model=model,
        model_config=model_config,
        opt=opt,
        sampler=BatchSampler(train_tokens, tc.batch_size, seq_len, seed=tc.seed),
        val=val,
        tokenizer=tokenizer,
        fingerprint=fingerprint,
        log=_open_log(out_dir, env, begin.state, model_config, tc),
        step_fn=step_fn,
        env=env,
        parallel=parallel,
        capacity_warmup=capacity_warmup_steps(tc, model_config),
        calib_batches=calib,
        calib_skip=calib_skip,
    )
    if begin.state is not None:  # last: loading a teacher draws from the generators too
        run.load_state_dict(begin.state, begin.ckpt / "trainer.json")
    return run


def _load_start(tc: TrainConfig, resume: bool, device: torch.device) -> _Start:
    """The checkpoint to resume (checked against `tc`), or the one `init_from` names."""
    if resume:
        ckpt, state = load_resume(tc)
        if is_sharded(ckpt):  # read after sharding, each rank its own slices
            config = uncalibrated(load_config(ckpt), state)
            model = MoDTransformer(config).to(device)
        else:
            model, config = load_model(ckpt, map_location=device)
            refuse_nonfinite(ckpt, nonfinite_tensors(model_tensors(model)))
            config = restore_uncalibrated(model, config, state)
        return _Start(ckpt, state, model, config, load_tokenizer(ckpt))
    if tc.init_from is not None:  # a new run from another run's weights
        ckpt = resolve_checkpoint(tc.init_from)
        model, config = load_model(ckpt, map_location=device)
        refuse_nonfinite(ckpt, nonfinite_tensors(model_tensors(model)))
        # thresholds a run fitted at its end fit its routers, not those this run trains
        config = restore_uncalibrated(model, config, _trainer_state(ckpt))
        return _Start(ckpt, None, model, config, load_tokenizer(ckpt))
    return _Start()


def _trainer_state(ckpt: Path) -> dict[str, Any] | None:
    path = ckpt / "trainer.json"
    return read_json_file(path) if path.exists() else None


def tokenizer_kind(tokenizer: Tokenizer) -> str:
    """The `TrainConfig.tokenizer` choice that names `tokenizer`."""
    return "bpe" if isinstance(tokenizer, BPETokenizer) else "byte"


def refuse_other_tokenizer(init_from: str, asked: str) -> None:
    """A run from checkpoint `init_from` uses that checkpoint's tokenizer (its model learned
    those ids), so a --tokenizer given for it that names another is refused, not ignored."""
    tokenizer = load_tokenizer(resolve_checkpoint(init_from))
    kind = tokenizer_kind(tokenizer)
    if asked != kind:
        raise ValueError(
            f"--tokenizer {asked}: a run from {init_from} uses that checkpoint's tokenizer "
            f"({kind}, {tokenizer.vocab_size} tokens), not a new one; leave --tokenizer out"
        )


def _refuse_existing_run(out_dir: Path, resume: bool, overwrite: bool) -> None:
    """A new run never continues or replaces another one unless told (--overwrite)."""
    if resume or overwrite:
        return
    if has_checkpoint(out_dir):
        raise ValueError(
            f"{out_dir} already holds a run with a checkpoint: resume it (--resume), start over "
            "(--overwrite), or pick another --out"
        )
    if any((out_dir / name).exists() for name in RUN_FILES):
        raise no_checkpoint(out_dir)


def _load_data(
    tc: TrainConfig, env: D.DistEnv, tokenizer: Tokenizer | None
) -> tuple[torch.Tensor, torch.Tensor, Tokenizer]:
    """The training and validation token streams, and the tokenizer: the checkpoint's, or a new
    one (a BPE one is trained on the training split). Rank 0 fills the token cache first; the
    others then read it."""
    if not env.is_main:
        D.barrier(env)
    if tokenizer is None and tc.tokenizer == "bpe":
        train_files, _ = split_files(corpus_files(tc.data))
        tokenizer = make_tokenizer("bpe", train_files, vocab_size=tc.bpe_vocab_size)
    splits = load_splits(tc.data, tokenizer)
    if env.is_main:
        D.barrier(env)
    return splits


def _fit_vocab(
    config: MoDConfig | None, tokenizer: Tokenizer, tc: TrainConfig, resume: bool
) -> MoDConfig:
    """The model config with the tokenizer's vocabulary: a new model takes it; a checkpoint's
    model must already have it (or, started from, at least hold every token)."""
    assert config is not None
    if tc.init_from is not None and not resume and tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"{tc.init_from}: its tokenizer has {tokenizer.vocab_size} tokens, its model only "
            f"{config.vocab_size}"
        )
    if config.vocab_size != tokenizer.vocab_size and tc.init_from is None:
        if resume:
            raise ValueError(
                f"checkpoint vocab_size {config.vocab_size} does not match its "
                f"tokenizer's {tokenizer.vocab_size}"
            )
        config = dataclasses.replace(config, vocab_size=tokenizer.vocab_size)
    return config


def _restore_weights(
    ckpt: Path, model: MoDTransformer, opt: torch.optim.Optimizer, env: D.DistEnv, parallel: str
) -> None:
    """The checkpoint's optimizer state, and a sharded checkpoint's weights (a whole one's
    weights came with the model): each rank reads its own slices."""
    if is_sharded(ckpt):
        load_sharded(ckpt, model, opt, alone=not env.active)
        bad = nonfinite_tensors(local_tensors(model, None))  # this rank's shards
        if D.max_over_ranks(env, len(bad)):
            refuse_nonfinite(ckpt, bad or ["on another rank"])
        return
    opt_state = load_optimizer_state(ckpt)
    if opt_state is None:
        raise ValueError(f"{ckpt} has no optimizer state: cannot resume exactly")
    try:
        opt.load_state_dict(opt_state)
        if parallel == "fsdp":
            D.shard_optimizer_state(opt)
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise corrupt(
            ckpt / "optimizer.safetensors", f"it does not fit the model ({exc!r})"
        ) from None


def _val_batches(
    val_tokens: torch.Tensor, tc: TrainConfig, seq_len: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    try:
        return eval_batches(val_tokens, tc.batch_size, seq_len, tc.eval_batches)
    except ValueError as exc:
        raise ValueError(
            f"the validation split is too short for seq_len {seq_len} ({exc}); use a smaller "
            "--seq-len or more data"
        ) from exc


def _open_log(
    out_dir: Path,
    env: D.DistEnv,
    state: dict[str, Any] | None,
    model_config: MoDConfig,
    tc: TrainConfig,
) -> MetricsLog | NoLog:
    """The metrics log (rank 0's; a resume drops the lines after its checkpoint) and, for a new
    run, ``run.json``: the model and training settings."""
    if not env.is_main:
        return NoLog()
    if state is not None:
        return MetricsLog(out_dir / "metrics.jsonl", int(state["step"]))
    log = MetricsLog(out_dir / "metrics.jsonl", None)
    write_json(
        out_dir / "run.json", {"model": model_config.to_dict(), "train": dataclasses.asdict(tc)}
    )
    return log


def refuse_nonfinite(ckpt: Path, bad: list[str]) -> None:
    if bad:
        raise CheckpointError(
            f"checkpoint {ckpt} holds weights that are NaN or infinite ({', '.join(bad[:3])}): "
            "it was written by a run that diverged. Start over (--overwrite) with a lower --lr"
        )


def _with_teacher(model: MoDTransformer, tc: TrainConfig, device: torch.device) -> Any:
    """The model, or with `distill` the model and its frozen dense teacher (the dense twin of
    the checkpoint the run started from: the original model, however far training has moved)."""
    if tc.distill == 0:
        return model
    if tc.init_from is None:
        raise ValueError("distill needs a teacher: start from a checkpoint (init_from)")
    start_model, _ = load_model(resolve_checkpoint(tc.init_from), map_location=device)
    teacher = dense_teacher(start_model.to(getattr(torch, tc.dtype)))
    return Distilled(model, teacher, tc.distill)


def step_module(
    model: MoDTransformer, tc: TrainConfig, env: D.DistEnv, device: torch.device, parallel: str
) -> torch.nn.Module:
    """What a training step calls: the model, compiled or not, wrapped in DDP under torchrun
    (gradients averaged over ranks; a model sharded by FSDP2 averages its own). Unused
    parameters are searched for: a routed block at k = 0, an expert no token chose, or
    random-score routers give some parameters no gradient on some steps, and DDP would
    otherwise wait for them forever."""
    module: torch.nn.Module = model
    if env.active and parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        module = DDP(model, device_ids=ids, find_unused_parameters=True)
    return torch.compile(module) if tc.compile else module
