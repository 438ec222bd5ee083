"""`mod study`: the isoFLOP studies (resumable; rerun to go on)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="the isoFLOP studies: MoD against dense, or MoD/MoE/MoDE (--plan mode), at equal "
        "training FLOPs (resumable)",
        description="Train dense and MoD models of several sizes to fixed training-FLOP budgets, "
        "plus ablations, and write results.jsonl, report.md and plots. Rerun to resume.",
    )
    p.add_argument(
        "--plan",
        default="isoflop",
        choices=["isoflop", "mode", "kv", "convert", "round2"],
        help="isoflop: MoD against dense over sizes, with ablations; mode: dense, MoD, MoE, MoE "
        "with dropping, staged and integrated MoDE; kv: the KV strategies (skipped_kv none and "
        "residual) at two capacities and two lengths; convert: a pretrained dense model "
        "converted to MoD, untrained, router-tuned, distilled, fully fine-tuned (docs/convert; "
        "needs the [hf] extra); round2: the second round on BPE tokens: routing ablations with "
        "compute-matched random baselines and diagnostics, then the grid at 256 and 1024 tokens "
        "of context with the winning causal router (docs/study/round2) (default: %(default)s)",
    )
    p.add_argument(
        "--max-runs",
        type=int,
        default=None,
        help="round2: stop after this many new runs, per worker (rerun to go on)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="results, report, plots (default: docs/study, or docs/study/<plan> for --plan "
        "mode and kv)",
    )
    p.add_argument(
        "--work",
        default=None,
        help="run folders (default: runs/study, or runs/study-<plan> for --plan mode and kv)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="round2: train this many runs at once, in separate processes sharing the cores "
        "(each with cores/workers threads): small models use one thread better than two "
        "(default: %(default)s)",
    )
    p.add_argument("--quick", action="store_true", help="tiny budgets and models: a smoke run")
    p.add_argument("--data", default=None, help="text file or folder (default: Python's stdlib)")
    p.add_argument("--keep-checkpoints", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    from ..study import ISOFLOP, study
    from ..study_kv import PLAN as KV
    from ..study_mode import PLAN as MODE

    if args.workers != 1 and args.plan != "round2":
        raise ValueError(f"--workers applies to --plan round2 only, got {args.workers} with "
                         f"--plan {args.plan}")  # fmt: skip
    if args.plan == "convert":
        from ..study_convert import OUT
        from ..study_convert import run as convert_study

        results = convert_study(
            args.out, args.work, args.quick, args.data, progress=not args.no_progress
        )
        out = args.out or (OUT + ("-quick" if args.quick else ""))
        print(f"{len(results)} models in {out}/results.jsonl; report: {out}/report.md")
        return 0
    if args.plan == "round2":
        from ..study_round2 import OUT as R2
        from ..study_round2 import run as round2

        if args.max_runs is not None and args.max_runs < 1:
            raise ValueError(f"--max-runs must be >= 1, got {args.max_runs}")
        out = args.out or (R2 + ("-quick" if args.quick else ""))
        if args.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {args.workers}")
        if args.workers > 1:
            return _study_workers(args, out)
        results = round2(
            args.out,
            args.work,
            args.quick,
            args.data,
            not args.no_progress,
            args.max_runs,
            worker=args.worker_index,
        )
        print(f"{len(results)} runs in {out}/results.jsonl; report: {out}/report.md")
        return 0
    plan = {"isoflop": ISOFLOP, "mode": MODE, "kv": KV}[args.plan]
    results = study(
        args.out,
        args.work,
        quick=args.quick,
        data=args.data,
        keep_checkpoints=args.keep_checkpoints,
        progress=not args.no_progress,
        plan=plan,
    )
    out = args.out or plan.out
    print(f"{len(results)} runs in {out}/results.jsonl; report: {out}/report.md")
    return 0


def _study_workers(args: argparse.Namespace, out: str) -> int:
    """`mod study --plan round2 --workers N`: N processes of the study, each claiming its own
    runs (`study_round2.run`), with the cores split between them. Each prints a line per run
    it finishes; a bar per process would garble the terminal."""
    import signal
    import subprocess

    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))  # the cores this process may use
    else:
        cores = os.cpu_count() or 1
    if args.workers > cores:
        raise ValueError(f"--workers must be at most the {cores} cores here, got {args.workers}")
    threads = max(1, cores // args.workers)
    cmd = [sys.executable, "-m", "mixture_of_depths", "study", "--plan", "round2", "--no-progress"]
    for flag, value in (("--out", args.out), ("--work", args.work), ("--data", args.data),
                        ("--max-runs", args.max_runs)):  # fmt: skip
        if value is not None:
            cmd += [flag, str(value)]
    if args.quick:
        cmd.append("--quick")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    print(f"{args.workers} workers, {threads} thread(s) each; results in {out}/results.jsonl",
          flush=True)  # fmt: skip
    procs = [
        subprocess.Popen([*cmd, "--worker-index", str(i)], env=env) for i in range(args.workers)
    ]

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)  # a kill stops the workers too
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        for p in procs:  # a terminal's Ctrl-C reached them too; a kill did not
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    bad = [c for c in codes if c != 0]
    if bad:
        print(f"mod study: {len(bad)} of {args.workers} workers failed (exit {bad[0]})",
              file=sys.stderr)  # fmt: skip
        return bad[0]
    print(f"report: {out}/report.md")
    return 0
