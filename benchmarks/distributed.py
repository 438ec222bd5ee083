"""Training tokens/s on 1 and more local processes (torchrun, DDP or FSDP2), beside the bytes each
rank must move per step.

Each process count trains the same global batch for a few steps; tokens/s is the median of the
logged windows after the first (which holds start-up). The communication per step follows from
the parameter count P and the bytes per element b (ring collectives, per rank): DDP all-reduces
the gradients, 2 (n-1)/n P b; FSDP2 all-gathers the weights for the forward and again for the
backward and reduce-scatters the gradients, 3 (n-1)/n P b. On this CPU machine the ranks share
its cores and talk over gloo (loopback TCP), so the figure is bound by both: it shows that the
job runs and what it costs here, not what a GPU cluster does (README, "Distributed training").

    python benchmarks/distributed.py                       # preset tiny, 1 and 2 processes
    python benchmarks/distributed.py --parallel fsdp --preset small --steps 20

The last line printed is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--procs", default="1,2", help="process counts (default: %(default)s)")
    p.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=8, help="the global batch")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--data", default=None, help="text file or folder (default: the stdlib)")
    args = p.parse_args(argv)
    args.procs = [int(v) for v in args.procs.split(",") if v.strip()]
    if not args.procs or min(args.procs) < 1 or args.steps < 4:
        p.error("--procs must be positive integers and --steps at least 4")
    if any(args.batch_size % n for n in args.procs):
        p.error(f"--batch-size {args.batch_size} must split over each of {args.procs} processes")
    return args


def run(args: argparse.Namespace, n: int, out: Path) -> float:
    """Train on `n` processes; the median logged tokens/s after the first window."""
    log_every = max(1, args.steps // 4)
    train = [
        "-m", "mixture_of_depths", "train", "--preset", args.preset, "--steps", str(args.steps),
        "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
        "--eval-every", str(args.steps), "--eval-batches", "1", "--log-every", str(log_every),
        "--out", str(out), "--overwrite", "--no-progress", "--parallel", args.parallel,
    ]  # fmt: skip
    if args.data:
        train += ["--data", args.data]
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))}
    cmd = [sys.executable, *launch, *train]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{n} process(es) failed:\n{proc.stderr[-3000:]}")
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in lines if "tokens_per_s" in r]
    return statistics.median(speeds[1:] or speeds)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    from mixture_of_depths import MoDConfig, MoDTransformer

    with torch.device("meta"):
        params = MoDTransformer(MoDConfig.preset(args.preset)).num_params()
    per = {"ddp": 2, "fsdp": 3}[args.parallel]  # ring passes of the whole model per step
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.procs:
            tok_s = run(args, n, Path(tmp) / f"n{n}")
            comm = per * (n - 1) / n * params * 4  # float32 bytes per rank per step
            rows.append({"processes": n, "tokens_per_s": tok_s, "comm_bytes_per_rank": comm})
    base = rows[0]["tokens_per_s"]
    print(
        f"{args.parallel}: preset {args.preset} ({params / 1e6:.2f}M parameters), global batch "
        f"{args.batch_size} x {args.seq_len}, {args.steps} steps, {os.cpu_count()} CPU cores, gloo"
    )
    print(f"{'procs':>5} {'tokens/s':>10} {'vs 1st':>7} {'MB moved per rank per step':>27}")
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base
        print(
            f"{r['processes']:>5} {r['tokens_per_s']:>10,.0f} {r['speedup']:>6.2f}x "
            f"{r['comm_bytes_per_rank'] / 1e6:>27.2f}"
        )
    result = {"settings": {k: v for k, v in vars(args).items()}, "params": params, "rows": rows}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
