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
    python benchmarks/distributed.py --nccl                # arithmetic only: GPUs on NCCL

``--nccl`` measures nothing: it works out what to expect on GPUs from the FLOP accounting and
stated hardware figures (``--peak-tflops``, ``--mfu``, ``--nvlink-gbs``, ``--network-gbs``),
for a MoD model and its dense twin: compute time per step, bytes each rank moves, the time that
takes inside a node (NVLink) and across nodes (the network), and the tokens per GPU per step at
which communication takes as long as compute. MoD cuts FLOPs, not parameters, so per token it
moves the same bytes in less compute: it needs more tokens per GPU to stay compute-bound.

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

from mixture_of_depths import MoDConfig, MoDTransformer
from mixture_of_depths.flops import estimate_flops


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--procs", default="1,2", help="process counts (default: %(default)s)")
    p.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=8, help="the global batch")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--data", default=None, help="text file or folder (default: the stdlib)")
    g = p.add_argument_group("--nccl: arithmetic for GPUs (nothing is run)")
    g.add_argument("--nccl", action="store_true", help="print the NCCL estimate instead")
    g.add_argument("--d-model", type=int, default=2048)
    g.add_argument("--n-layers", type=int, default=24)
    g.add_argument("--n-heads", type=int, default=16)
    g.add_argument("--vocab-size", type=int, default=32000)
    g.add_argument("--nccl-seq-len", type=int, default=2048)
    g.add_argument("--tokens-per-gpu", type=int, default=16384, help="per step (all micro-batches)")
    g.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense (H100 SXM)")
    g.add_argument("--mfu", type=float, default=0.4, help="share of peak the step achieves")
    g.add_argument(
        "--nvlink-gbs", type=float, default=360.0, help="NCCL bus bandwidth in a node, GB/s"
    )
    g.add_argument(
        "--network-gbs", type=float, default=45.0, help="NCCL bus bandwidth across nodes, GB/s"
    )
    g.add_argument("--gpus", type=int, default=8, help="ranks in the job")
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


def comm_bytes(params: int, n: int, parallel: str, bytes_per_element: int = 4) -> float:
    """Bytes each rank sends (and receives) per optimizer step, ring collectives: DDP
    all-reduces the gradients once (2 (n-1)/n of them); FSDP2 all-gathers the weights for the
    forward and again for the backward and reduce-scatters the gradients ((n-1)/n each).
    Float32: our weights and gradients are float32 (autocast runs the matmuls in bf16)."""
    passes = {"ddp": 2, "fsdp": 3}[parallel]
    return passes * (n - 1) / n * params * bytes_per_element


def nccl_estimate(args: argparse.Namespace) -> dict:
    T = args.nccl_seq_len
    if args.tokens_per_gpu % T:
        raise SystemExit(f"--tokens-per-gpu {args.tokens_per_gpu} must be a multiple of {T}")
    rows_per_gpu = args.tokens_per_gpu // T
    mod = MoDConfig(
        vocab_size=args.vocab_size, d_model=args.d_model, n_layers=args.n_layers,
        n_heads=args.n_heads, max_seq_len=T,
    )  # fmt: skip
    flops_per_s = args.peak_tflops * 1e12 * args.mfu
    out = {"settings": vars(args), "models": []}
    print(
        f"NCCL estimate (arithmetic, nothing measured): {args.gpus} GPUs at {args.peak_tflops:g} "
        f"TFLOP/s x {args.mfu:.0%} MFU; bus bandwidth {args.nvlink_gbs:g} GB/s in a node, "
        f"{args.network_gbs:g} GB/s across nodes; {args.tokens_per_gpu:,} tokens per GPU per "
        f"step ({rows_per_gpu} x {T})"
    )
    head = f"{'model':<7}{'params':>9}{'GFLOP/token':>12}{'compute ms':>11}"
    for mode in ("ddp", "fsdp"):
        head += f"{mode + ' MB':>9}{'NVLink ms':>10}{'net ms':>8}{'even at tok':>12}"
    print(head)
    for name, cfg in (("MoD", mod), ("dense", mod.dense_twin())):
        with torch.device("meta"):
            params = MoDTransformer(cfg).num_params()
        train = estimate_flops(cfg, T, rows_per_gpu, with_dense=False).train_causal
        per_token = train / args.tokens_per_gpu
        compute_s = train / flops_per_s
        row = {"model": name, "params": params, "train_flops_per_token": per_token,
               "compute_ms": compute_s * 1e3}  # fmt: skip
        line = f"{name:<7}{params / 1e6:>8.0f}M{per_token / 1e9:>12.2f}{compute_s * 1e3:>11.1f}"
        for mode in ("ddp", "fsdp"):
            b = comm_bytes(params, args.gpus, mode)
            nv, net = b / (args.nvlink_gbs * 1e9), b / (args.network_gbs * 1e9)
            # Tokens per GPU per step whose compute takes as long as the network transfer.
            even = net * flops_per_s / per_token
            row[mode] = {"bytes_per_rank": b, "nvlink_ms": nv * 1e3, "network_ms": net * 1e3,
                         "tokens_per_gpu_compute_equals_network": even}  # fmt: skip
            line += f"{b / 1e6:>9.0f}{nv * 1e3:>10.1f}{net * 1e3:>8.1f}{even:>12,.0f}"
        print(line)
        out["models"].append(row)
    m, d = out["models"]
    print(
        f"MoD spends {m['train_flops_per_token'] / d['train_flops_per_token']:.2f}x the dense "
        f"twin's FLOPs per token for {m['params'] / d['params']:.3f}x its bytes moved: its "
        "communication is that much larger a share of a step at the same tokens per GPU."
    )
    print(json.dumps(out))
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.nccl:
        return nccl_estimate(args)
    with torch.device("meta"):
        params = MoDTransformer(MoDConfig.preset(args.preset)).num_params()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.procs:
            tok_s = run(args, n, Path(tmp) / f"n{n}")
            comm = comm_bytes(params, n, args.parallel)
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
    measured = ("preset", "procs", "parallel", "steps", "batch_size", "seq_len", "data")
    result = {"settings": {k: getattr(args, k) for k in measured}, "params": params, "rows": rows}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
