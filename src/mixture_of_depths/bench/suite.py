"""`mod bench`: MoD against its dense twin, side by side in one run, each ratio beside FLOPs.

Sections (``--sections``, all by default):

- ``train``: a training step (forward + backward; the optimizer step costs the same for both and
  is not in the FLOP count) of the dense twin and of the routed model (every other block, top-k)
  at each capacity, at each sequence length, with the same number of tokens per step
  (``--tokens``). Speed-up over dense beside the FLOP-predicted one
  (`FlopReport.train_causal`: attention over the causal half, as SDPA's causal kernels compute
  it) and their quotient, the efficiency. Capacity 1.0 does the dense work plus routing: its
  excess over dense is the routing overhead.
- ``block``: one routed block against one dense block on the same input, forward and
  forward + backward, at each capacity and length.
- ``memory``: a training step's peak memory and saved activations, MoD against dense, each
  measured in a fresh process (`bench.memory`).
- ``decode``: decoding tokens/s and KV cache at batch 1, 8, 16 and 64 (`bench.decode`;
  ``--decode-batch-sizes``): 16 and 64 are the serving batch sizes the serving benchmark
  (benchmarks/serve.py) reads the model's own ratio at.
- ``compile``: eager against ``torch.compile(fullgraph=True)`` training steps of the dense twin
  and the MoD model at one length.
- ``experts``: an expert layer against the dense MLP (forward + backward), and MoE / MoDE
  training steps against the dense twin, at equal active parameters (`bench.moe`).

Timing: within a section and length, every model runs one step per round and the order rotates
every round, so drift and other processes hit all alike; the median over rounds is reported. The
machine may be shared, so only ratios measured in the same run mean anything. The last line
printed is one JSON object with every number.

    mod bench                                  # preset small, everything (~5 min on 2 cores)
    mod bench --sections train --seq-lens 1024 --capacities 0.125
    mod bench --preset tiny --seq-lens 64 --tokens 256 --repeats 1 --warmup 1   # a smoke run
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from ..config import MoDConfig
from .common import cpu_snapshot, others_busy
from .moe import bench_layers, bench_models
from .report import bars, print_report, print_settings
from .sections import (
    bench_block,
    bench_compile,
    bench_decode,
    bench_memory,
    bench_profile,
    bench_train,
)

SECTIONS = ("train", "block", "memory", "decode", "compile", "experts", "profile")
DEFAULT_SECTIONS = SECTIONS[:-1]  # "profile" on request: where the time of a step goes


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`mod bench`'s flags, on `p` (the subcommand's parser or `main`'s)."""
    p.add_argument("--preset", default="small", help="MoDConfig preset (default: %(default)s)")
    p.add_argument(
        "--sections",
        default=",".join(DEFAULT_SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all but profile)",
    )
    p.add_argument(
        "--capacities",
        default="1.0,0.5,0.25,0.125",
        help="capacities of the routed models (default: %(default)s)",
    )
    p.add_argument(
        "--seq-lens", default="256,1024,2048", help="sequence lengths (default: %(default)s)"
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=4096,
        help="tokens per training step; batch = tokens // seq_len (default: %(default)s)",
    )
    p.add_argument(
        "--layer-pattern", default="DR", help="pattern of the routed models (default: DR)"
    )
    p.add_argument(
        "--skipped-kv",
        choices=("none", "residual"),
        default="none",
        help="KV strategy of the routed models (docs/semantics.md; default: %(default)s)",
    )
    p.add_argument(
        "--decode-batch-sizes",
        default="1,8,16,64",
        help="batch sizes of the decode section: 16 and 64 are `mod serve --max-rows` sizes, "
        "so benchmarks/serve.py can set the server's MoD/dense ratio beside the model's own "
        "(default: %(default)s)",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds (default: %(default)s)")
    p.add_argument(
        "--compile-seq-len",
        type=int,
        default=None,
        help="length of the compile section (default: the middle of --seq-lens)",
    )
    p.add_argument(
        "--device", default=None, help="torch device (default: cuda if available, else cpu)"
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="training runs under autocast in bfloat16 (default: bfloat16 on cuda, float32 on cpu)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and inputs (default: 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def check_args(args: argparse.Namespace) -> argparse.Namespace:
    """Parse the list flags and validate; raises ValueError naming the bad value."""
    sections = [s.strip() for s in str(args.sections).split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad or not sections:
        raise ValueError(f"--sections {args.sections!r}: choose from {', '.join(SECTIONS)}")
    args.sections = sections
    try:
        args.capacities = _floats(str(args.capacities))
        args.seq_lens = _ints(str(args.seq_lens))
        args.decode_batch_sizes = _ints(str(args.decode_batch_sizes))
    except ValueError as exc:
        raise ValueError(
            "--capacities / --seq-lens / --decode-batch-sizes must be comma-separated numbers: "
            f"{exc}"
        ) from None
    if not args.decode_batch_sizes or min(args.decode_batch_sizes) < 1:
        raise ValueError(f"--decode-batch-sizes {args.decode_batch_sizes} must be integers >= 1")
    if not args.capacities or any(not 0 < c <= 1 for c in args.capacities):
        raise ValueError(f"--capacities {args.capacities} must be in (0, 1]")
    if not args.seq_lens or min(args.seq_lens) < 2:
        raise ValueError(f"--seq-lens {args.seq_lens} must be integers >= 2")
    if args.tokens < max(args.seq_lens):
        raise ValueError(
            f"--tokens {args.tokens} must be at least the longest sequence ({max(args.seq_lens)})"
        )
    if args.repeats < 1 or args.warmup < 0:
        raise ValueError(f"--repeats {args.repeats} must be >= 1, --warmup {args.warmup} >= 0")
    if "R" not in args.layer_pattern.upper():
        raise ValueError(f"--layer-pattern {args.layer_pattern!r} has no routed block 'R'")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.dtype is None:
        args.dtype = "bfloat16" if torch.device(args.device).type == "cuda" else "float32"
    if args.compile_seq_len is None:
        args.compile_seq_len = sorted(args.seq_lens)[len(args.seq_lens) // 2]
    if not 2 <= args.compile_seq_len <= args.tokens:
        raise ValueError(
            f"--compile-seq-len {args.compile_seq_len} must be in [2, --tokens={args.tokens}]"
        )
    labels = [f"c={c:g}" for c in args.capacities]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--capacities {args.capacities} has duplicates (as labelled: {labels})")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads {args.threads} must be >= 1")
    MoDConfig.preset(args.preset)  # unknown preset: a clear error now, not after minutes
    return args


def progress_steps(args: argparse.Namespace) -> int:
    """Timed and untimed calls the progress bar counts (decode and profile are not counted)."""
    n_models = len(args.capacities) + 1
    rounds = args.warmup + args.repeats
    total = 0
    for s in args.sections:
        total += {
            "train": n_models * rounds * len(args.seq_lens),
            "block": 2 * n_models * rounds * len(args.seq_lens),
            "memory": n_models * len(args.seq_lens),
            "compile": 4 * rounds,
            "experts": (7 + 5) * rounds * len(args.seq_lens),
        }.get(s, 0)
    return total


def measure_section(
    section: str, args: argparse.Namespace, device: torch.device, sync: Callable, bar: tqdm
) -> dict[str, Any]:
    """The result entries of one section: its rows under its name (experts has two tables)."""
    if section == "experts":
        return {
            "experts_layer": bench_layers(args, device, sync, bar),
            "experts_model": bench_models(args, device, sync, bar),
        }
    if section == "memory":
        return {"memory": bench_memory(args, bar)}
    if section == "profile":
        return {"profile": bench_profile(args, device, sync)}
    if section == "decode":
        bar.clear()  # decode prints its own report while the bar is up
        return {"decode": bench_decode(args)}
    bench = {"train": bench_train, "block": bench_block, "compile": bench_compile}[section]
    return {section: bench(args, device, sync, bar)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Check the flags, measure every section, print the report; the result is the JSON line."""
    args = check_args(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print_settings(args, device)
    result: dict[str, Any] = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    }
    snapshot, t0 = cpu_snapshot(), time.perf_counter()
    total = progress_steps(args)
    with tqdm(total=total, desc="bench", unit="step", disable=args.no_progress, leave=False) as bar:
        for section in args.sections:
            result.update(measure_section(section, args, device, sync, bar))
    busy = others_busy(snapshot, cpu_snapshot())
    result["wall_s"] = time.perf_counter() - t0
    result["cpu_busy_others"] = busy
    result["bars"] = bars(result)
    print_report(result, device)
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """`mod bench` as a script (``benchmarks/bench.py``): parse `argv`, run, exit 2 on bad flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        p.error(str(exc))
        raise


if __name__ == "__main__":
    main()
