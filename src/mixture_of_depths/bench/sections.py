"""The sections of `mod bench` that measure: a training step, one block, a training step's
memory, decoding, eager against compiled, and a profile (the experts section is `bench.moe`).

Each returns the rows of its table (`bench.report`); the flags are `bench.suite`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from tqdm.auto import tqdm

from ..config import MoDConfig
from ..flops import estimate_flops
from ..layers import rope_tables
from ..model import BLOCKS, Block, MoDTransformer, Pass
from ..precision import autocast_for
from . import decode
from .common import interleaved, median_ms, spread, token_batch, train_step_fn
from .memory import MALLOC_ENV


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


def bench_train(args: argparse.Namespace, device: torch.device, sync: Callable, bar: tqdm) -> list:
    """A training step of the dense twin and of each routed model, at each length."""
    rows = []
    for seq_len in args.seq_lens:
        batch = args.tokens // seq_len
        configs = model_configs(args, seq_len)
        idx, targets = token_batch(args, batch, seq_len, device)
        fns, flops = {}, {}
        for name, cfg in configs.items():
            fns[name] = train_step_fn(_model(cfg, args, device), idx, targets, args.dtype)
            flops[name] = estimate_flops(cfg, seq_len, batch, with_dense=False).train_causal
        bar.set_postfix_str(f"train T={seq_len}")
        times = interleaved(fns, args.warmup, args.repeats, sync, bar)
        dense_ms = median_ms(times["dense"])
        for name, cfg in configs.items():
            ms = median_ms(times[name])
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
                    "range_rel": spread(times[name]),
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
    """One routed block against one dense block, forward and forward + backward."""
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
            dense_ms = median_ms(times["dense"])
            for name in configs:
                ms = median_ms(times[name])
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
                        "range_rel": spread(times[name]),
                    }
                )
    return rows


def _measure_memory(cfg: MoDConfig, batch: int, seq_len: int, device: str, dtype: str) -> dict:
    """`bench.memory` on one model, in a fresh process (with `MALLOC_ENV`): its high-water mark
    is that model's step alone."""
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
    """Peak and saved-activation bytes of a training step, each model in its own process."""
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
    """`bench.decode` at each of ``--decode-batch-sizes``, on the routed model at the smallest
    capacity."""
    sizes = ",".join(str(b) for b in args.decode_batch_sizes)
    argv = ["--preset", args.preset, "--batch-sizes", sizes, "--device", args.device]
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
    """Eager against compiled training steps of the dense twin and the smallest capacity."""
    seq_len = args.compile_seq_len
    batch = args.tokens // seq_len
    configs = model_configs(args, seq_len)
    keep = {"dense": configs["dense"], "MoD": configs[f"c={min(args.capacities):g}"]}
    idx, targets = token_batch(args, batch, seq_len, device)
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
    ms = {name: median_ms(t) for name, t in times.items()}
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
                "range_rel": spread(times[name]),
            }
        )
    return rows


def _profile(fn: Callable[[], None], repeats: int, warmup: int, sync: Callable, cuda: bool) -> dict:
    """Self CPU time per op of `repeats` calls of `fn` (the 15 largest), and the wall time per call
    measured without the profiler: their difference is time no op accounts for (dispatch, Python,
    thread wake-ups)."""
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
    idx, targets = token_batch(args, batch, seq_len, device)
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
