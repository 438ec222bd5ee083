"""Serving under load: MoD beside its dense twin, continuous batching beside a static batch,
each behind a live `mod serve` HTTP server (docs/serving.md, "Measured").

For each configuration (model x batching mode) an engine is built, served in-process on a free
port (uvicorn in a thread), and driven by an open-loop load: requests arrive at seeded Poisson
times at a given rate (``inf``: all at once, saturation) whatever the server's pace, each with
a prompt length and an output length drawn uniformly from their ranges (the same draws for
every configuration), streamed with ``ignore_eos`` so every request makes its full output.
Per configuration and rate: throughput (generated tokens per second, first arrival to last
completion), time to first token and time per output token (p50, p99), and the KV bytes in use
read from /metrics while requests run (mean and peak). Then the ratios: MoD / dense and
continuous / static at each rate, and at saturation (each configuration's best throughput).

    python benchmarks/serve.py MOD_CKPT DENSE_CKPT            # two trained checkpoints
    python benchmarks/serve.py --quick                        # untrained `small` ones, < 60 s

Nothing is trained here. With ``--quick`` the models are the `small` preset (MoD at capacity
0.125 on "DR", its predictors calibrated so about that share takes each routed layer) and its
dense twin, untrained, on short requests. The client runs in the same process as the server
(its share of the CPU is part of what is measured). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from mixture_of_depths import MoDConfig, MoDTransformer
from mixture_of_depths.bench.common import cpu_snapshot, fmt_bytes, others_busy
from mixture_of_depths.data import ByteTokenizer, load_splits, load_tokenizer
from mixture_of_depths.routing import calibrate_predictors
from mixture_of_depths.runtime.checkpoint import load_model, read_json_file, resolve_checkpoint
from mixture_of_depths.serve.engine import Engine
from mixture_of_depths.serve.metrics import parse_prometheus
from mixture_of_depths.serve.server import ServerThread

# The targets (CPU, `small` preset): reported beside the measured ratios, never asserted.
TARGETS = {"mod_over_dense_throughput": 1.4, "continuous_over_static_throughput": 1.5,
           "mod_over_dense_kv_bytes": 0.6}  # fmt: skip
CONFIGS = ("mod/continuous", "dense/continuous", "mod/static", "dense/static")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mod", nargs="?", help="the MoD checkpoint")
    p.add_argument("dense", nargs="?", help="its dense twin's checkpoint")
    p.add_argument("--quick", action="store_true", help="untrained small models, a short load")
    p.add_argument("--rates", default=None, help="requests/s, comma-separated; inf: all at once "
                   "(default: 1,2,4,8,inf; --quick: 4,inf)")  # fmt: skip
    p.add_argument("--requests", type=int, default=None, help="per rate (default 64; quick 8)")
    p.add_argument("--prompt-lens", default=None, help="LO:HI tokens (default 16:192; quick 8:32)")
    p.add_argument("--output-lens", default=None, help="LO:HI tokens (default 16:64; quick 4:12)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="which of " + ", ".join(CONFIGS))
    p.add_argument("--max-rows", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="text the prompts are cut from (default: the "
                   "MoD checkpoint run's validation split; --quick: random ids)")  # fmt: skip
    p.add_argument("--plot", default=None, metavar="PNG", help="write the throughput and "
                   "latency against the request rate there")  # fmt: skip
    return p


def _range(text: str, name: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"--{name} must be LO:HI (integers), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise SystemExit(f"--{name} must have 1 <= LO <= HI, got {text!r}")
    return lo, hi


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    q = args.quick
    if not q and (args.mod is None or args.dense is None):
        raise SystemExit("give two checkpoints (MoD and its dense twin), or --quick")
    args.rates = args.rates or ("4,inf" if q else "1,2,4,8,inf")
    try:
        args.rates = [float(r) for r in args.rates.split(",")]
    except ValueError:
        raise SystemExit(f"--rates must be numbers or inf, got {args.rates!r}") from None
    if not args.rates or min(args.rates) <= 0:
        raise SystemExit("--rates must be > 0")
    args.requests = args.requests or (8 if q else 64)
    args.prompt_lens = _range(args.prompt_lens or ("8:32" if q else "16:192"), "prompt-lens")
    args.output_lens = _range(args.output_lens or ("4:12" if q else "16:64"), "output-lens")
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad or not args.configs:
        raise SystemExit(f"--configs: {bad or 'none'}; choose from {', '.join(CONFIGS)}")
    return args


# -- the models -----------------------------------------------------------------------------------
def quick_models(seed: int, device: str) -> dict[str, tuple[MoDTransformer, Any]]:
    """The `small` preset untrained, its predictors calibrated to the capacity, and its dense
    twin with the same shared weights' shapes (speed does not depend on the weights)."""
    cfg = MoDConfig.preset("small")
    torch.manual_seed(seed)
    mod = MoDTransformer(cfg).eval()
    calib = torch.randint(0, cfg.vocab_size, (8, 64), generator=torch.Generator().manual_seed(seed))
    calibrate_predictors(mod, calib, cfg.capacity)
    torch.manual_seed(seed)
    dense = MoDTransformer(cfg.dense_twin()).eval()
    tok = ByteTokenizer()
    return {"mod": (mod.to(device), tok), "dense": (dense.to(device), tok)}


def checkpoint_models(mod_dir: str, dense_dir: str, device: str) -> dict[str, tuple[Any, Any]]:
    out = {}
    for name, d in (("mod", mod_dir), ("dense", dense_dir)):
        model, _ = load_model(d, map_location=device)
        out[name] = (model.eval(), load_tokenizer(d))
    if out["dense"][0].config.routed_layers:
        raise SystemExit(f"{dense_dir} has routed layers: the second checkpoint must be dense")
    return out


# -- the load -------------------------------------------------------------------------------------
@dataclass
class Arrival:
    at: float  # seconds after the start
    prompt: list[int]
    max_tokens: int


@dataclass
class Record:
    status: int
    tokens: int = 0
    ttft: float | None = None
    tpot: float | None = None
    done_at: float | None = None


def held_out_text(mod_dir: str, data: str | None) -> list[int]:
    """The validation tokens of the MoD checkpoint's run (or of `data`): prompts cut from them
    route as the model's text does; random ids would not (a router's take-rate on them can be
    far from its capacity)."""
    ckpt = resolve_checkpoint(mod_dir)
    if data is None and (ckpt / "trainer.json").exists():
        data = read_json_file(ckpt / "trainer.json").get("train_config", {}).get("data")
    return load_splits(data, load_tokenizer(ckpt))[1].tolist()


def workload(args: argparse.Namespace, rate: float, vocab: int) -> list[Arrival]:
    """Seeded: the same arrivals, prompts and lengths for every configuration at this rate;
    prompts cut from `args.text` (held-out tokens) where given, else random ids."""
    rng = random.Random(f"{args.seed}:{rate}")
    t, out = 0.0, []
    text = args.text
    for _ in range(args.requests):
        n = rng.randint(*args.prompt_lens)
        if text and len(text) > n:
            start = rng.randrange(len(text) - n)
            prompt = text[start : start + n]
        else:
            prompt = [rng.randrange(min(vocab, 256)) for _ in range(n)]
        out.append(Arrival(t, prompt, rng.randint(*args.output_lens)))
        if math.isfinite(rate):
            t += rng.expovariate(rate)
    return out


async def one_request(http: httpx.AsyncClient, a: Arrival, t0: float, timeout: float) -> Record:
    await asyncio.sleep(max(0.0, t0 + a.at - time.perf_counter()))
    body = {"prompt": a.prompt, "max_tokens": a.max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    sent = time.perf_counter()
    times: list[float] = []
    async with http.stream("POST", "/v1/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            await r.aread()
            return Record(r.status_code)
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                times += [time.perf_counter()] * len(choice.get("token_ids", []))
    rec = Record(200, len(times), done_at=time.perf_counter() - t0)
    if times:
        rec.ttft = times[0] - sent
        rec.tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    return rec


async def poll_kv(http: httpx.AsyncClient, stop: asyncio.Event, out: list[float]) -> None:
    """KV bytes in use, sampled from /metrics while some request runs."""
    while not stop.is_set():
        m = parse_prometheus((await http.get("/metrics")).text)
        if m.get("mod_requests_running", 0) > 0:
            out.append(float(m.get("mod_kv_bytes_in_use", 0.0)))
        await asyncio.sleep(0.1)


async def run_load(url: str, arrivals: list[Arrival], timeout: float) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=len(arrivals) + 4, max_keepalive_connections=8)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as http:
        stop, kv = asyncio.Event(), []
        poller = asyncio.create_task(poll_kv(http, stop, kv))
        t0 = time.perf_counter()
        records = await asyncio.gather(*(one_request(http, a, t0, timeout) for a in arrivals))
        stop.set()
        await poller
    return summarise(records, kv)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def summarise(records: list[Record], kv: list[float]) -> dict[str, Any]:
    ok = [r for r in records if r.status == 200]
    wall = max((r.done_at for r in ok if r.done_at is not None), default=0.0)
    tokens = sum(r.tokens for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    return {
        "completed": len(ok),
        "rejected": len(records) - len(ok),
        "tokens": tokens,
        "seconds": wall,
        "throughput_tok_s": tokens / wall if wall > 0 else None,
        "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
        "tpot_p50_s": _pct(tpot, 0.5), "tpot_p99_s": _pct(tpot, 0.99),
        "kv_bytes_mean": statistics.fmean(kv) if kv else None,
        "kv_bytes_peak": max(kv) if kv else None,
    }  # fmt: skip


def run_config(
    name: str, model: Any, tok: Any, args: argparse.Namespace
) -> tuple[dict[str, Any], dict[str, float]]:
    kind, batching = name.split("/")
    engine = Engine(model, tok, model_name=kind, max_rows=args.max_rows, page_size=args.page_size,
                    max_queue=100_000, prefill_chunk=args.prefill_chunk, batching=batching,
                    device=args.device)  # fmt: skip
    engine.start()
    rows = {}
    try:
        with ServerThread(engine) as server:
            for rate in args.rates:
                arrivals = workload(args, rate, model.config.vocab_size)
                rows[_rate_key(rate)] = asyncio.run(run_load(server.url, arrivals, args.timeout))
                print(f"  {name:17} rate {_rate_key(rate):>5}: {_row_text(rows[_rate_key(rate)])}",
                      file=sys.stderr, flush=True)  # fmt: skip
        take = engine.metrics()["take_rate"]  # share of decoded tokens per router, all rates
        shares = ", ".join(f"{k} {v:.1%}" for k, v in take.items()) or "-"
        print(f"  {name:17} take-rates while decoding: {shares}", file=sys.stderr)
    finally:
        engine.drain(10.0)
    return rows, take


def _rate_key(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _f(x: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def _row_text(r: dict[str, Any]) -> str:
    return (f"{_f(r['throughput_tok_s']):>8} tok/s  TTFT {_f(r['ttft_p50_s'], 1e3):>7} / "
            f"{_f(r['ttft_p99_s'], 1e3):>7} ms  TPOT {_f(r['tpot_p50_s'], 1e3):>6} / "
            f"{_f(r['tpot_p99_s'], 1e3):>6} ms  KV {fmt_bytes(r['kv_bytes_mean']):>9} "
            f"(peak {fmt_bytes(r['kv_bytes_peak'])})  {r['completed']} done, "
            f"{r['rejected']} refused")  # fmt: skip


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(results: dict[str, dict[str, dict]]) -> dict[str, Any]:
    """MoD / dense and continuous / static, at each rate and at saturation (best throughput)."""
    pairs = {"mod_over_dense": ("mod/continuous", "dense/continuous"),
             "continuous_over_static": ("mod/continuous", "mod/static"),
             "dense_continuous_over_static": ("dense/continuous", "dense/static")}  # fmt: skip
    out: dict[str, Any] = {}
    for label, (a, b) in pairs.items():
        if a not in results or b not in results:
            continue
        ra, rb = results[a], results[b]
        per_rate = {
            k: {"throughput": _ratio(ra[k]["throughput_tok_s"], rb[k]["throughput_tok_s"]),
                "kv_bytes": _ratio(ra[k]["kv_bytes_mean"], rb[k]["kv_bytes_mean"])}
            for k in ra if k in rb
        }  # fmt: skip
        best = {c: max((r["throughput_tok_s"] or 0.0) for r in results[c].values()) for c in (a, b)}
        out[label] = {"per_rate": per_rate, "saturated_throughput": _ratio(best[a], best[b])}
    return out


def print_report(args: argparse.Namespace, results: dict, rat: dict, busy: float | None) -> None:
    src = ("untrained small preset (--quick), random prompts" if args.quick
           else f"{args.mod} and {args.dense}, prompts cut from held-out text")  # fmt: skip
    (p_lo, p_hi), (o_lo, o_hi) = args.prompt_lens, args.output_lens
    print(
        f"serving under load: {src}; {args.requests} requests per rate, prompts {p_lo}-{p_hi}, "
        f"outputs {o_lo}-{o_hi} tokens, max_rows {args.max_rows}, device {args.device}"
    )
    print(f"{'configuration':17} {'rate':>5}  throughput, TTFT p50 / p99, TPOT p50 / p99, KV")
    for name, rows in results.items():
        for rate, r in rows.items():
            print(f"{name:17} {rate:>5}  {_row_text(r)}")
    print("\nratios (per rate: throughput, KV bytes; then saturated throughput), target:")
    for label, r in rat.items():
        cells = ", ".join(f"{k}: {_f(v['throughput'], digits=2)}x / {_f(v['kv_bytes'], digits=2)}x"
                          for k, v in r["per_rate"].items())  # fmt: skip
        target = TARGETS.get(f"{label}_throughput")
        want = f" (target >= {target}x)" if target else ""
        print(f"  {label}: {cells}; saturated {_f(r['saturated_throughput'], digits=2)}x{want}")
    print(f"  KV bytes target: MoD <= {TARGETS['mod_over_dense_kv_bytes']}x dense's under load")
    if busy is not None:
        print(f"other processes kept {busy:.0%} of the CPUs busy during the run")


def plot(results: dict[str, dict[str, dict]], path: str) -> None:
    """Throughput, TTFT p50 and TPOT p50 against the request rate, one line per configuration
    (saturation, ``inf``, drawn at the right end)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = (("throughput_tok_s", 1.0, "throughput (tokens/s)"),
              ("ttft_p50_s", 1e3, "time to first token, p50 (ms)"),
              ("tpot_p50_s", 1e3, "time per output token, p50 (ms)"))  # fmt: skip
    for name, rows in results.items():
        keys = list(rows)
        xs = list(range(len(keys)))
        for ax, (key, scale, label) in zip(axes, panels, strict=True):
            ys = [None if rows[k][key] is None else rows[k][key] * scale for k in keys]
            ax.plot(xs, ys, marker="o", label=name, linestyle="-" if "mod" in name else "--")
            ax.set_xticks(xs, [k if k != "inf" else "all at once" for k in keys])
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle("mod serve under an open-loop load (benchmarks/serve.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    models = (quick_models(args.seed, args.device) if args.quick
              else checkpoint_models(args.mod, args.dense, args.device))  # fmt: skip
    args.text = None if args.quick else held_out_text(args.mod, args.data)
    before = cpu_snapshot()
    results, takes = {}, {}
    for name in args.configs:
        model, tok = models[name.split("/")[0]]
        results[name], takes[name] = run_config(name, model, tok, args)
    busy = others_busy(before, cpu_snapshot())
    rat = ratios(results)
    print_report(args, results, rat, busy)
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    settings = {k: v for k, v in vars(args).items() if k not in ("mod", "dense", "text")}
    settings["rates"] = [_rate_key(r) for r in args.rates]
    out = {"settings": settings, "checkpoints": [args.mod, args.dense], "results": results,
           "ratios": rat, "take_rate": takes, "targets": TARGETS,
           "others_busy_share": busy}  # fmt: skip
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
