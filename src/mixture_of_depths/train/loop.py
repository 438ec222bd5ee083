"""The training loop: `train` runs (or resumes) a run and returns its summary.

Each step: the batch of that step (a pure function of the seed and the step, so a resumed run
reads the same tokens), forward, backward, clipping before AdamW. At log steps a JSON line; at
evaluation steps validation in both routing modes, the routing probe, and an atomic checkpoint
(also every `checkpoint_every` steps). A loss or gradient norm that is not finite stops the run
at the next boundary, before anything after it is saved. SIGTERM and SIGINT stop it after a step,
with a checkpoint (`signals`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..config import MoDConfig
from ..fileio import write_json
from ..model import MoDOutput
from ..precision import autocast_for
from ..probes import copy_probe
from ..routing import decision_flips, routing_diagnostics
from ..runtime import distributed as D
from ..runtime.checkpoint import save_checkpoint, save_sharded_checkpoint
from ..runtime.device import resolve_device
from ..runtime.runlock import RunLock
from .calibrate import calibrate_model
from .config import TrainConfig, lr_at
from .evaluate import evaluate, expert_slot_shares
from .report import format_eval, mean_expert_share, plot_metrics
from .resume import check_out
from .setup import start
from .signals import StopSignals, TrainingStopped, stopped
from .state import Run
from .tune import capacity_at, set_capacity


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm stopped being finite; nothing after it was saved."""


def train(
    model_config: MoDConfig | None,
    tc: TrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Train (or resume) and return a summary. With `resume`, `model_config` may be None.

    A new run refuses an `out` that already holds a run unless `overwrite`, which deletes that
    run first. One run per folder: a lock (`runlock.RunLock`) refuses a second process. A loss or
    gradient norm that is not finite stops the run with `TrainingDiverged` at the next log or
    eval boundary, before anything after it is saved. SIGTERM or SIGINT (in the main thread)
    stops the run after the current step (under torchrun: at the next log step) with a
    checkpoint, and raises `TrainingStopped` once the lock is released; the previous handlers
    are back when `train` returns or raises (`signals`). On the CPU a resumed run reproduces an
    uninterrupted one bit for bit; on CUDA, nondeterministic kernels (flash-attention backward,
    index_add) make even two uninterrupted runs differ slightly.
    """
    out_dir = Path(tc.out)
    check_out(out_dir)
    env = D.env_from_torchrun()
    device = resolve_device(tc.device)  # a bad device is an error before anything is created
    if env.active and device.type == "cuda":
        device = torch.device("cuda", env.local_rank)
    D.init(env, device)
    try:
        with StopSignals(announce=env.is_main, torchrun=env.active) as stop:
            try:
                # One run per folder: rank 0 holds the lock for the job.
                with RunLock(out_dir) if env.is_main else contextlib.nullcontext():
                    run = start(model_config, tc, resume, overwrite, env, device)
                    summary = _train_loop(run, progress and env.is_main, stop)
            except TrainingStopped:
                D.barrier(env)  # the ranks stopped at the same step; none tears down early
                raise
            # Every rank done before the group is torn down: gloo aborts a process whose peers
            # destroy the group while it still runs ("terminate called without an active
            # exception").
            D.barrier(env)
            if stop.signum:  # after the last step: complete, but the caller was asked to stop
                raise stopped(stop.signum, tc.steps, run.start_step, out_dir, run.ckpt_dir,
                              env.active, complete=True)  # fmt: skip
        return summary
    finally:
        D.shutdown(env)


def _train_loop(run: Run, progress: bool, stop: StopSignals) -> dict[str, Any]:
    tc = run.tc
    last_eval: dict[str, Any] = {}
    bar = tqdm(
        total=tc.steps,
        initial=run.start_step,
        disable=not progress,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        # In a log file (CI, nohup) a redraw every 0.1 s is noise: one line every 30 s instead.
        mininterval=0.1 if sys.stderr.isatty() else 30.0,
    )
    try:
        _stop_if_asked(run, stop, run.start_step, sync=True)  # a signal during set-up
        run.clock.start()
        for step in range(run.start_step, tc.steps):
            out, grad_norm, lr = _train_step(run, step)
            done = step + 1
            at_log = done % tc.log_every == 0 or done == tc.steps
            if at_log:
                _check_finite(run, done)
                _log_step(run, done, out, grad_norm, lr, bar)
            bar.update(1)
            if done % tc.eval_every == 0 or done == tc.steps:
                _check_finite(run, done)
                last_eval = _evaluate_and_save(run, done, bar)
            elif tc.checkpoint_every and done % tc.checkpoint_every == 0:
                _check_finite(run, done)
                with run.clock.paused() as elapsed:  # kept out of tokens/s, as evals are
                    _checkpoint(run, done, elapsed)
            if done < tc.steps:  # after the last, the run finishes first (see `train`)
                _stop_if_asked(run, stop, done, sync=at_log)
    finally:
        bar.close()
    if not last_eval:  # resumed at the final step: nothing left to train
        last_eval = _evaluate(run)
    calibration = _calibrate(run, progress) if tc.calibrate else None
    return _finish(run, last_eval, calibration)


def _calibrate(run: Run, progress: bool) -> dict[str, Any]:
    """Fit the causal thresholds on held-out windows (`calibrate.calibrate_model`) and write
    the checkpoint again, atomically, with them in its config and, in its trainer state, those
    the run trained with (a resume goes on with these). Every rank runs it whole, as the routing
    probe (a sharded model's forward is collective); the time is kept out of training's."""
    if run.calib_skip:
        if run.env.is_main:
            print(f"note: {run.calib_skip}", file=sys.stderr)
        return {"skipped": run.calib_skip}
    with run.clock.paused() as elapsed:
        trained_with = list(run.model_config.causal_thresholds)
        result = calibrate_model(run.model, run.calib_batches, run.device, progress)
        thresholds = list(result["thresholds"].values())
        run.model_config = dataclasses.replace(
            run.model_config, causal_thresholds=tuple(thresholds)
        )
        run.calibration = {"thresholds": thresholds, "uncalibrated": trained_with}
        _checkpoint(run, run.tc.steps, elapsed)
    return result


def _stop_if_asked(run: Run, stop: StopSignals, done: int, sync: bool) -> None:
    """Raise `TrainingStopped` if a signal asked to stop (`sync`: under torchrun, whether this
    step combines the ranks' requests), after a checkpoint of step `done` unless one is in place
    (none before the first step: nothing was trained)."""
    signum = stop.requested(run.env, sync)
    if not signum:
        return
    if done > run.saved_step:
        _check_finite(run, done)  # a diverged run stops as such, its garbage unsaved
        with run.clock.paused() as elapsed:
            _checkpoint(run, done, elapsed)
    ckpt = run.ckpt_dir if run.saved_step else None
    raise stopped(signum, done, run.start_step, run.out_dir, ckpt, run.env.active)


def _train_step(run: Run, step: int) -> tuple[MoDOutput, torch.Tensor, float]:
    """One optimizer step: the batch of `step` (this rank's rows of it, in `grad_accum`
    micro-batches), forward, backward, clipping, AdamW. Returns the output (its losses the means
    over the micro-batches), the (pre-clip) gradient norm of the LM parameters and the learning
    rate."""
    tc = run.tc
    lr = lr_at(step, tc)
    for group in run.opt.param_groups:
        group["lr"] = lr
    if run.capacity_warmup:
        set_capacity(run.model, capacity_at(step, run.model_config.capacity, run.capacity_warmup))
    # Compiled code would recompile for each warm-up capacity (a new k, new shapes) until
    # dynamo's limit left the rest of the run eager: the warm-up steps run eager instead.
    step_fn = run.step_fn
    if tc.compile and step < run.capacity_warmup:
        step_fn = run.step_fn._orig_mod
    x, y = run.sampler.next_batch()
    rows = D.local_rows(run.env, tc.batch_size)
    x, y = x[rows].to(run.device, non_blocking=True), y[rows].to(run.device, non_blocking=True)
    n = tc.grad_accum
    if n == 1:
        with _autocast(run):
            out = step_fn(x, y, routing="topk")  # training routes by top-k, in any mode
        out.loss.backward()
    else:
        outs = []
        for i, (xm, ym) in enumerate(zip(x.chunk(n), y.chunk(n), strict=True)):
            # DDP reduces gradients on the last micro-batch only
            sync = i == n - 1 or not hasattr(step_fn, "no_sync")
            with contextlib.nullcontext() if sync else step_fn.no_sync(), _autocast(run):
                out = step_fn(xm, ym, routing="topk")
                (out.loss / n).backward()
            outs.append(out)
        out = _mean_output(outs)
    # Clip before the step: clipping after it would be a no-op on this update.
    max_norm = tc.grad_clip if tc.grad_clip > 0 else float("inf")
    grad_norm = D.full(torch.nn.utils.clip_grad_norm_(run.lm_params, max_norm))
    norms = [grad_norm]
    if run.predictor_params:
        norms.append(D.full(torch.nn.utils.clip_grad_norm_(run.predictor_params, max_norm)))
    run.watch.record(step + 1, out.loss, *norms)
    run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    run.clock.window_tokens += run.tokens_per_step
    return out, grad_norm, lr


def _mean_output(outs: list[MoDOutput]) -> MoDOutput:
    """The micro-batches' outputs as one: losses averaged (detached), the last one's routes."""

    def mean(name: str) -> torch.Tensor | None:
        vals = [getattr(o, name) for o in outs]
        return None if vals[0] is None else torch.stack([v.detach() for v in vals]).mean()

    last = outs[-1]
    return dataclasses.replace(
        last,
        loss=mean("loss"),
        lm_loss=mean("lm_loss"),
        aux_loss=mean("aux_loss"),
        moe_loss=mean("moe_loss"),
        distill_loss=mean("distill_loss"),
    )


def _check_finite(run: Run, done: int) -> None:
    """Stop the run if a step since the last look had a non-finite loss or gradient norm: the
    weights after it are garbage and must never reach a checkpoint (the last good one stays)."""
    bad = run.watch.first_bad(run.env)  # a rank's non-finite loss stops every rank
    if not bad:
        return
    loss, grad_norm, predictor_norm = run.watch.bad_values.tolist()
    if run.saved_step:
        kept = f"the checkpoint in {run.ckpt_dir} (step {run.saved_step}) is the last good one"
    else:
        first = min(run.tc.eval_every, run.tc.checkpoint_every or run.tc.steps, run.tc.steps)
        kept = f"no checkpoint was written (the first would have come at step {first})"
    msg = (
        f"training diverged at step {bad}: loss {loss}, gradient norm {grad_norm}"
        + (f", predictor's {predictor_norm}" if run.predictor_params else "")
        + " (learning rate "
        f"{lr_at(bad - 1, run.tc):.3g}); stopped at step {done} and saved nothing after it: "
        f"{kept}. Lower --lr or lengthen --warmup-steps, and start over (--overwrite)"
    )
    run.log.write({"step": bad, "diverged": msg})
    raise TrainingDiverged(msg)


def _log_step(
    run: Run, done: int, out: MoDOutput, grad_norm: torch.Tensor, lr: float, bar: tqdm
) -> None:
    """A JSON line of the step's losses, learning rate, gradient norm and tokens/s."""
    tok_s = run.clock.lap()
    losses = {"loss": out.loss.item(), "lm_loss": out.lm_loss.item()}
    losses["aux_loss"] = out.aux_loss.item()
    if out.moe_loss is not None:
        losses["moe_loss"] = out.moe_loss.item()
    if out.distill_loss is not None:
        losses["distill_loss"] = out.distill_loss.item()
    if run.capacity_warmup:
        losses["capacity"] = run.model.config.capacity
    if out.expert_routes:
        losses["expert_share"] = expert_slot_shares(out)
    rec = {
        "step": done,
        **D.mean_nested(run.env, losses),  # the whole batch's, not this rank's
        "lr": lr,
        "grad_norm": grad_norm.item(),
        "tokens_per_s": tok_s,
        "tokens": done * run.tokens_per_step,
    }
    run.log.write(rec)
    bar.set_postfix(  # no forced redraw: the bar's own mininterval decides
        loss=f"{rec['lm_loss']:.3f}",
        aux=f"{rec['aux_loss']:.3f}",
        tok_s=f"{tok_s:,.0f}",
        refresh=False,
    )


def _evaluate_and_save(run: Run, done: int, bar: tqdm) -> dict[str, Any]:
    """Validation in both routing modes, logged, then an atomic checkpoint; the time this takes
    is kept out of the tokens/s window."""
    with run.clock.paused() as elapsed:
        set_capacity(run.model, run.model_config.capacity)  # evaluate and save at the target
        ev = _evaluate(run)
        losses = (ev["val_loss_topk"], ev["val_loss_causal"])
        if not all(math.isfinite(v) for v in losses):
            msg = (
                f"validation loss is not finite at step {done} (top-k {losses[0]}, causal "
                f"{losses[1]}) although training's was: no checkpoint written; the last good "
                f"one is step {run.saved_step} in {run.ckpt_dir}"
            )
            run.log.write({"step": done, "diverged": msg})
            raise TrainingDiverged(msg)
        diag = _routing_probe(run)
        run.log.write({"step": done, **ev, **({"routing_diag": diag} if diag else {})})
        if run.env.is_main:  # tqdm.write prints on every rank, its bar disabled or not
            bar.write(format_eval(done, ev), file=sys.stderr)  # stdout: the summary alone
        _checkpoint(run, done, elapsed)
    return ev


def _checkpoint(run: Run, done: int, elapsed: float) -> None:
    """An atomic checkpoint of the run after `done` steps and `elapsed` training seconds (the
    logged time plus the window not yet logged: a checkpoint between log steps keeps it too);
    a collective under torchrun."""
    if run.sharded_checkpoints:  # every rank writes its shards
        save_sharded_checkpoint(
            run.ckpt_dir,
            run.model,
            run.opt,
            run.model_config,
            run.env,
            trainer_state=run.state_dict(done, elapsed),
            tokenizer=run.tokenizer,
        )
    else:
        weights, opt_state = D.full_state(run.model, run.opt)  # a collective when sharded
        if run.env.is_main:
            _save(run, weights, opt_state, run.state_dict(done, elapsed))
    D.barrier(run.env)  # no rank runs ahead of a checkpoint being written
    run.saved_step = done


@torch.no_grad()
def _routing_probe(run: Run) -> dict[str, dict[str, float]]:
    """`routing_diagnostics` on the first validation batch (every rank runs it whole: the same
    weights give the same numbers, and a sharded model's forward is collective), with the share
    of decisions that flipped since the last evaluation."""
    if run.model_config.is_dense:
        return {}
    x = run.val[0][0].to(run.device)
    was = run.model.training
    run.model.eval()
    try:
        with autocast_for(run.device):
            topk = run.model(x, routing="topk").routes
            causal = run.model(x, routing="causal").routes
    finally:
        run.model.train(was)
    stats, masks = routing_diagnostics(run.model_config, topk, causal)
    flips = decision_flips(run.probe_masks, masks)
    for name, row in stats.items():
        for mode in ("topk", "causal"):
            row[f"{mode}_flips"] = flips.get(f"{name}/{mode}", float("nan"))
    run.probe_masks = masks
    return stats


def _evaluate(run: Run) -> dict[str, Any]:
    """`evaluate` on this rank's rows of every validation batch, averaged over the ranks (every
    rank evaluates whole batches when the world size does not divide them), and the copy probe."""
    env, batches = run.env, run.val
    if env.active and all(len(x) % env.world_size == 0 for x, _ in batches):
        batches = [(x[D.local_rows(env, len(x))], y[D.local_rows(env, len(y))]) for x, y in batches]
        ev = D.mean_nested(env, evaluate(run.model, batches, run.device))
    else:
        ev = evaluate(run.model, batches, run.device)
    if run.seq_len >= 4:  # in-context copying; every rank runs it whole, as the routing probe
        with autocast_for(run.device):
            ev["copy_probe"] = copy_probe(run.model, length=run.seq_len)
    return ev


def _save(
    run: Run, weights: dict[str, torch.Tensor] | None, opt_state: dict | None, state: dict
) -> None:
    save_checkpoint(
        run.ckpt_dir,
        run.model,
        run.model_config,
        weights=weights,
        optimizer=run.opt if opt_state is None else opt_state,
        tokenizer=run.tokenizer,
        trainer_state=state,
    )


def _finish(
    run: Run, last_eval: dict[str, Any], calibration: dict[str, Any] | None
) -> dict[str, Any]:
    """The run's summary (also written to summary.json) and its loss plot; with `calibration`,
    the evaluation is the model's before it (the thresholds it trained with)."""
    tc = run.tc
    summary = {
        "out": str(run.out_dir),
        "checkpoint": str(run.ckpt_dir),
        "steps": tc.steps,
        "tokens": tc.steps * run.tokens_per_step,
        "train_time_s": run.clock.elapsed,
        "params": run.model.num_params(),
        "layer_kinds": run.model_config.layer_kinds,
        "capacity": run.model_config.capacity,
        **last_eval,
        **({"calibration": calibration} if calibration is not None else {}),
    }
    if not run.env.is_main:  # rank 0 writes the summary and the plot
        return summary
    if run.model_config.has_experts:
        summary["train_expert_share"] = mean_expert_share(run.out_dir / "metrics.jsonl")
    write_json(run.out_dir / "summary.json", summary)
    try:
        plot_metrics(run.out_dir / "metrics.jsonl", run.out_dir / "loss.png")
        summary["plot"] = str(run.out_dir / "loss.png")
    except Exception as exc:  # a plot is a convenience: never lose a finished run over it
        summary["plot_error"] = repr(exc)
    return summary


def _autocast(run: Run) -> torch.autocast:
    return autocast_for(run.device, None if run.tc.dtype == "float32" else "float32")
