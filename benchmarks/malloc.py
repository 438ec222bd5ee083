"""Training speed with `mod`'s malloc setting (freed memory kept for reuse) against glibc's
default, on a BPE-sized model: each arm is a fresh process, the arms alternate, and each round
times the same seeded steps. Reports tokens/s, page faults and kernel time per step, the
speed ratio, and ends with one line of JSON. See `mixture_of_depths.runtime.malloc` for why.

    python benchmarks/malloc.py                  # the study's ctx1024 shape: 4 x 1024, vocab 4096
    python benchmarks/malloc.py --seq-len 256 --batch-size 16
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from mixture_of_depths import MoDConfig, MoDTransformer
from mixture_of_depths.runtime.malloc import ENV, keep_freed_memory, user_malloc_settings

ARMS = ("default", "kept")


def child(args: argparse.Namespace) -> dict:
    """One arm in this process: optionally keep freed memory, then time `steps` training steps."""
    applied = keep_freed_memory() if args.child == "kept" else False
    torch.manual_seed(args.seed)
    cfg = MoDConfig(
        vocab_size=args.vocab, d_model=args.d_model, n_layers=args.n_layers,
        n_heads=args.n_heads, max_seq_len=args.seq_len, layer_pattern="DR", capacity=0.125,
    )  # fmt: skip
    model = MoDTransformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(args.seed)
    data = torch.randint(0, args.vocab, (args.batch_size, args.seq_len + 1), generator=gen)

    def step() -> None:
        loss = model(data[:, :-1], data[:, 1:], routing="topk").loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    t0, r0, f0 = time.perf_counter(), os.times(), resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(args.steps):
        step()
    t1, r1, f1 = time.perf_counter(), os.times(), resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.user - r0.user) + (r1.system - r0.system)
    return {
        "arm": args.child,
        "applied": applied,
        "tokens_per_s": args.steps * args.batch_size * args.seq_len / (t1 - t0),
        "faults_per_step": (f1.ru_minflt - f0.ru_minflt) / args.steps,
        "kernel_share": (r1.system - r0.system) / cpu if cpu > 0 else 0.0,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=20, help="timed steps per process")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--rounds", type=int, default=3, help="processes per arm, alternating")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("vocab", "d_model", "n_layers", "n_heads", "seq_len", "batch_size", "steps",
                 "rounds"):  # fmt: skip
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.child:
        out = child(args)
        print(json.dumps(out))
        return out

    # the arms' own settings decide, not the caller's: clear any malloc tuning from the env
    drop = {ENV, *user_malloc_settings(os.environ)}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    argv = list(argv if argv is not None else sys.argv[1:])
    runs: dict[str, list[dict]] = {a: [] for a in ARMS}
    for rnd in range(args.rounds):
        for arm in ARMS if rnd % 2 == 0 else ARMS[::-1]:
            proc = subprocess.run(
                [sys.executable, __file__, *argv, "--child", arm],
                env=env, capture_output=True, text=True, check=False,
            )  # fmt: skip
            if proc.returncode != 0:
                raise SystemExit(f"the {arm} arm failed:\n{proc.stderr[-2000:]}")
            runs[arm].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"round {rnd + 1}/{args.rounds} {arm:>7}: "
                  f"{runs[arm][-1]['tokens_per_s']:,.0f} tokens/s", file=sys.stderr)  # fmt: skip

    keys = ("tokens_per_s", "faults_per_step", "kernel_share")
    med = {a: {k: statistics.median(r[k] for r in runs[a]) for k in keys} for a in ARMS}
    ratio = med["kept"]["tokens_per_s"] / med["default"]["tokens_per_s"]
    logits = args.batch_size * args.seq_len * args.vocab * 4
    print(f"{args.batch_size} x {args.seq_len} tokens, vocab {args.vocab} "
          f"(logits {logits / 2**20:.0f} MiB), d_model {args.d_model}, {args.n_layers} layers; "
          f"median of {args.rounds} processes per arm, {args.steps} steps each")  # fmt: skip
    print(f"{'arm':>8} {'tokens/s':>10} {'faults/step':>12} {'kernel time':>12}")
    for a in ARMS:
        m = med[a]
        print(f"{a:>8} {m['tokens_per_s']:>10,.0f} {m['faults_per_step']:>12,.0f} "
              f"{m['kernel_share']:>11.1%}")  # fmt: skip
    print(f"kept / default speed: {ratio:.2f}x")
    out = {
        "settings": {k: v for k, v in vars(args).items() if k != "child"},
        "median": med,
        "speedup": ratio,
        "applied": all(r["applied"] for r in runs["kept"]),
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
