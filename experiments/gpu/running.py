"""The GPU plan's run: the corpus prepared, the timing pass, the plan chosen from it, the runs
at once, the report; every part in processes under a hard timeout, all of it inside
``--minutes``; the last line printed is JSON."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mixture_of_depths.fileio import atomic_write_text, json_text
from mixture_of_depths.studies.runner import load_results

from . import parts
from .planning import (
    DRY,
    FOLDERS,
    FULL,
    Choice,
    GpuSettings,
    Timing,
    choose,
    describe,
    spec_of,
    specs,
    tag_of,
    tokens_of,
)
from .report import write_report


@dataclass(frozen=True)
class Clock:
    """The part's hard timeouts, in seconds (the dry run's are shorter)."""

    prepare: float
    startup: float  # the timing processes start their timed window this long after launch
    window: float  # the timed window: training steps, then evaluation forwards
    timing: float  # the timing pass's hard timeout, from launch
    grace: float  # after a SIGTERM (a run saves a checkpoint), before a SIGKILL
    report: float  # kept for the report at the end


CLOCK = Clock(prepare=150, startup=16, window=16, timing=60, grace=20, report=15)
DRY_CLOCK = Clock(prepare=60, startup=8, window=3, timing=50, grace=10, report=5)


def child(part: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "experiments.gpu", "--part", part, *args]


def child_env(dry: bool, one_core: bool = True) -> dict[str, str]:
    """A part's environment: one thread each where many run at once (the prepare part alone
    keeps the tokenizer's threads); the dry run on the CPU."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # the parts import this study as `experiments.gpu`: the repository root goes on their path
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    if one_core:
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if dry:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run: every part on the CPU
    return env


class Stopped:
    """A SIGTERM or SIGINT of this process, noted: the parts running get theirs, and the plan
    writes its report with what finished."""

    def __init__(self) -> None:
        self.signum = 0

    def __call__(self, signum: int, frame: object) -> None:
        self.signum = signum


def run_all(
    cmds: dict[str, list[str]], logs: Path, seconds: float, grace: float, env: dict[str, str],
    stopped: Stopped,
) -> dict[str, str]:  # fmt: skip
    """Start every command at once (output to ``<logs>/<name>.log``); after `seconds` (or a
    signal of this process), SIGTERM those still running, and SIGKILL them `grace` seconds
    later. Returns, per name, "ok", "exit N", "timed out" or "not started" (this process was
    stopped before)."""
    if stopped.signum:
        return dict.fromkeys(cmds, "not started")
    logs.mkdir(parents=True, exist_ok=True)
    procs = {}
    for name, cmd in cmds.items():
        with (logs / f"{name}.log").open("w") as log:
            procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    end = time.monotonic() + max(0.0, seconds)
    termed: set[str] = set()
    while any(p.poll() is None for p in procs.values()):
        now = time.monotonic()
        if (now >= end or stopped.signum) and not termed:
            termed = {n for n, p in procs.items() if p.poll() is None}
            for n in termed:
                procs[n].send_signal(signal.SIGTERM)
            end = now + grace
        elif termed and now >= end:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
        time.sleep(0.2)
    return {n: ("ok" if p.returncode == 0 else "timed out" if n in termed else
                f"exit {p.returncode}") for n, p in procs.items()}  # fmt: skip


def log_tail(logs: Path, name: str, lines: int = 12) -> str:
    path = logs / f"{name}.log"
    return "\n".join(path.read_text().splitlines()[-lines:]) if path.exists() else ""


def prepare(args: argparse.Namespace, work: Path, clock: Clock, stopped: Stopped) -> dict:
    """The corpus's size, the tokenizer and token cache made once (in a process, timed out)."""
    out = work / "corpus.json"
    cmd = child("prepare", "--result", str(out), *data_args(args))
    seconds = min(clock.prepare, args.deadline - time.monotonic())
    status = run_all({"prepare": cmd}, work / "logs", seconds, clock.grace,
                     child_env(args.dry_run, one_core=False), stopped)  # fmt: skip
    if status["prepare"] != "ok":
        raise RuntimeError(f"preparing the corpus: {status['prepare']}\n"
                           + log_tail(work / "logs", "prepare"))  # fmt: skip
    return json.loads(out.read_text())


def data_args(args: argparse.Namespace) -> list[str]:
    return (["--data", args.data] if args.data else []) + (["--dry-run"] if args.dry_run else [])


def timing_pass(
    args: argparse.Namespace, s: GpuSettings, corpus: dict, work: Path, clock: Clock,
    stopped: Stopped,
) -> dict[str, Timing]:  # fmt: skip
    """Every run of every tier started at once, each timing its arm's steps in the same window
    of wall time: per arm, the slowest of its processes, at that concurrency."""
    runs = specs(s, 1.0, corpus["vocab_size"])
    folder = work / "timing"
    folder.mkdir(parents=True, exist_ok=True)
    launched = time.time()
    cmds = {}
    for sp in runs:
        job = folder / f"{sp.name}.job.json"
        parts.write_job(job, sp, {})
        cmds[f"time-{sp.name}"] = child(
            "time", "--job", str(job), "--result", str(folder / f"{sp.name}.json"),
            "--launched", repr(launched), "--start-at", repr(launched + clock.startup),
            "--seconds", repr(clock.window), *data_args(args),
        )  # fmt: skip
    seconds = min(clock.timing, args.deadline - time.monotonic())
    status = run_all(cmds, work / "logs", seconds, clock.grace, child_env(args.dry_run),
                     stopped)  # fmt: skip
    measured: dict[str, list[dict]] = {}
    for sp in runs:
        path = folder / f"{sp.name}.json"
        if status[f"time-{sp.name}"] == "ok" and path.exists():
            measured.setdefault(tag_of(sp), []).append(json.loads(path.read_text()))
        else:
            print(f"timing {sp.name}: {status[f'time-{sp.name}']}\n"
                  + log_tail(work / "logs", f"time-{sp.name}"), flush=True)  # fmt: skip
    return {
        tag: Timing(
            step_s=max(r["step_s"] for r in rows),
            forward_s=max(r["forward_s"] for r in rows),
            startup_s=max(r["startup_s"] for r in rows),
            concurrency=len(runs),
        )
        for tag, rows in measured.items()
    }


def plan_record(s: GpuSettings, c: Choice, timings: dict[str, Timing], corpus: dict) -> dict:
    g, dense = s.round3.grid, spec_of(s, "dense", 0, FULL.round3.budget, corpus["vocab_size"])
    return {
        "budget": c.budget,
        "seq_len": g.seq_len,
        "batch_size": g.batch_size,
        # what the CPU round's budget (1.5e14) has dense XS read, in epochs of this corpus
        "cpu_round_epochs": tokens_of(FULL, dense) / corpus["train_tokens"],
        "limit": c.limit,
        "tiers": c.tiers,
        "runs": [sp.name for sp in c.specs],
        "predicted_s": c.predicted_s,
        "corpus_budget": c.corpus_budget,
        "corpus": corpus,
        "timings": {tag: t.__dict__ for tag, t in timings.items()},
        "device": "cpu" if s is DRY else parts.device_name(),
        "dry_run": s is DRY,
    }


def the_plan(
    args: argparse.Namespace, s: GpuSettings, out: Path, work: Path, clock: Clock,
    deadline: float, stopped: Stopped,
) -> dict[str, Any]:  # fmt: skip
    """The plan in ``<out>/plan.json`` (a rerun resumes it: the same budget and runs), or a
    new one from the corpus and a timing pass."""
    path = out / "plan.json"
    if path.exists():
        plan = json.loads(path.read_text())
        if plan["dry_run"] != args.dry_run:
            raise ValueError(f"{path} is a {'dry' if plan['dry_run'] else 'full'} run's plan: "
                             "use another --out, or delete it to plan anew")  # fmt: skip
        print(f"resuming {path}: budget {plan['budget']:.2g}, {len(plan['runs'])} runs",
              flush=True)  # fmt: skip
        corpus = prepare(args, work, clock, stopped)  # the token cache, on a fresh machine
        if corpus["train_tokens"] != plan["corpus"]["train_tokens"]:
            raise ValueError(
                f"{path} was made on a corpus of {plan['corpus']['train_tokens']:,} training "
                f"tokens (Python {plan['corpus']['python']}); this one has "
                f"{corpus['train_tokens']:,} (Python {corpus['python']}): resume where it "
                "started, or move the results away to plan anew"
            )
        return plan
    corpus = prepare(args, work, clock, stopped)
    print(
        f"corpus: {corpus['train_tokens']:,} training tokens, {corpus['val_tokens']:,} held "
        f"out (BPE, {corpus['vocab_size']}), in {corpus['prepare_s']:.0f} s",
        flush=True,
    )
    n = len(specs(s, 1.0, corpus["vocab_size"]))
    print(f"-- timing pass: {n} processes at once, at most "
          f"{clock.timing:.0f} s", flush=True)  # fmt: skip
    timings = timing_pass(args, s, corpus, work, clock, stopped)
    for tag, t in timings.items():
        print(f"  {tag}: {t.step_s * 1e3:.1f} ms a step, {t.forward_s * 1e3:.1f} ms a forward, "
              f"start {t.startup_s:.0f} s", flush=True)  # fmt: skip
    seconds = deadline - time.monotonic() - clock.report - clock.grace
    c = choose(s, timings, corpus["train_tokens"], corpus["vocab_size"], seconds)
    plan = plan_record(s, c, timings, corpus)
    plan["seconds_for_runs"] = seconds
    atomic_write_text(path, json_text(plan, indent=1) + "\n")
    return plan


def train_all(
    args: argparse.Namespace, s: GpuSettings, plan: dict, out: Path, work: Path, clock: Clock,
    deadline: float, stopped: Stopped,
) -> dict[str, str]:  # fmt: skip
    """The plan's runs not yet in the results, all at once, until the deadline."""
    runs = specs(s, plan["budget"], plan["corpus"]["vocab_size"], plan["tiers"])
    done = {r["name"] for r in load_results(out / "results.jsonl")}
    pending = [sp for sp in runs if sp.name not in done]
    extra = {"gpu_plan": True, "budget_limit": plan["limit"], "concurrency": len(pending),
             "corpus_train_tokens": plan["corpus"]["train_tokens"]}  # fmt: skip
    cmds = {}
    for sp in pending:
        job = work / "jobs" / f"{sp.name}.json"
        job.parent.mkdir(parents=True, exist_ok=True)
        parts.write_job(job, sp, extra)
        cmds[sp.name] = child("run", "--job", str(job), "--out", str(out), "--work", str(work),
                              *data_args(args))  # fmt: skip
    seconds = deadline - time.monotonic() - clock.report - clock.grace
    print(f"-- {len(pending)} runs at once ({len(done)} done before), at most {seconds:.0f} s",
          flush=True)  # fmt: skip
    status = run_all(cmds, work / "logs", seconds, clock.grace, child_env(args.dry_run), stopped)
    for name, st in status.items():
        if st != "ok":
            print(f"{name}: {st}\n{log_tail(work / 'logs', name)}", flush=True)
    return status


def run_part(args: argparse.Namespace) -> int:
    """One part, in its own process (`running` starts them)."""
    s = DRY if args.dry_run else FULL
    if args.part == "prepare":
        parts.prepare(args.data, Path(args.result))
    elif args.part == "time":
        spec = parts.RunSpec(**parts.read_job(Path(args.job))["spec"])
        parts.time_arm(s, spec, args.data, args.launched, args.start_at, args.seconds,
                       Path(args.result))  # fmt: skip
    else:
        row = parts.train_run(s, parts.read_job(Path(args.job)), Path(args.out), Path(args.work),
                              args.data)  # fmt: skip
        print(f"{row['name']}: causal {row['val_loss_causal']:.4f}, {row['wall_s']:.0f} s")
    return 0


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.gpu",
        description="Round 3's deciding arms on one GPU, inside a lease's minutes.",
    )
    ap.add_argument(
        "--out", default=None, help="results (default: this study's folder; --dry-run: its quick/)"
    )
    ap.add_argument(
        "--work", default=None, help="run folders (default: runs/ in the results folder)"
    )
    ap.add_argument("--minutes", type=float, default=8.0, help="wall time for all of it")
    ap.add_argument("--data", default=None, help="corpus folder (default: Python's stdlib)")
    ap.add_argument("--dry-run", action="store_true", help="every part on the CPU, tiny")
    for hidden in ("--part", "--job", "--result"):
        ap.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    for hidden in ("--launched", "--start-at", "--seconds"):
        ap.add_argument(hidden, type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.minutes <= 0:
        ap.error(f"--minutes must be positive, got {args.minutes}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.part:
        return run_part(args)
    if not torch.cuda.is_available() and not args.dry_run:
        print("no CUDA GPU here (torch.cuda.is_available() is False): nothing was run")
        print(json.dumps({"gpu": False, "torch": torch.__version__}))
        return 0
    s, clock = (DRY, DRY_CLOCK) if args.dry_run else (FULL, CLOCK)
    out = Path(args.out or FOLDERS.out_for(args.dry_run))
    work = Path(args.work or FOLDERS.work_for(args.dry_run))
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    deadline = args.deadline = t0 + 60 * args.minutes  # every part ends before it
    stopped = Stopped()
    previous = {sig: signal.signal(sig, stopped) for sig in (signal.SIGTERM, signal.SIGINT)}
    gpu = torch.cuda.is_available() and not args.dry_run  # the dry run's parts: on the CPU
    result: dict[str, Any] = {"gpu": gpu, "device": parts.device_name() if gpu else "cpu",
                              "dry_run": args.dry_run, "out": str(out)}  # fmt: skip
    try:
        plan = the_plan(args, s, out, work, clock, deadline, stopped)
        print("\n".join(describe_plan(s, plan)), flush=True)
        status = train_all(args, s, plan, out, work, clock, deadline, stopped)
        result.update(summary(s, plan, status, out))
    except (RuntimeError, ValueError) as exc:
        result["error"] = str(exc)
        print(f"error: {exc}", file=sys.stderr)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if "budget" in result:
        write_report(load_results(out / "results.jsonl"), out, plan)
    result["wall_s"] = time.monotonic() - t0
    if stopped.signum:
        result["stopped_by"] = signal.Signals(stopped.signum).name
    print(json.dumps(result))
    return 1 if "error" in result else 0


def describe_plan(s: GpuSettings, plan: dict) -> list[str]:
    runs = specs(s, plan["budget"], plan["corpus"]["vocab_size"], plan["tiers"])
    c = Choice(plan["budget"], plan["limit"], plan["tiers"], tuple(runs), plan["predicted_s"],
               plan["corpus_budget"])  # fmt: skip
    lines = describe(s, c, plan["corpus"]["train_tokens"])
    measured = max(t["concurrency"] for t in plan["timings"].values())
    if len(runs) < measured:
        lines.append(f"(timed with {measured} processes at once; {len(runs)} run: their step "
                     "times are taken as that share of the measured ones)")  # fmt: skip
    return lines


def summary(s: GpuSettings, plan: dict, status: dict[str, str], out: Path) -> dict[str, Any]:
    """The final JSON's numbers: the plan, what finished, and each arm's mean causal loss."""
    rows = [r for r in load_results(out / "results.jsonl") if r["name"] in set(plan["runs"])]
    by_arm: dict[str, list[float]] = {}
    for r in rows:
        by_arm.setdefault(r["label"], []).append(r["val_loss_causal"])
    return {
        "budget": plan["budget"],
        "limit": plan["limit"],
        "corpus_train_tokens": plan["corpus"]["train_tokens"],
        "runs_done": len(rows),
        "runs_planned": len(plan["runs"]),
        "not_finished": {n: st for n, st in status.items() if st != "ok"},
        "arms": {
            lab: {"mean": sum(v) / len(v), "spread": max(v) - min(v), "seeds": len(v)}
            for lab, v in by_arm.items()
        },  # fmt: skip
    }
