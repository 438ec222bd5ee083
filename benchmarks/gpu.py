"""The first GPU's one prepared run (issue 39): at most 8 minutes, each part in its own process
under a hard timeout, one JSON written (``--out``) and printed as the last line.

    python benchmarks/gpu.py                  # on a CUDA machine: everything, ~7 min
    python benchmarks/gpu.py --dry-run        # tiny sizes on the CPU: a smoke test of each part
    python benchmarks/gpu.py --parts train,decode

Parts (docs/bench.md, "GPU" says how to read them):
- ``tests``: ``pytest -m cuda`` (the oracle suite's CUDA variants): passed / failed / skipped;
- ``train``: a bf16 training step of MoD (every other block routed, 12.5%) and its dense twin at
  the paper's smallest scale (d_model 768, 12 layers, T 2048): ms, tokens/s, achieved TFLOP/s
  against the chip's peak (the FLOP limit), MoD / dense against the FLOP-predicted ratio, eager
  and with the fused kernels; peak memory;
- ``block``: one routed block's forward + backward, fused kernels against eager, beside a dense
  block;
- ``decode``: tokens/s at batch 1, 8, 64, MoD and dense, eager (`generate`, a host sync per
  routed sub-block) and the static cache replayed as a CUDA graph.
Without CUDA (and no ``--dry-run``) it says so and exits 0 with ``{"gpu": false}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from mixture_of_depths import MoDConfig, MoDTransformer, kernels
from mixture_of_depths.flops import estimate_flops
from mixture_of_depths.generate import generate, prefill
from mixture_of_depths.routing import calibrate_predictors
from mixture_of_depths.static_cache import StaticDecoder, StaticKVCache, graph_step

ROOT = Path(__file__).resolve().parents[1]
TIMEOUTS = {"tests": 150, "train": 130, "block": 45, "decode": 130}  # seconds: 7.6 min in all
# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) by device-name fragment.
PEAKS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "4090": 165.0}
FULL = dict(d_model=768, n_layers=12, n_heads=12, max_seq_len=2048, vocab_size=32768)
TINY = dict(d_model=64, n_layers=4, n_heads=4, max_seq_len=128, vocab_size=256)


def shape(dry: bool) -> dict[str, Any]:
    """Model, context, batch and decode settings: the paper's smallest scale, or tiny."""
    if dry:
        return dict(model=TINY, T=128, B=2, prompt=32, new=8, batches=(1, 2), steps=2)
    return dict(model=FULL, T=2048, B=8, prompt=512, new=64, batches=(1, 8, 64), steps=10)


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_reset() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_mib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None


def timed(fn: Any, steps: int, warmup: int = 2) -> float:
    """Median seconds of `fn()` over `steps` calls after `warmup`."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(steps):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def models(dry: bool, **over: Any) -> dict[str, MoDTransformer]:
    """MoD (DR, 12.5%, predictor) and its dense twin, same weights where shared."""
    s = shape(dry)
    cfg = MoDConfig(**s["model"], layer_pattern="DR", capacity=0.125, **over)
    torch.manual_seed(0)
    mod = MoDTransformer(cfg).to(_device())
    dense = MoDTransformer(cfg.dense_twin()).to(_device())
    dense.load_state_dict(mod.state_dict(), strict=False)
    return {"MoD": mod, "dense": dense}


def part_tests(dry: bool) -> dict[str, Any]:
    args = [
        sys.executable,
        "-m",
        "pytest",
        "tests/cuda",
        "-m",
        "cuda",
        "-q",
        "-p",
        "no:cacheprovider",
    ]
    if dry:
        args.append("--collect-only")
    run = subprocess.run(
        args, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUTS["tests"] - 5
    )
    tail = run.stdout.strip().splitlines()[-1:] or [""]
    counts = dict.fromkeys(("passed", "failed", "skipped", "errors", "deselected"), 0)
    words = tail[0].replace(",", "").split()  # "110 passed, 7 skipped in 80.1s"
    for n, what in zip(words, words[1:], strict=False):
        if n.isdigit() and (what in counts or what + "s" in counts):
            counts[what if what in counts else what + "s"] = int(n)
    failed = [ln for ln in run.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    return {"rc": run.returncode, "summary": tail[0], **counts, "failures": failed[:40]}


def part_train(dry: bool) -> dict[str, Any]:
    s = shape(dry)
    B, T = s["B"], s["T"]
    dev = _device()
    peak = next((v for k, v in PEAKS.items() if k in _name()), None)
    x = torch.randint(0, s["model"]["vocab_size"], (B, T), device=dev)
    out: dict[str, Any] = {"B": B, "T": T, "model": s["model"], "peak_tflops": peak}
    for name, model in models(dry).items():
        flops = estimate_flops(model.config, T, B, with_dense=False).train_causal
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev == "cuda")
        for fused in (False, True) if name == "MoD" and kernels.available() else (False,):

            def step(model: MoDTransformer = model, opt: Any = opt) -> None:
                with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                    loss = model(x, x, routing="topk").loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            kernels.enable(fused)
            _peak_reset()
            try:
                sec = timed(step, s["steps"])
            finally:
                kernels.enable(False)
            tag = name + (" fused" if fused else "")
            out[tag] = {"ms": 1e3 * sec, "tokens_per_s": B * T / sec, "tflops": flops / sec / 1e12,
                        "flops_per_step": flops, "peak_mib": _peak_mib()}  # fmt: skip
            if peak:
                out[tag]["of_peak"] = out[tag]["tflops"] / peak
    d, m = out["dense"], out["MoD"]
    out["speedup"] = d["ms"] / m["ms"]
    out["speedup_predicted"] = d["flops_per_step"] / m["flops_per_step"]
    out["efficiency"] = out["speedup"] / out["speedup_predicted"]
    if "MoD fused" in out:
        out["fused_speedup"] = m["ms"] / out["MoD fused"]["ms"]
    return out


def part_block(dry: bool) -> dict[str, Any]:
    s = shape(dry)
    B, T = s["B"], s["T"]
    dev, dt = _device(), torch.bfloat16 if torch.cuda.is_available() else torch.float32
    mod = models(dry)["MoD"].to(dt)
    from mixture_of_depths.blocks import Pass
    from mixture_of_depths.layers import rope_tables

    cos, sin = rope_tables(mod.config.head_dim, T, mod.config.rope_theta, dev, torch.float32)
    p = Pass("topk", cos, sin)
    x = torch.randn(B, T, mod.config.d_model, device=dev, dtype=dt, requires_grad=True)
    routed, dense = mod.blocks[1], mod.blocks[0]
    out: dict[str, Any] = {"B": B, "T": T}

    def run(block: Any) -> None:
        y, _ = block(x, p)
        y.float().square().mean().backward()

    out["dense ms"] = 1e3 * timed(lambda: run(dense), s["steps"])
    out["routed eager ms"] = 1e3 * timed(lambda: run(routed), s["steps"])
    if kernels.available():
        kernels.enable()
        try:
            out["routed fused ms"] = 1e3 * timed(lambda: run(routed), s["steps"])
        finally:
            kernels.enable(False)
        out["fused over eager"] = out["routed eager ms"] / out["routed fused ms"]
    out["routed eager / dense"] = out["dense ms"] / out["routed eager ms"]
    return out


def part_decode(dry: bool) -> dict[str, Any]:
    s = shape(dry)
    dev = _device()
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    out: dict[str, Any] = {"prompt": s["prompt"], "new": s["new"]}
    for name, model in models(dry).items():
        model = model.to(dt).eval()
        V = model.config.vocab_size
        if name == "MoD":
            L = min(256, model.config.max_seq_len)
            calibrate_predictors(model, torch.randint(0, V, (4, L), device=dev), 0.125)
        for B in s["batches"]:
            prompts = torch.randint(0, V, (B, s["prompt"]), device=dev)
            n = s["new"]
            sec = timed(partial(generate, model, prompts, n, temperature=0), 1, warmup=1)
            row = {"eager tokens/s": B * n / sec}
            total = s["prompt"] + n + 8
            cache = StaticKVCache(model.config, B, total, dev, dt, headroom=3.0)
            decoder = StaticDecoder(model, cache)
            logits, _ = prefill(model, prompts, torch.full((B,), s["prompt"]), cache)
            toks = logits.argmax(-1)
            if dev == "cuda":
                graph, _, _ = graph_step(decoder, toks)
                sec = timed(graph.replay, n, warmup=1)
            else:
                with torch.no_grad():
                    sec = timed(partial(decoder, toks), n, warmup=1)
            row["static graph tokens/s" if dev == "cuda" else "static eager tokens/s"] = B / sec
            out[f"{name} B={B}"] = row
    for B in s["batches"]:
        m, d = out[f"MoD B={B}"], out[f"dense B={B}"]
        out[f"MoD / dense B={B}"] = {k: m[k] / d[k] for k in m}
    return out


PARTS = {"tests": part_tests, "train": part_train, "block": part_block, "decode": part_decode}


def _name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def run_part(part: str, dry: bool) -> dict[str, Any]:
    """One part in a fresh process under its timeout; what it wrote, or why it did not."""
    tmp = ROOT / "runs" / f"gpu-bench-{part}.json"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, __file__, "--one", part, "--out", str(tmp)] + (
        ["--dry-run"] if dry else []
    )
    env = {**os.environ}
    if dry and not torch.cuda.is_available():
        env.setdefault("TRITON_INTERPRET", "1")  # the fused parts under the interpreter
    t0 = time.perf_counter()
    try:
        run = subprocess.run(args, env=env, capture_output=True, text=True, timeout=TIMEOUTS[part])
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {TIMEOUTS[part]} s"}
    if run.returncode != 0 or not tmp.exists():
        return {"error": f"exit {run.returncode}", "stderr": run.stderr[-3000:]}
    res = json.loads(tmp.read_text())
    tmp.unlink()
    res["wall_s"] = time.perf_counter() - t0
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes, on any device")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated of {list(PARTS)}")
    ap.add_argument("--out", default="docs/bench/gpu.json", help="where the JSON goes")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a part's own process
    args = ap.parse_args(argv)
    if args.one:
        res = PARTS[args.one](args.dry_run)
        Path(args.out).write_text(json.dumps(res, indent=1))
        return 0
    if not torch.cuda.is_available() and not args.dry_run:
        print("no CUDA GPU here (torch.cuda.is_available() is False): nothing was measured")
        print(json.dumps({"gpu": False, "torch": torch.__version__}))
        return 0
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"--parts: unknown {unknown}; choose from {list(PARTS)}")
    result: dict[str, Any] = {"gpu": torch.cuda.is_available(), "device": _name(),
                              "torch": torch.__version__, "dry_run": args.dry_run}  # fmt: skip
    for part in parts:
        print(f"-- {part} (at most {TIMEOUTS[part]} s)", flush=True)
        result[part] = run_part(part, args.dry_run)
        print(json.dumps(result[part], indent=1)[:4000], flush=True)
    if not args.dry_run:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
