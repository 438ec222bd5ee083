"""`mod study FOLDER --workers N`: N processes of a study that plans from its results (a
`rounds.Round`), each claiming its own
runs (`rounds.run`), with the cores split between them: small models use one thread better than
two. Each worker prints a line per run it finishes; a bar per process would garble the terminal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def usable_cores() -> int:
    """The cores this process may use (its affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def launch(
    workers: int,
    out: str | None,
    work: str | None,
    data: str | None,
    max_runs: int | None,
    quick: bool,
    report_dir: str,
    target: list[str],
) -> int:
    """Run `workers` processes of ``mod study <target>`` (`target`: the study's folder, a
    `studies.rounds.Round`) on the
    same folders (`out`, `work`: None for the defaults) and wait for them all; the exit status
    is the first failure's, else 0. `report_dir` is where they write, for the messages."""
    cores = usable_cores()
    if workers > cores:
        raise ValueError(f"--workers must be at most the {cores} cores here, got {workers}")
    threads = max(1, cores // workers)
    cmd = [sys.executable, "-m", "mixture_of_depths", "study", *target, "--no-progress"]
    for flag, value in (("--out", out), ("--work", work), ("--data", data),
                        ("--max-runs", max_runs)):  # fmt: skip
        if value is not None:
            cmd += [flag, str(value)]
    if quick:
        cmd.append("--quick")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    print(f"{workers} workers, {threads} thread(s) each; results in {report_dir}/results.jsonl",
          flush=True)  # fmt: skip
    procs = [subprocess.Popen([*cmd, "--worker-index", str(i)], env=env) for i in range(workers)]
    codes, signum = _wait_all(procs)
    if signum:  # each worker stopped its run with a checkpoint (or was between runs)
        print(f"mod study: stopped by {signal.Signals(signum).name}: the workers saved their runs; "
              "rerun the same command to resume the study", file=sys.stderr)  # fmt: skip
        return 128 + signum
    bad = [c for c in codes if c != 0]
    if bad:
        print(f"mod study: {len(bad)} of {workers} workers failed (exit {bad[0]})",
              file=sys.stderr)  # fmt: skip
        return bad[0]
    print(f"report: {report_dir}/report.md")
    return 0


def _wait_all(procs: list[subprocess.Popen]) -> tuple[list[int], int]:
    """The exit codes of `procs`, and the signal that stopped this process (0: none). A SIGTERM
    of this process goes to them at once (a kill reached this process only); on an interrupt,
    each gets a moment to stop on the Ctrl-C a terminal sent it as well, then a SIGTERM of its
    own: a worker stops its run after the current step, with a checkpoint, on either, and a
    second SIGINT would stop it at once, without one (`train.signals`)."""
    got = []

    def forward(signum: int, frame: object) -> None:
        got.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        return [p.wait() for p in procs], (got[0] if got else 0)
    except KeyboardInterrupt:
        for p in procs:  # a terminal's Ctrl-C reached them too; a kill did not
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGTERM)
        return [p.wait() for p in procs], signal.SIGINT
    finally:
        signal.signal(signal.SIGTERM, previous)
