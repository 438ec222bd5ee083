"""Run `mod ARGS...` and SIGKILL this process at a chosen point: the fault-injection suite's runner.

    python crash.py POINT N mod-args...

POINT is where the N-th event kills the process (kill -9: no cleanup handler runs, as with an OOM
kill or a lost machine):

- ``log``: right after the N-th training log line is written (between checkpoints);
- ``tensors``: inside a checkpoint write, after the N-th safetensors file went into the
  temporary folder (the model file; N+1 is the optimizer's);
- ``swap``: inside a checkpoint write, between its two renames (the N-th time the old checkpoint
  was moved aside and the new one is not yet in place);
- ``trash``: inside ``--overwrite``, after the old run's first file (its checkpoint) went into the
  trash folder and before the rest;
- ``shards``: inside a sharded checkpoint write, right after this rank wrote its shard file for
  the N-th time (the other ranks wait for it; the folder is not yet in place);
- ``slow``: no fault, but a sleep of N milliseconds after each training log line (a run slow
  enough for a test to send it a signal mid-run, tests/train/test_signals.py);
- ``none``: no fault (the uninterrupted reference run, started the same way).

Under torchrun (a worker of ``torchrun ... tests/crash.py POINT N ...``) only rank 0 of the first
attempt dies (``POINT@R``: rank R): the restarted job runs clean, as a job whose lost machine came
back would.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    point, n, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    point, _, rank = point.partition("@")
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or os.environ.get("RANK", "0") != (
        rank or "0"
    ):
        point = "none"
    import mixture_of_depths.runtime.checkpoint as ck
    import mixture_of_depths.train as tr
    from mixture_of_depths.cli import main as mod

    count = 0

    def hit() -> bool:
        nonlocal count
        count += 1
        return count == n

    if point == "log":
        real_write = tr.MetricsLog.write

        def write(self, record):  # noqa: ANN001, ANN202
            real_write(self, record)
            if "lm_loss" in record and hit():
                die()

        tr.MetricsLog.write = write
    elif point == "slow":
        real_write = tr.MetricsLog.write

        def write(self, record):  # noqa: ANN001, ANN202
            real_write(self, record)
            if "lm_loss" in record:
                time.sleep(n / 1000)

        tr.MetricsLog.write = write
    elif point == "tensors":
        real_save = ck.atomic_save_tensors

        def save(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            real_save(*a, **kw)
            if hit():
                die()

        ck.atomic_save_tensors = save
    elif point in ("swap", "trash"):
        real_replace = os.replace
        target = ".checkpoint.old" if point == "swap" else "checkpoint"

        def replace(src, dst):  # noqa: ANN001, ANN202
            real_replace(src, dst)
            if os.path.basename(dst) == target and (point == "swap" or ".overwritten." in str(dst)):
                if hit():
                    die()

        os.replace = replace
    elif point == "shards":
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

        real_write = HuggingFaceStorageWriter.write_data

        def write_data(self, plan, planner):  # noqa: ANN001, ANN202
            fut = real_write(self, plan, planner)
            fut.wait()
            if hit():
                die()
            return fut

        HuggingFaceStorageWriter.write_data = write_data
    elif point != "none":
        raise SystemExit(f"unknown fault point {point!r}")
    return mod(args)


if __name__ == "__main__":
    from mixture_of_depths.cli import exit_with

    exit_with(main())
