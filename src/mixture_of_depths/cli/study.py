"""`mod study`: the isoFLOP studies (resumable; rerun to go on). A SIGTERM or SIGINT stops the
run in training with its checkpoint, and the study with 128 + the signal's number."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..studies import convert, isoflop, kv, loader, mode, mor, round2, round3, rounds, workers
from ..studies.runner import Plan, study
from ..train import TrainingStopped

# the plans `runner.study` runs; convert has a loop of its own; the rounds plan from their results
PLANS: dict[str, Plan] = {
    "isoflop": isoflop.ISOFLOP, "mode": mode.PLAN, "kv": kv.PLAN, "mor": mor.PLAN
}  # fmt: skip
ROUNDS = {"round2": round2, "round3": round3}


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="the isoFLOP studies: MoD against dense, or MoD/MoE/MoDE (--plan mode), at equal "
        "training FLOPs (resumable)",
        description="Train dense and MoD models of several sizes to fixed training-FLOP budgets, "
        "plus ablations, and write results.jsonl, report.md and plots. Rerun to resume.",
    )
    p.add_argument(
        "study",
        nargs="?",
        default=None,
        help="a study folder (its __init__.py defines STUDY, e.g. experiments/round4): results, "
        "report and figures go into it (--quick: into <folder>/quick), checkpoints into its "
        "runs/ folder",
    )
    p.add_argument(
        "--plan",
        default="isoflop",
        choices=["isoflop", "mode", "kv", "mor", "convert", "round2", "round3"],
        help="isoflop: MoD against dense over sizes, with ablations; mode: dense, MoD, MoE, MoE "
        "with dropping, staged and integrated MoDE; kv: the KV strategies (skipped_kv none and "
        "residual) at two capacities and two lengths; mor: Mixture-of-Recursions (expert and token "
        "choice, recursion-wise and shared KV, the plain recursive model) beside dense and MoD, "
        "and at equal unique parameters (docs/mor.md); convert: a pretrained dense model "
        "converted to MoD, untrained, router-tuned, distilled, fully fine-tuned (docs/convert; "
        "needs the [hf] extra); round2: the second round on BPE tokens: routing ablations with "
        "compute-matched random baselines and diagnostics, then the grid at 256 and 1024 tokens "
        "of context with the winning causal router (docs/study/round2); round3: where MoD loses "
        "(1024 tokens, 1.5e14 FLOPs), one arm per hypothesis of why, with the copy probe "
        "(docs/study/round3) (default: %(default)s)",
    )
    p.add_argument(
        "--max-runs",
        type=int,
        default=None,
        help="round2, round3: stop after this many new runs, per worker (rerun to go on)",
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
        help="round2, round3: train this many runs at once, in separate processes sharing the "
        "cores "
        "(each with cores/workers threads): small models use one thread better than two "
        "(default: %(default)s)",
    )
    p.add_argument("--quick", action="store_true", help="tiny budgets and models: a smoke run")
    p.add_argument("--data", default=None, help="text file or folder (default: Python's stdlib)")
    p.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="keep each finished run's folder and checkpoint (default: removed once its row "
        "is written, except where the plan measures the models afterwards)",
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
    if args.study is not None:
        return _folder(args)
    if args.workers != 1 and args.plan not in ROUNDS:
        raise ValueError(f"--workers applies to --plan round2 and round3 only, got "
                         f"{args.workers} with --plan {args.plan}")  # fmt: skip
    if args.plan == "convert":
        results = convert.run(
            args.out, args.work, args.quick, args.data, progress=not args.no_progress
        )
        out = args.out or convert.FOLDERS.out_for(args.quick)
        print(f"{len(results)} models in {out}/results.jsonl; report: {out}/report.md")
        return 0
    if args.plan in ROUNDS:
        return _round(args, ROUNDS[args.plan])
    plan = PLANS[args.plan]
    results = study(
        plan,
        args.out,
        args.work,
        quick=args.quick,
        data=args.data,
        keep_checkpoints=args.keep_checkpoints,
        progress=not args.no_progress,
    )
    out = args.out or plan.folders.out_for(args.quick)
    print(f"{len(results)} runs in {out}/results.jsonl; report: {out}/report.md")
    return 0


def _round(args: argparse.Namespace, study_round: Any) -> int:
    """A study that plans from its results (`studies.rounds`), in one process or `--workers`."""
    if args.max_runs is not None and args.max_runs < 1:
        raise ValueError(f"--max-runs must be >= 1, got {args.max_runs}")
    out = args.out or study_round.FOLDERS.out_for(args.quick)
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    if args.workers > 1:
        return workers.launch(
            args.workers,
            args.out,
            args.work,
            args.data,
            args.max_runs,
            args.quick,
            out,
            target=["--plan", args.plan],
        )
    results = study_round.run(
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


def _folder(args: argparse.Namespace) -> int:
    """A study named by its folder (`studies.loader`), in one process or `--workers`."""
    if args.max_runs is not None and args.max_runs < 1:
        raise ValueError(f"--max-runs must be >= 1, got {args.max_runs}")
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    study = loader.load_study(args.study)
    folder = str(loader.study_folder(args.study))
    out = args.out or str(loader.out_for(folder, args.quick))
    work = args.work or str(loader.work_for(folder, args.quick))
    if args.workers > 1:
        return workers.launch(
            args.workers, out, work, args.data, args.max_runs, args.quick, out, target=[folder]
        )
    results = rounds.run(
        study,
        out,
        work,
        args.quick,
        args.data,
        not args.no_progress,
        args.max_runs,
        worker=args.worker_index,
    )
    print(f"{len(results)} runs in {out}/results.jsonl; report: {out}/report.md")
    return 0
