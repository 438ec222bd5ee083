"""SIGTERM and SIGINT during training: stop after a step, with a checkpoint, instead of dying.

Schedulers (Slurm, Kubernetes, torchrun's own shutdown) send SIGTERM before SIGKILL, and Ctrl-C
sends SIGINT. While `train` runs, `StopSignals` turns either into a request: the loop finishes
the step it is in, writes a checkpoint (the run's usual kind, whole or sharded), releases the run
lock and raises `TrainingStopped`, which the `mod` command turns into one line on stderr and
exit status 128 + the signal's number (143 for SIGTERM, 130 for SIGINT).

- One process looks at the request after every step (a Python int: no host sync).
- Under torchrun every rank gets the SIGTERM, not all at the same step: the ranks combine their
  requests (`max_over_ranks`) at log steps only, where the divergence watch syncs anyway, so
  they all stop at the next log step (and write the collective checkpoint together).
  torchrun sends SIGKILL `--shutdown-timeout` seconds (30) after its SIGTERM.
- A signal during set-up, before the first step, stops the run as the loop starts; one during
  the last step lets the run finish (its summary written), then raises all the same, so that a
  caller running several (`mod study`) stops too.
- A second SIGINT while stopping interrupts at once (`KeyboardInterrupt`, the usual "press
  Ctrl-C again"): the checkpoint being written is then lost, the previous one stays (writes are
  atomic). A second SIGTERM changes nothing.
- Handlers are installed only in the main thread (Python allows no other), never over an
  ignored signal or one Python could not restore, and the previous ones are back when `train`
  returns or raises.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from ..runtime import distributed as D

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TrainingStopped(Exception):
    """A signal (`signum`) stopped training cleanly after step `step`: `checkpoint` (None when
    the run never saved one) is in place, and the command `resume` (None: nothing needs
    resuming) continues the run exactly. `what` says what happened, without the advice (a study
    gives its own)."""

    def __init__(
        self,
        signum: int,
        step: int,
        what: str,
        checkpoint: Path | None,
        resume: str | None,
        advice: str = "nothing needs resuming",
    ) -> None:
        self.signum, self.step, self.checkpoint, self.resume = signum, step, checkpoint, resume
        self.what = what
        super().__init__(f"{what}; {f'resume with: {resume}' if resume else advice}")

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal."""
        return 128 + self.signum


class StopSignals(contextlib.AbstractContextManager):
    """SIGTERM and SIGINT set `signum` (the first one received) instead of ending the process;
    `announce`: say so on stderr (rank 0 only, under torchrun)."""

    def __init__(self, announce: bool = True, torchrun: bool = False) -> None:
        self.signum = 0
        self.announce, self.torchrun = announce, torchrun
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # signals reach the main thread only: there, the defaults stay
        for sig in STOP_SIGNALS:
            previous = signal.getsignal(sig)
            # None: set outside Python, not restorable from it; SIG_IGN: ignored on purpose
            # (a background job of a script ignores SIGINT), and it stays so.
            if previous is not None and previous != signal.SIG_IGN:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.signum = signum
        if self.announce:
            when = "at the next log step" if self.torchrun else "after this step"
            note = (
                f"\n{signal.Signals(signum).name} received: stopping {when}, with a checkpoint "
                "(Ctrl-C again stops at once, without it)\n"
            )
            # os.write, not print: the handler may run while the main thread is inside a
            # write to sys.stderr (the progress bar), and a buffered stream is not reentrant.
            with contextlib.suppress(OSError, ValueError):
                os.write(sys.stderr.fileno(), note.encode())

    def requested(self, env: D.DistEnv, sync: bool) -> int:
        """The signal to stop on, 0 for none. One process: this one's, at any step. Under
        torchrun: the ranks' largest, at `sync` steps only (a collective every rank reaches at
        the same step), else 0, so that the ranks stop together."""
        if not env.active:
            return self.signum
        return D.max_over_ranks(env, self.signum) if sync else 0


def stopped(
    signum: int,
    step: int,
    run_start: int,
    out: Path,
    checkpoint: Path | None,
    torchrun: bool,
    complete: bool = False,
) -> TrainingStopped:
    """The `TrainingStopped` of the run in `out` stopped after `step` (`run_start`: the step
    this process began at; `checkpoint`: None when the run never saved one; `complete`: the
    signal came after the last step's checkpoint)."""
    name = signal.Signals(signum).name
    launch = "torchrun ... -m mixture_of_depths" if torchrun else "mod"
    resume = f"{launch} train --out {out} --resume"
    if complete:
        what = f"stopped by {name} after step {step}, the last: the run is complete"
        return TrainingStopped(signum, step, f"{what} (checkpoint in {checkpoint})", checkpoint,
                               None)  # fmt: skip
    if checkpoint is None:
        what = f"stopped by {name} before the first step of {out}: nothing was trained"
        advice = "nothing needs resuming (a rerun starts over: --overwrite)"
        return TrainingStopped(signum, step, what, None, None, advice)
    if step == run_start:
        what = (
            f"stopped by {name} before step {step + 1}: nothing new was trained; the "
            f"checkpoint of step {step} in {checkpoint} is as it was"
        )
        return TrainingStopped(signum, step, what, checkpoint, resume)
    what = f"stopped by {name} after step {step}: checkpoint in {checkpoint}"
    return TrainingStopped(signum, step, what, checkpoint, resume)


__all__ = ["STOP_SIGNALS", "StopSignals", "TrainingStopped", "stopped"]
