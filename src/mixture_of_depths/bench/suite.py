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
- ``decode``: decoding tokens/s and KV cache at batch 1 and 8 (`bench.decode`).
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
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from ..config import MoDConfig
from ..fileio import json_text
from ..flops import estimate_flops
from ..layers import rope_tables
from ..model import BLOCKS, Block, MoDTransformer, Pass
from ..precision import autocast_for
from ._common import (
    _median_ms,
    _spread,
    _tokens,
    cpu_snapshot,
    fmt_bytes,
    interleaved,
    others_busy,
    train_step_fn,
)
from .memory import MALLOC_ENV
from .moe import bars as expert_bars
from .moe import bench_layers, bench_models

SECTIONS = ("train", "block", "memory", "decode", "compile", "experts", "profile")
DEFAULT_SECTIONS = SECTIONS[:-1]  # "profile" on request: where the time of a step goes
EFFICIENCY_BAR = 0.95  # measured speed-up / FLOP-predicted speed-up, at seq_len >= 1024
EFFICIENCY_MIN_LEN = 1024
CAP1_OVERHEAD_BAR = 0.03  # capacity 1.0 may cost at most this much over dense


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")


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
    except ValueError as exc:
        raise ValueError(
            f"--capacities / --seq-lens must be comma-separated numbers: {exc}"
        ) from None
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


def model_configs(args: argparse.Namespace, seq_len: int) -> dict[str, MoDConfig]:
    """The dense twin and the routed model at each capacity, sized for `seq_len`."""
    max_len = max(seq_len, MoDConfig.preset(args.preset).max_seq_len)
    routed = {
        f"c={c:g}": MoDConfig.preset(
            args.preset,
            max_seq_len=max_len,
            layer_pattern=args.layer_pattern,
            capacity=c,
            skipped_kv=args.skipped_kv,
        )
        for c in args.capacities
    }
    return {"dense": next(iter(routed.values())).dense_twin(), **routed}


def _model(cfg: MoDConfig, args: argparse.Namespace, device: torch.device) -> MoDTransformer:
    torch.manual_seed(args.seed)  # same weights wherever the shapes agree
    return MoDTransformer(cfg).to(device).train()


def _one_block(cfg: MoDConfig, routed: bool) -> MoDConfig:
    """`cfg` cut to a single block, routed or dense."""
    return MoDConfig.from_dict({**cfg.to_dict(), "n_layers": 1, "layer_pattern": "RD"[not routed]})


def _block(cfg: MoDConfig, args: argparse.Namespace, device: torch.device) -> Block:
    torch.manual_seed(args.seed)
    return BLOCKS[cfg.layer_kinds[0]](cfg, 0).to(device).train()


def _block_input(
    cfg: MoDConfig, args: argparse.Namespace, batch: int, seq_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A seeded residual stream (batch, seq_len, d_model) and the rotary tables of its positions."""
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(batch, seq_len, cfg.d_model, generator=gen).to(device)
    cos, sin = rope_tables(cfg.head_dim, seq_len, cfg.rope_theta, device, torch.float32)
    return x, cos, sin


# -- sections -------------------------------------------------------------------------------------
def bench_train(args: argparse.Namespace, device: torch.device, sync: Callable, bar: tqdm) -> list:
    rows = []
    for seq_len in args.seq_lens:
        batch = args.tokens // seq_len
        configs = model_configs(args, seq_len)
        idx, targets = _tokens(args, batch, seq_len, device)
        fns, flops = {}, {}
        for name, cfg in configs.items():
            fns[name] = train_step_fn(_model(cfg, args, device), idx, targets, args.dtype)
            flops[name] = estimate_flops(cfg, seq_len, batch, with_dense=False).train_causal
        bar.set_postfix_str(f"train T={seq_len}")
        times = interleaved(fns, args.warmup, args.repeats, sync, bar)
        dense_ms = _median_ms(times["dense"])
        for name, cfg in configs.items():
            ms = _median_ms(times[name])
            speedup = dense_ms / ms
            predicted = flops["dense"] / flops[name]
            rows.append(
                {
                    "seq_len": seq_len,
                    "batch_size": batch,
                    "model": name,
                    "capacity": None if name == "dense" else cfg.capacity,
                    "capacity_tokens": None if name == "dense" else cfg.capacity_tokens(seq_len),
                    "ms_per_step": ms,
                    "tokens_per_s": batch * seq_len / (ms / 1e3),
                    "gflop_per_step": flops[name] / 1e9,
                    "gflop_per_s": flops[name] / 1e9 / (ms / 1e3),
                    "speedup": speedup,
                    "speedup_flop_predicted": predicted,
                    "efficiency": speedup / predicted,
                    "range_rel": _spread(times[name]),
                }
            )
    return rows


def _block_flops(cfg: MoDConfig, seq_len: int, batch: int) -> tuple[float, float]:
    """(forward, forward + backward) FLOPs of the one block of `cfg`, causal attention."""
    lf = estimate_flops(cfg, seq_len, batch, with_dense=False).layers[0]
    fwd = lf.matmul + lf.attention_causal + lf.router + lf.predictor
    return fwd, 3 * fwd


def _block_fns(
    block: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: str
) -> tuple[Callable[[], None], Callable[[], None]]:
    """One block's forward (no grad) and forward + backward on `x`, in top-k routing."""
    xg = x.clone().requires_grad_(True)
    topk = Pass("topk", cos, sin)

    def fwd() -> None:
        with torch.no_grad(), autocast_for(x.device, dtype):
            block(x, topk)

    def fwd_bwd() -> None:
        with autocast_for(x.device, dtype):
            y, _ = block(xg, topk)
        y.backward(torch.ones_like(y))
        xg.grad = None
        for p in block.parameters():
            p.grad = None

    return fwd, fwd_bwd


def bench_block(args: argparse.Namespace, device: torch.device, sync: Callable, bar: tqdm) -> list:
    rows = []
    for seq_len in args.seq_lens:
        batch = args.tokens // seq_len
        configs = {  # one-block models: a dense block, a routed one per capacity
            name: _one_block(cfg, routed=name != "dense")
            for name, cfg in model_configs(args, seq_len).items()
        }
        x, cos, sin = _block_input(configs["dense"], args, batch, seq_len, device)
        fwd_fns, bwd_fns, flops = {}, {}, {}
        for name, cfg in configs.items():
            flops[name] = _block_flops(cfg, seq_len, batch)
            block = _block(cfg, args, device)
            fwd_fns[name], bwd_fns[name] = _block_fns(block, x, cos, sin, args.dtype)
        bar.set_postfix_str(f"block T={seq_len}")
        for mode, fns, i in (("forward", fwd_fns, 0), ("forward+backward", bwd_fns, 1)):
            times = interleaved(fns, args.warmup, args.repeats, sync, bar)
            dense_ms = _median_ms(times["dense"])
            for name in configs:
                ms = _median_ms(times[name])
                predicted = flops["dense"][i] / flops[name][i]
                rows.append(
                    {
                        "seq_len": seq_len,
                        "batch_size": batch,
                        "mode": mode,
                        "model": name,
                        "ms": ms,
                        "speedup": dense_ms / ms,
                        "speedup_flop_predicted": predicted,
                        "efficiency": dense_ms / ms / predicted,
                        "range_rel": _spread(times[name]),
                    }
                )
    return rows


def _measure_memory(cfg: MoDConfig, batch: int, seq_len: int, device: str, dtype: str) -> dict:
    spec = {
        "config": cfg.to_dict(),
        "batch_size": batch,
        "seq_len": seq_len,
        "device": device,
        "dtype": dtype,
    }
    env = {**os.environ, **MALLOC_ENV, "MOD_BENCH_THREADS": str(torch.get_num_threads())}
    proc = subprocess.run(
        [sys.executable, "-m", "mixture_of_depths.bench.memory", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"memory measurement failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_memory(args: argparse.Namespace, bar: tqdm) -> list:
    rows = []
    for seq_len in args.seq_lens:
        batch = args.tokens // seq_len
        configs = model_configs(args, seq_len)
        got = {}
        for name, cfg in configs.items():
            bar.set_postfix_str(f"memory T={seq_len} {name}")
            got[name] = _measure_memory(cfg, batch, seq_len, args.device, args.dtype)
            bar.update(1)
        dense = got["dense"]
        for name, m in got.items():
            peak_ratio = (
                m["peak_bytes"] / dense["peak_bytes"]
                if m["peak_bytes"] is not None and dense["peak_bytes"]
                else None
            )
            rows.append(
                {
                    "seq_len": seq_len,
                    "batch_size": batch,
                    "model": name,
                    "capacity": None if name == "dense" else configs[name].capacity,
                    **m,
                    "saved_ratio": m["saved_bytes"] / dense["saved_bytes"],
                    "peak_ratio": peak_ratio,
                }
            )
    return rows


def bench_decode(args: argparse.Namespace) -> dict:
    from . import decode

    argv = ["--preset", args.preset, "--batch-sizes", "1,8", "--device", args.device]
    argv += ["--layer-pattern", args.layer_pattern, "--capacity", str(min(args.capacities))]
    argv += ["--skipped-kv", args.skipped_kv]
    if args.preset == "tiny":  # a smoke run: short context
        argv += ["--prompt-len", "16", "--new-tokens", "4", "--repeats", "1"]
    threads = torch.get_num_threads()
    try:
        return decode.main(argv, json_line=False)
    finally:
        torch.set_num_threads(threads)  # decode runs on one CPU thread by default


def bench_compile(
    args: argparse.Namespace, device: torch.device, sync: Callable, bar: tqdm
) -> list:
    seq_len = args.compile_seq_len
    batch = args.tokens // seq_len
    configs = model_configs(args, seq_len)
    keep = {"dense": configs["dense"], "MoD": configs[f"c={min(args.capacities):g}"]}
    idx, targets = _tokens(args, batch, seq_len, device)
    fns, compile_s = {}, {}
    for name, cfg in keep.items():
        model = _model(cfg, args, device)
        fns[f"{name} eager"] = train_step_fn(model, idx, targets, args.dtype)
        compiled = torch.compile(model, fullgraph=True, dynamic=False)
        step = train_step_fn(compiled, idx, targets, args.dtype)
        bar.set_postfix_str(f"compiling {name}")
        t0 = time.perf_counter()
        step()  # compiles the forward and the backward
        sync()
        compile_s[name] = time.perf_counter() - t0
        fns[f"{name} compiled"] = step
    bar.set_postfix_str(f"compile T={seq_len}")
    times = interleaved(fns, args.warmup, args.repeats, sync, bar)
    ms = {name: _median_ms(t) for name, t in times.items()}
    predicted = (
        estimate_flops(keep["dense"], seq_len, batch, with_dense=False).train_causal
        / estimate_flops(keep["MoD"], seq_len, batch, with_dense=False).train_causal
    )
    rows = []
    for name in fns:
        arch, mode = name.split(" ")
        rows.append(
            {
                "seq_len": seq_len,
                "batch_size": batch,
                "model": arch,
                "mode": mode,
                "capacity": keep[arch].capacity if arch == "MoD" else None,
                "ms_per_step": ms[name],
                "tokens_per_s": batch * seq_len / (ms[name] / 1e3),
                "compiled_speedup": ms[f"{arch} eager"] / ms[name],
                "mod_speedup": ms[f"dense {mode}"] / ms[f"MoD {mode}"],
                "speedup_flop_predicted": predicted,
                "compile_s": compile_s[arch] if mode == "compiled" else None,
                "range_rel": _spread(times[name]),
            }
        )
    return rows


def _profile(fn: Callable[[], None], repeats: int, warmup: int, sync: Callable, cuda: bool) -> dict:
    """Self CPU time per op of `repeats` calls of `fn` (the 15 largest), and the wall time per call
    measured without the profiler: their difference is time no op accounts for (dispatch, Python,
    thread wake-ups)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(max(1, warmup)):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    wall = (time.perf_counter() - t0) / repeats
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            fn()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    return {
        "wall_ms": 1e3 * wall,
        "total_ms_per_step": total / 1e3 / repeats,
        "ops": [
            {
                "op": e.key,
                "ms_per_step": e.self_cpu_time_total / 1e3 / repeats,
                "share": e.self_cpu_time_total / total,
                "calls_per_step": e.count / repeats,
            }
            for e in top
        ],
    }


def bench_profile(args: argparse.Namespace, device: torch.device, sync: Callable) -> dict[str, Any]:
    """torch.profiler over training steps of the dense twin and of the routed model at the
    smallest capacity, and over the forward of one dense and one routed block, at the longest
    length: time per op, so a missed bar can be explained."""
    seq_len = max(args.seq_lens)
    batch = args.tokens // seq_len
    configs = model_configs(args, seq_len)
    small = f"c={min(args.capacities):g}"
    keep = {"dense": configs["dense"], small: configs[small]}
    idx, targets = _tokens(args, batch, seq_len, device)
    x, cos, sin = _block_input(configs["dense"], args, batch, seq_len, device)
    cuda = device.type == "cuda"
    out: dict[str, Any] = {"seq_len": seq_len, "batch_size": batch, "models": {}, "blocks": {}}
    for name, cfg in keep.items():
        step = train_step_fn(_model(cfg, args, device), idx, targets, args.dtype)
        out["models"][name] = _profile(step, args.repeats, args.warmup, sync, cuda)
        block = _block(_one_block(cfg, routed=name != "dense"), args, device)
        fwd, _ = _block_fns(block, x, cos, sin, args.dtype)
        out["blocks"][name] = _profile(fwd, 4 * args.repeats, args.warmup, sync, cuda)
    return out


def print_profile(p: dict[str, Any]) -> None:
    for part, what in (("models", "training step"), ("blocks", "one block, forward")):
        print(
            f"\n## Profile, {what}: self CPU time per op and call, T={p['seq_len']}, "
            f"batch {p['batch_size']}"
        )
        runs = p[part]
        names = list(runs)
        ops = {n: {o["op"]: o for o in runs[n]["ops"]} for n in names}
        keys = list(dict.fromkeys(k for n in names for k in ops[n]))
        head = f"{'op':<56}" + "".join(f"{n + ' ms':>12} {'share':>6}" for n in names)
        print(head)
        print("-" * len(head))
        for k in keys:
            cells = ""
            for n in names:
                o = ops[n].get(k)
                cells += (
                    f"{'':>12} {'':>6}"
                    if o is None
                    else f"{o['ms_per_step']:>12.3f} {100 * o['share']:>5.1f}%"
                )
            print(f"{k[:56]:<56}{cells}")
        for label, key in (("all ops (profiled)", "total_ms_per_step"), ("wall time", "wall_ms")):
            print(f"{label:<56}" + "".join(f"{runs[n][key]:>12.3f} {'':>6}" for n in names))
        a, b = names
        print(
            f"{a}/{b}: ops {runs[a]['total_ms_per_step'] / runs[b]['total_ms_per_step']:.2f}x, "
            f"wall {runs[a]['wall_ms'] / runs[b]['wall_ms']:.2f}x"
        )


# -- report ---------------------------------------------------------------------------------------
def _x(v: float) -> str:
    return f"{v:.3f}x"


def _pct(v: float) -> str:
    return f"{100 * v:.1f}%"


# A speed-up over dense beside the FLOP-predicted one, their quotient, and the timing spread.
_SPEED_COLUMNS = [
    ("speed-up", 9, lambda r: _x(r["speedup"])),
    ("FLOP pred.", 10, lambda r: _x(r["speedup_flop_predicted"])),
    ("effic.", 7, lambda r: _pct(r["efficiency"])),
    ("range", 6, lambda r: _pct(r["range_rel"])),
]

# Each table: its title, then (header, width, cell) per column; a cell is a row's key or a
# function of the row. Widths are right-aligned; a negative width left-aligns.
_TABLES: dict[str, tuple[str, list[tuple[str, int, Any]]]] = {
    "train": (
        "Training step (forward + backward), routed model vs its dense twin",
        [
            ("T", 5, "seq_len"),
            ("batch", 5, "batch_size"),
            ("model", -8, "model"),
            ("k", 5, lambda r: "" if r["capacity_tokens"] is None else r["capacity_tokens"]),
            ("ms/step", 9, lambda r: f"{r['ms_per_step']:.1f}"),
            ("tokens/s", 9, lambda r: f"{r['tokens_per_s']:,.0f}"),
            ("GFLOP/s", 8, lambda r: f"{r['gflop_per_s']:.1f}"),
            *_SPEED_COLUMNS,
        ],
    ),
    "block": (
        "One block: routed vs dense, same input",
        [
            ("T", 5, "seq_len"),
            ("mode", -17, "mode"),
            ("model", -8, "model"),
            ("ms", 8, lambda r: f"{r['ms']:.2f}"),
            *_SPEED_COLUMNS,
        ],
    ),
    "memory": (
        "Training-step memory: peak above the parameters, and activations saved",
        [
            ("T", 5, "seq_len"),
            ("batch", 5, "batch_size"),
            ("model", -8, "model"),
            ("peak", 10, lambda r: fmt_bytes(r["peak_bytes"], 1)),
            ("vs dense", 9, lambda r: "-" if r["peak_ratio"] is None else _x(r["peak_ratio"])),
            ("saved", 10, lambda r: fmt_bytes(r["saved_bytes"], 1)),
            ("vs dense", 9, lambda r: _x(r["saved_ratio"])),
        ],
    ),
    "experts_layer": (
        "Expert layer (forward + backward) vs the dense MLP of the same active size, same input",
        [
            ("T", 5, "seq_len"),
            ("layer", -21, "model"),
            ("path", -10, "path"),
            ("real", 6, lambda r: "" if r["expert_share"] is None else _pct(r["expert_share"])),
            ("ms", 8, lambda r: f"{r['ms']:.2f}"),
            *_SPEED_COLUMNS,
        ],
    ),
    "experts_model": (
        "MoE and MoDE training steps vs the dense twin (equal active parameters)",
        [
            ("T", 5, "seq_len"),
            ("batch", 5, "batch_size"),
            ("model", -13, "model"),
            ("real", 6, lambda r: "" if r["expert_share"] is None else _pct(r["expert_share"])),
            ("ms/step", 9, lambda r: f"{r['ms_per_step']:.1f}"),
            ("tokens/s", 9, lambda r: f"{r['tokens_per_s']:,.0f}"),
            *_SPEED_COLUMNS,
        ],
    ),
    "compile": (
        "Eager vs torch.compile(fullgraph=True), training step",
        [
            ("T", 5, "seq_len"),
            ("model", -6, "model"),
            ("mode", -9, "mode"),
            ("ms/step", 9, lambda r: f"{r['ms_per_step']:.1f}"),
            ("tokens/s", 9, lambda r: f"{r['tokens_per_s']:,.0f}"),
            ("vs eager", 9, lambda r: _x(r["compiled_speedup"])),
            ("MoD/dense", 9, lambda r: _x(r["mod_speedup"])),
            ("FLOP pred.", 10, lambda r: _x(r["speedup_flop_predicted"])),
            ("compile s", 9, lambda r: "" if r["compile_s"] is None else f"{r['compile_s']:.0f}"),
        ],
    ),
}


def print_table(section: str, rows: list) -> None:
    """One of `_TABLES`, a line per row."""
    title, columns = _TABLES[section]

    def cell(text: Any, width: int) -> str:
        return f"{text!s:<{-width}}" if width < 0 else f"{text!s:>{width}}"

    print(f"\n## {title}")
    head = " ".join(cell(name, width) for name, width, _ in columns)
    print(head)
    print("-" * len(head))
    for r in rows:
        values = (get(r) if callable(get) else r[get] for _, _, get in columns)
        print(" ".join(cell(v, w) for v, (_, w, _) in zip(values, columns, strict=True)))


def bars(result: dict) -> dict:
    """The bars (docs/semantics.md, "Figures"), each with its measured value and verdict."""
    out: dict[str, Any] = {}
    train = result.get("train") or []
    cap1 = [r for r in train if r["capacity"] == 1.0]
    if cap1:
        worst = max(1 / r["speedup"] - 1 for r in cap1)
        out["cap1_overhead"] = {
            "value": worst,
            "bar": CAP1_OVERHEAD_BAR,
            "pass": worst <= CAP1_OVERHEAD_BAR,
        }
    long = [
        r for r in train if r["capacity"] not in (None, 1.0) and r["seq_len"] >= EFFICIENCY_MIN_LEN
    ]
    if long:
        worst = min(r["efficiency"] for r in long)
        out["efficiency_long"] = {
            "value": worst,
            "bar": EFFICIENCY_BAR,
            "pass": worst >= EFFICIENCY_BAR,
        }
    mem = [r for r in result.get("memory") or [] if r["capacity"] not in (None, 1.0)]
    peaks = [r["peak_ratio"] for r in mem if r["peak_ratio"] is not None]
    if peaks:  # the peak where it could be measured; saved activations always
        out["memory_peak_ratio"] = {"value": max(peaks), "bar": 1.0, "pass": max(peaks) < 1.0}
    if mem:
        worst = max(r["saved_ratio"] for r in mem)
        out["memory_saved_ratio"] = {"value": worst, "bar": 1.0, "pass": worst < 1.0}
    out.update(expert_bars(result.get("experts_layer") or [], EFFICIENCY_MIN_LEN))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    args = check_args(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
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
    print(
        f"mod bench: preset={args.preset} pattern={args.layer_pattern} "
        f"skipped_kv={args.skipped_kv} "
        f"capacities={args.capacities} seq_lens={args.seq_lens} tokens/step={args.tokens} "
        f"device={device.type} dtype={args.dtype} threads={torch.get_num_threads()} "
        f"repeats={args.repeats} warmup={args.warmup} torch={torch.__version__}"
    )
    result: dict[str, Any] = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    }
    snapshot, t0 = cpu_snapshot(), time.perf_counter()
    bar = tqdm(total=total, desc="bench", unit="step", disable=args.no_progress, leave=False)
    with bar:
        for section in args.sections:
            if section == "train":
                result["train"] = bench_train(args, device, sync, bar)
            elif section == "block":
                result["block"] = bench_block(args, device, sync, bar)
            elif section == "memory":
                result["memory"] = bench_memory(args, bar)
            elif section == "compile":
                result["compile"] = bench_compile(args, device, sync, bar)
            elif section == "experts":
                result["experts_layer"] = bench_layers(args, device, sync, bar)
                result["experts_model"] = bench_models(args, device, sync, bar)
            elif section == "profile":
                result["profile"] = bench_profile(args, device, sync)
            elif section == "decode":
                bar.clear()
                result["decode"] = bench_decode(args)
    busy = others_busy(snapshot, cpu_snapshot())
    result["wall_s"] = time.perf_counter() - t0
    result["cpu_busy_others"] = busy
    for section in _TABLES:
        if section in result:
            print_table(section, result[section])
    if "profile" in result:
        print_profile(result["profile"])
    result["bars"] = bars(result)
    if result["bars"]:
        print("\n## Bars")
        for name, b in result["bars"].items():
            print(
                f"{name:<20} {b['value']:.3f} (bar {b['bar']:g}) {'PASS' if b['pass'] else 'FAIL'}"
            )
    if device.type == "cpu" and busy is not None and busy > 0.1:
        print(
            f"note: other processes kept {100 * busy:.0f}% of the CPUs busy during the run; "
            "absolute numbers are noisy, ratios less so"
        )
    print(f"({result['wall_s']:.0f} s)")
    print(json_text(result))
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
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
