"""Round 4's measures of its trained models, taken once training is done and nothing else runs
(items 4 and 5): ``python -m experiments.round4.measure --kept DIR`` (from the repository root;
DIR: the kept checkpoints, ``<work>-kept``).

- ``probes.jsonl``: the look-back probes (`lookback`) of every kept checkpoint.
- ``decode.jsonl``: each MoD family's best model (seed 0, or its arm's lowest kept seed:
  `stand_ins`) decoded beside dense's best, greedy and fed held-out text (``fed_`` keys)
  (`experiments.common.measure.decode_speeds`: CPU, one thread, interleaved rounds, the
  median; batch 1 and 8) and the KV bytes per token its cache held.

Both are resumable (a finished row is kept) and rewrite the report at the end. A kept model
that is gone (the work folder and its kept copies do not outlive the machine they trained on)
is trained again from its result row with ``--retrain``: on one thread training repeats
itself, so its loss must come out as the row's, and a retrained model whose loss differs stops
the measure rather than stand in for the run. It repeats itself only under the code that
trained it (`TRAINED_AT`): later commits train routed models to other float roundings, so train
them again with that commit's library first, then measure with today's::

    git worktree add ../r4 2324d99
    PYTHONPATH=../r4/src python -m experiments.round4.measure --kept K --retrain W --retrain-only
    python -m experiments.round4.measure --kept K
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

import mixture_of_depths
from mixture_of_depths.fileio import json_text
from mixture_of_depths.runtime.checkpoint import load_model
from mixture_of_depths.studies.profiles import keep
from mixture_of_depths.studies.runner import RunSpec, load_results, run_one

from ..common import measure
from . import STUDY, lookback, plan

HERE = Path(__file__).resolve().parent


def probe_all(kept: Path, out: Path, data: str | None) -> None:
    """The look-back probes of every checkpoint in `kept` not yet in ``probes.jsonl``."""
    path = out / "probes.jsonl"
    done = {r["name"] for r in load_results(path)}
    for ckpt in sorted(p for p in kept.iterdir() if (p / "model.safetensors").exists()):
        if ckpt.name in done:
            continue
        model, _ = load_model(ckpt)
        row = {"name": ckpt.name, **lookback.lookback(model, measure.val_tokens(ckpt, data))}
        with path.open("a") as fh:
            fh.write(json_text(row) + "\n")
        print(f"{ckpt.name}: repeat {row['repeat_score']:+.3f}, recall {row['recall_score']:+.3f}")


# The commit whose library the round-4 runs train from, and repeat under (README.md): from 5f532f8
# on, a routed model's training leaves it after some tens of steps (a change of float rounding:
# the same losses, gradients equal to 1e-7 in float32 and 2e-16 in float64; README.md), so only
# this code repeats them.
TRAINED_AT = "2324d99"

# how far a retrained run's loss may move from its row's: float sums in another order (a
# machine's other BLAS) move the fifth decimal; a different run moves the second
SAME_LOSS = 1e-3


def retrain(
    names: list[str],
    out: Path,
    kept: Path,
    work: Path,
    data: str | None,
    grid: Any = None,
    workers: int = 1,
) -> None:
    """Train the runs `names` again from their rows in ``results.jsonl`` into `work`, `workers`
    at a time (each on one thread, as the study trained them), and keep their models in `kept`;
    each loss must be its row's (`SAME_LOSS`). `grid`: the study's settings the runs trained
    under (default: the full round's)."""
    grid = STUDY.settings(False).grid if grid is None else grid
    rows = {r["name"]: r for r in load_results(out / "results.jsonl")}
    todo = [n for n in names if not (kept / n / "model.safetensors").exists()]
    for name in todo:
        if name not in rows:
            raise SystemExit(f"{name}: no such row in {out / 'results.jsonl'} to train again")
    jobs = [(rows[n], grid, work, data) for n in todo]
    if workers > 1 and len(jobs) > 1:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_one_thread) as pool:
            done = list(pool.map(_train_again, *zip(*jobs, strict=True)))
    else:
        threads = torch.get_num_threads()
        _one_thread()  # a run repeats its loss only on the one thread it trained on
        try:
            done = [_train_again(*job) for job in jobs]
        finally:
            torch.set_num_threads(threads)
    for name, loss in zip(todo, done, strict=True):
        gap = loss - rows[name]["val_loss_causal"]
        print(f"{name} trained again: causal loss {loss:.4f} ({gap:+.2e})")
        if abs(gap) > SAME_LOSS:
            raise SystemExit(f"{name}: the retrained loss differs by {gap:+.4f}: not the run")
        keep(work / name / "checkpoint", kept / name)


def _one_thread() -> None:
    torch.set_num_threads(1)


def _train_again(row: dict[str, Any], grid: Any, work: Path, data: str | None) -> float:
    """The causal loss of `row`'s run trained again (resumed where `work` has its checkpoint)."""
    return run_one(RunSpec.from_row(row), grid, work, data)["val_loss_causal"]


def best_runs(out: Path) -> dict[str, str | None]:
    """Each family's best run (findings.json's ``best_runs``; dense's under "dense")."""
    return json.loads((out / "findings.json").read_text())["best_runs"]


def stand_ins(out: Path, kept: Path) -> dict[str, str]:
    """Each family's model for the decode timings: its best run (seed 0), or, where that model
    is gone, the lowest seed of the same arm whose model is kept (any seed is the arm's model;
    training it again costs an hour); the best run itself where none is kept."""
    rows = [r for r in load_results(out / "results.jsonl") if r["name"].startswith("r4-")]
    chosen = {}
    for family, name in best_runs(out).items():
        if name is None:
            continue
        arm = next(plan.arm_key(r) for r in rows if r["name"] == name)
        seeds = sorted((r["seed"], r["name"]) for r in rows if plan.arm_key(r) == arm)
        kept_seeds = [n for _, n in seeds if (kept / n / "model.safetensors").exists()]
        chosen[family] = kept_seeds[0] if kept_seeds else name
    return chosen


def decode_all(kept: Path, out: Path, data: str | None) -> None:
    """Decode speed and KV bytes of each family's best run beside dense's (findings.json's
    ``best_runs``), unless ``decode.jsonl`` has them."""
    path = out / "decode.jsonl"
    if load_results(path):
        return
    best = stand_ins(out, kept)
    ckpts = {fam: kept / n for fam, n in best.items() if (kept / n).exists()}
    missing = sorted(set(best) - set(ckpts))
    if missing or "dense" not in ckpts:
        raise SystemExit(f"no kept checkpoint for {missing}: give --retrain to train them again")
    seq_len = load_model(ckpts["dense"])[1].max_seq_len
    # greedy: the model's own text; fed: held-out text's tokens (routers decide on text)
    timed = {
        pre: measure.decode_speeds(ckpts, seq_len, data, fed=bool(pre)) for pre in ("", "fed_")
    }
    rows = []
    for fam, ckpt in ckpts.items():
        row: dict[str, Any] = {"name": fam, "run": ckpt.name}
        for pre, speeds in timed.items():
            row.update({pre + k: v for k, v in speeds[fam].items()})
            for b in measure.DECODE_BATCHES:
                key = f"decode_tok_s_b{b}"
                row[f"{pre}speedup_b{b}"] = speeds[fam][key] / speeds["dense"][key]
        row.update(measure.measure_run(ckpt, seq_len, data))
        rows.append(row)
    path.write_text("".join(json_text(r) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.round4.measure", description=__doc__)
    ap.add_argument("--kept", required=True, help="the kept checkpoints (<work>-kept)")
    ap.add_argument("--out", default=str(HERE), help="the study's results (default: its folder)")
    ap.add_argument("--data", default=None, help="the corpus the runs trained on (default: stdlib)")
    ap.add_argument("--skip-decode", action="store_true", help="the probes only")
    ap.add_argument(
        "--retrain", metavar="WORK", default=None,
        help="train each best run whose kept model is gone again, in WORK (its loss must be "
        "its row's), and keep it",
    )  # fmt: skip
    ap.add_argument(
        "--runs", default=None, metavar="NAMES",
        help="comma-separated runs to train again (default: each family's best, findings.json)",
    )  # fmt: skip
    ap.add_argument(
        "--retrain-only", action="store_true",
        help=f"stop after training again (run it under the library of {TRAINED_AT})",
    )  # fmt: skip
    ap.add_argument(
        "--workers", type=int, default=2,
        help="runs trained again at once, each on one thread (default: %(default)s)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.workers < 1:
        raise SystemExit(f"--workers must be at least 1, got {args.workers}")
    out, kept = Path(args.out), Path(args.kept)
    for flag, given in (("--retrain-only", args.retrain_only), ("--runs", args.runs)):
        if given and not args.retrain:
            raise SystemExit(f"{flag} needs --retrain WORK")
    if args.retrain:
        names = args.runs.split(",") if args.runs else list(stand_ins(out, kept).values())
        print(f"training {len(names)} run(s) again with {mixture_of_depths.__file__}")
        retrain(names, out, kept, Path(args.retrain), args.data, workers=args.workers)
        if args.retrain_only:
            return 0
    probe_all(kept, out, args.data)
    if not args.skip_decode:
        decode_all(kept, out, args.data)
    results = load_results(out / "results.jsonl")
    STUDY.report(results, out, STUDY.settings(False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
