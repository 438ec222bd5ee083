"""`mod study FOLDER`: run (or resume) the study a folder defines (`studies.loader`; this
repository's are under experiments/). A SIGTERM or SIGINT stops the run in training with its
checkpoint, and the study with 128 + the signal's number."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..studies import loader, rounds, scheduler, workers
from ..studies.rounds import Round
from ..studies.runner import Loop, Plan, rewrite_report, study
from ..train import TrainingStopped
from .flags import ShowDefaults


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="run or resume a study of training runs at fixed FLOP budgets, named by its folder",
        formatter_class=ShowDefaults,
        description="Train the runs a study folder plans (its __init__.py defines STUDY), each "
        "to a fixed training-FLOP budget, and write results.jsonl, report.md and the figures "
        "into the folder (--quick: into <folder>/quick; --out: elsewhere). Rerun to resume.",
    )
    p.add_argument("study", help="the study's folder (its __init__.py defines STUDY)")
    p.add_argument(
        "--out",
        default=None,
        help="results, report and figures (default: the study's folder, or <folder>/quick "
        "with --quick)",
    )
    p.add_argument(
        "--work", default=None, help="the runs' checkpoints (default: runs/ inside --out)"
    )
    p.add_argument(
        "--max-runs",
        type=int,
        default=None,
        help="a study that plans from its results: stop after this many new runs, per worker "
        "(rerun to go on)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="a study that plans from its results: train this many runs at once, in separate "
        "processes sharing the cores (each with cores/workers threads): small models use one "
        "thread better than two (default: %(default)s)",
    )
    p.add_argument(
        "--report",
        action="store_true",
        help="train nothing: rewrite the report, findings and figures from the results in "
        "--out (byte-stable: a second run changes nothing)",
    )
    sched = p.add_argument_group(
        "on another scheduler",
        "run the study's runs elsewhere (a cluster, more cores) and bring them back: print them, "
        "run them, then --collect; a study that plans from its results gives the runs called "
        "for so far: collect, then ask again",
    )
    sched.add_argument(
        "--commands",
        action="store_true",
        help="print each pending run as a mod train command line (its folder under --work); "
        "an interrupted one resumes with mod train --out FOLDER --resume",
    )
    sched.add_argument(
        "--slurm", default=None, metavar="FILE", help="write the pending runs as a Slurm array "
        "script (sbatch FILE); a requeued task resumes its run"
    )  # fmt: skip
    sched.add_argument(
        "--torchrun", type=int, default=0, metavar="N",
        help="with --commands or --slurm: each run under torchrun with N processes per node",
    )  # fmt: skip
    sched.add_argument(
        "--collect", action="store_true", help="add the runs that finished under --work to the "
        "results (with the study's profile of each) and rewrite the report"
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="tiny budgets and models: a smoke run of "
                   "the whole plan (tens of runs: it says how many as it starts)")  # fmt: skip
    p.add_argument("--data", default=None, help="text file or folder (default: Python's stdlib)")
    p.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="keep each finished run's folder and checkpoint (default: removed once its row "
        "is written, except where the study measures the models afterwards)",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar: a log line per finished run (for a background study)",
    )
    p.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except TrainingStopped as exc:  # the run in training saved its checkpoint
        print(f"mod study: {exc.what}; the study stopped: rerun the same command to resume it",
              file=sys.stderr)  # fmt: skip
        return exc.exit_code


def _run(args: argparse.Namespace) -> int:
    for flag, value in (("--max-runs", args.max_runs), ("--workers", args.workers)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    folder = loader.study_folder(args.study)
    the_study = loader.load_study(folder)
    out = Path(args.out) if args.out else loader.out_for(folder, args.quick)
    work = Path(args.work) if args.work else out / "runs"
    if args.report:
        rewrite_report(the_study, out, args.quick)
        print(f"report: {out}/report.md")
        return 0
    if args.commands or args.slurm or args.collect:
        return _elsewhere(args, the_study, out, work)
    adaptive = isinstance(the_study, Round)
    if not adaptive and (args.workers != 1 or args.max_runs is not None):
        raise ValueError(f"--workers and --max-runs apply to a study that plans from its results "
                         f"(a studies.rounds.Round); {args.study} is not one")  # fmt: skip
    if isinstance(the_study, Loop):
        return the_study.run(out, work, args.quick, args.data, not args.no_progress)
    if adaptive and args.workers > 1:
        return workers.launch(
            args.workers, str(out), str(work), args.data, args.max_runs, args.quick, str(out),
            target=[str(folder)],
        )  # fmt: skip
    if adaptive:
        results = rounds.run(
            the_study, out, work, args.quick, args.data, not args.no_progress, args.max_runs,
            worker=args.worker_index,
        )  # fmt: skip
    elif isinstance(the_study, Plan):
        results = study(
            the_study, out, work, quick=args.quick, data=args.data,
            keep_checkpoints=args.keep_checkpoints, progress=not args.no_progress,
        )  # fmt: skip
    else:
        raise ValueError(f"{args.study}: STUDY must be a studies.runner.Plan, a "
                         f"studies.rounds.Round or a studies.runner.Loop, got "
                         f"{type(the_study).__name__}")  # fmt: skip
    print(f"{len(results)} runs in {out}/results.jsonl; report: {out}/report.md")
    return 0


def _elsewhere(args: argparse.Namespace, the_study: Any, out: Path, work: Path) -> int:
    """--commands, --slurm, --collect: the study's runs on someone else's scheduler."""
    if isinstance(the_study, Loop):
        raise ValueError(f"{args.study} runs a loop of its own: it has no runs to print")
    if args.torchrun < 0:
        raise ValueError(f"--torchrun must be >= 0, got {args.torchrun}")
    if args.collect:
        got = scheduler.collect(the_study, out, work, args.quick, args.data)
        print(f"collected {len(got)} runs into {out}/results.jsonl; report: {out}/report.md")
        return 0
    runs = scheduler.commands(the_study, out, work, args.quick, args.data, args.torchrun)
    if args.slurm:
        name = Path(args.study).resolve().name
        script = scheduler.slurm_script([c for c, _ in runs], [o for _, o in runs], name, work)
        Path(args.slurm).write_text(script)
        print(f"{len(runs)} runs in {args.slurm}: sbatch {args.slurm}, then mod study "
              f"{args.study} --collect", file=sys.stderr)  # fmt: skip
    else:
        print("\n".join(c for c, _ in runs))
    return 0
