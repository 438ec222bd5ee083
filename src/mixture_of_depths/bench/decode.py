"""Decode throughput and KV-cache size: an MoD model against its dense twin of the same size.

Two models are run side by side in one run, on the same seeded random-token prompts:

- ``mod``: the preset with ``layer_pattern="DR"`` at capacity 0.125 (the paper's best), routed
  causally by its ``predictor`` (or a trained checkpoint with ``--checkpoint``);
- ``dense``: ``cfg.dense_twin()``, every block dense, otherwise identical.

For each batch size, a prompt of P tokens is prefilled (untimed) into a `KVCache`, then N decode
steps are run with `decode_step`, each sampling greedily (temperature 0) and feeding a token back;
only the N decode steps are timed (sampling and the host copy of the tokens included). Models
are interleaved round-robin (the order rotates every round) so clock drift and other processes
hit both alike; the median over repeats is reported. Per model and batch size: decode
tokens/s (batch * N / seconds), the cache's ``nbytes_used`` at the end and ``nbytes_allocated``,
and the measured share of tokens that took each routed layer.

Untrained routers: a causal router's logit ``r = x @ w`` of a random model is symmetric around 0,
so about half of the tokens take every routed layer, which no trained MoD model does. By default the
MoD model is therefore built with ``causal_router="predictor"`` and each predictor's output bias
is calibrated, layer by layer in order (a layer's input depends on earlier layers' routing), so
that on a calibration batch of random prompts a share ``capacity`` of the tokens has a predictor
logit > 0. ``--no-calibrate`` shows the untrained behaviour. Greedy decoding of an untrained model
repeats the last prompt token forever, so each row would make one routing decision for all its
steps (take-rates of 0% or 100% per row); by default (``--feed random``) the tokens fed back are
therefore a seeded random continuation, like the prompts the predictors were calibrated on (the
greedy token is still computed each step, so the work is the same). With ``--checkpoint DIR`` the
trained model is used as it is and its greedy tokens are fed back (``--feed greedy``), against a
dense twin with random weights of the same shapes (its speed does not depend on the weights).

The MoD/dense ratios are printed beside what the work alone allows at the measured take-rates:
"layers" counts each dense layer as 1 and a routed one as its take-rate (12.5% on DR gives 1.78x
speed and 0.56x cache), "FLOPs" also counts the lm_head, the routers/predictors and the attention
over the cached context, "bytes" counts the weights and cache read per step (small-batch decoding
is memory-bound, and at batch 8 a routed layer's weights are read whenever any row takes it); both
come from `flops.decode_cost`, the sum of each layer kind's own cost function. The bars are >= 1.6x
the dense tokens/s and <= 0.6x its KV cache (docs/semantics.md, "Figures"). On the CPU one thread
is the default (``--threads``): decode ops are too small to share, and a second thread
spin-waiting on a CPU other processes use slows decoding several times over.

    python benchmarks/decode.py                  # preset small, prompt 512 + 64 new tokens
    python benchmarks/decode.py --preset tiny --prompt-len 16 --new-tokens 4 --repeats 1
    python benchmarks/decode.py --device cuda --preset base --prompt-len 448
    python benchmarks/decode.py --checkpoint runs/mod-small

The last line printed is one JSON object with every number, for scripts.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..cache import KVCache
from ..config import MoDConfig
from ..fileio import json_text
from ..flops import decode_cost, layer_shares
from ..generate import decode_step, prefill, router_names, sample_next
from ..model import MoDTransformer
from ..routing import calibrate_predictors
from ..runtime.checkpoint import load_model
from .common import cpu_snapshot, fmt_bytes, others_busy

SPEEDUP_BAR = 1.6  # MoD decode tokens/s must reach this multiple of the dense twin's
CACHE_BAR = 0.6  # MoD KV cache in use must be at most this fraction of the dense twin's
MIN_CONTEXT = 512  # the context (prompt + new tokens) the bars are meant for


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's flags, in three helpers that keep ``--help``'s order."""
    p = argparse.ArgumentParser(
        description="Decode tokens/s and KV-cache bytes of an MoD model vs its dense twin.",
    )
    _add_model_arguments(p)
    _add_run_arguments(p)
    _add_routing_arguments(p)
    return p


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    """What is decoded: the model, the prompt and decode lengths, the batch sizes."""
    p.add_argument("--preset", default="small", help="MoDConfig preset (default: small)")
    p.add_argument(
        "--checkpoint",
        default=None,
        help="a trained MoD checkpoint directory to use instead of --preset (its dense "
        "twin gets random weights: speed only)",
    )
    p.add_argument(
        "--prompt-len",
        type=int,
        default=512,
        help="prompt tokens prefilled before decoding (default: 512)",
    )
    p.add_argument(
        "--new-tokens", type=int, default=64, help="decode steps timed per run (default: 64)"
    )
    p.add_argument(
        "--skipped-kv",
        choices=("none", "residual"),
        default="none",
        help="the MoD model's KV strategy (docs/semantics.md; default: %(default)s)",
    )
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="override the preset's max_seq_len (default: the larger of the preset's "
        "and prompt-len + new-tokens)",
    )
    p.add_argument(
        "--batch-sizes", default="1,8", help="comma-separated batch sizes (default: 1,8)"
    )


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    """How it is timed: repeats, device, dtype, threads."""
    cuda = torch.cuda.is_available()
    p.add_argument(
        "--repeats", type=int, default=9, help="timed runs per model and batch size (default: 9)"
    )
    p.add_argument(
        "--warmup", type=int, default=1, help="untimed runs per model and batch size (default: 1)"
    )
    p.add_argument(
        "--device",
        default="cuda" if cuda else "cpu",
        help="torch device (default: cuda if available, else cpu)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="weights and cache dtype (default: bfloat16 on cuda, else float32)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads (default on cpu: 1; decode ops are too small to share, and "
        "a second thread spin-waiting on a busy CPU slows decoding many times over)",
    )


def _add_routing_arguments(p: argparse.ArgumentParser) -> None:
    """The tokens fed back, and the MoD model's routing and its calibration."""
    p.add_argument(
        "--feed",
        choices=("greedy", "random"),
        default=None,
        help="tokens fed back at each decode step: the greedy (temperature 0) samples, or a "
        "seeded random continuation (the greedy token is still computed). Default: greedy for a "
        "checkpoint, random for an untrained preset, whose greedy output repeats the last prompt "
        "token forever, so each row makes one routing decision for all its steps",
    )
    p.add_argument(
        "--capacity",
        type=float,
        default=0.125,
        help="capacity of the MoD model (default: 0.125; ignored with --checkpoint)",
    )
    p.add_argument(
        "--layer-pattern",
        default="DR",
        help="layer pattern of the MoD model (default: DR; ignored with --checkpoint)",
    )
    p.add_argument(
        "--calibrate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="calibrate the untrained predictors' biases to the capacity (default: on "
        "for a preset, off for a checkpoint)",
    )
    p.add_argument(
        "--calib-rows",
        type=int,
        default=8,
        help="random prompts of --prompt-len tokens to calibrate on (default: 8)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for weights and prompts (default: 0)")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The flags, checked, with the defaults that depend on the device and the source filled in."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bfloat16" if torch.device(args.device).type == "cuda" else "float32"
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError:
        p.error(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        p.error("--batch-sizes must list integers >= 1")
    for name in ("prompt_len", "new_tokens", "repeats", "calib_rows"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    if args.calibrate is None:
        args.calibrate = args.checkpoint is None
    if args.feed is None:
        args.feed = "greedy" if args.checkpoint else "random"
    if args.threads is None and torch.device(args.device).type == "cpu":
        args.threads = 1
    return args


def build_models(
    args: argparse.Namespace, context: int, device: torch.device, dtype: torch.dtype
) -> tuple[dict[str, MoDTransformer], dict[str, MoDConfig]]:
    """The MoD model (the checkpoint's, or the preset's with predictors) and its dense twin, in
    `dtype` and eval mode, with their configs."""
    if args.checkpoint is not None:
        mod, mod_cfg = load_model(args.checkpoint, map_location=device)
        if context > mod_cfg.max_seq_len:
            raise SystemExit(
                f"prompt-len + new-tokens = {context} is more than the checkpoint's "
                f"max_seq_len={mod_cfg.max_seq_len}; shorten --prompt-len or --new-tokens"
            )
    else:
        base = MoDConfig.preset(args.preset)
        max_seq_len = args.max_seq_len or max(base.max_seq_len, context)
        if context > max_seq_len:
            raise SystemExit(
                f"prompt-len + new-tokens = {context} is more than max_seq_len={max_seq_len}"
            )
        mod_cfg = MoDConfig.preset(
            args.preset,
            max_seq_len=max_seq_len,
            layer_pattern=args.layer_pattern,
            capacity=args.capacity,
            causal_router="predictor",
            skipped_kv=args.skipped_kv,
        )
        torch.manual_seed(args.seed)
        mod = MoDTransformer(mod_cfg).to(device)
    torch.manual_seed(args.seed)
    dense = MoDTransformer(mod_cfg.dense_twin()).to(device)
    models = {"mod": mod.to(dtype).eval(), "dense": dense.to(dtype).eval()}
    return models, {name: m.config for name, m in models.items()}


@torch.no_grad()
def decode_run(
    model: MoDTransformer,
    prompt: Tensor,
    new_tokens: int,
    sync: Callable[[], None],
    feed: Tensor | None = None,
) -> dict:
    """Prefill `prompt` (untimed), then time `new_tokens` decode steps.

    Each step samples greedily (temperature 0) from the last logits and feeds the sampled tokens
    back, or, when `feed` (B, new_tokens) host ids is given, feeds ``feed[:, step]`` instead (the
    greedy token is still computed, so the work and the host sync per step are the same).
    """
    cfg = model.config
    B, P = prompt.shape
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    cache = KVCache(cfg, B, P + new_tokens, device, dtype)
    lens = torch.full((B,), P, dtype=torch.long)
    logits, prompt_routing = prefill(model, prompt, lens, cache, "causal")
    decisions = []
    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    for step in range(new_tokens):
        tokens = sample_next(logits, temperature=0.0).cpu()
        if feed is not None:
            tokens = feed[:, step]
        logits, routing = decode_step(model, tokens, cache)
        decisions.append(routing)
    sync()
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    decode_routing = torch.stack(decisions).float()  # (N, B, n_routers)
    element_size = param.element_size()
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "nbytes_used": cache.nbytes_used,
        "nbytes_allocated": cache.nbytes_allocated,
        "cached_share": (cache.lengths.float().mean(1) / (P + new_tokens)).tolist(),
        "take_prompt": prompt_routing.float().flatten(0, 1).mean(0).tolist(),
        "take_decode": decode_routing.flatten(0, 1).mean(0).tolist(),
        "busy_decode": decode_routing.amax(1).mean(0).tolist(),  # steps where some row took it
        "element_size": element_size,
    }


def pct(xs: Sequence[float]) -> str:
    """Shares as percentages, one per routed layer."""
    return " ".join(f"{100 * x:5.1f}%" for x in xs) if xs else "-"


def measure(
    args: argparse.Namespace, models: dict[str, MoDTransformer], device: torch.device
) -> tuple[dict[tuple[str, int], list[dict]], list[float] | None, float, float | None]:
    """Every model at every batch size, round-robin with a rotating order: the runs per (model,
    batch), the calibration take-rates, the wall time and the share of the CPUs others used."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    P, N = args.prompt_len, args.new_tokens
    mod_cfg = models["mod"].config
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, mod_cfg.vocab_size, (max(args.batch_sizes), P), generator=gen)
    prompts = prompts.to(device)
    feed_ids = None
    if args.feed == "random":
        feed_ids = torch.randint(0, mod_cfg.vocab_size, (max(args.batch_sizes), N), generator=gen)
    calib_take = None
    if args.calibrate:
        if not mod_cfg.has_predictor:
            raise SystemExit(
                "--calibrate needs predictors: causal_router='predictor' and learned router "
                f"scores (the checkpoint has {mod_cfg.causal_router!r}, "
                f"{mod_cfg.router_scores!r}); pass --no-calibrate"
            )
        calib = torch.randint(0, mod_cfg.vocab_size, (args.calib_rows, P), generator=gen)
        calib_take = calibrate_predictors(models["mod"], calib.to(device), mod_cfg.capacity)
    names = list(models)
    runs: dict[tuple[str, int], list[dict]] = {(n, b): [] for b in args.batch_sizes for n in names}
    snapshot = cpu_snapshot()
    t_start = time.perf_counter()
    for rnd in range(args.warmup + args.repeats):
        order = names[rnd % len(names) :] + names[: rnd % len(names)]  # rotate each round
        for b in args.batch_sizes:
            for name in order:
                feed = None if feed_ids is None else feed_ids[:b]
                out = decode_run(models[name], prompts[:b], N, sync, feed)
                if rnd >= args.warmup:
                    runs[name, b].append(out)
    return runs, calib_take, time.perf_counter() - t_start, others_busy(snapshot, cpu_snapshot())


def summarise(args: argparse.Namespace, runs: dict, configs: dict[str, MoDConfig]) -> dict:
    """Per (model, batch): median speed, cache bytes, take-rates and the FLOPs and bytes of a
    decode step at the measured take-rates (`flops.decode_cost`)."""
    P, N = args.prompt_len, args.new_tokens
    rows: dict[tuple[str, int], dict] = {}
    for (name, b), outs in runs.items():
        secs = [o["seconds"] for o in outs]
        med = statistics.median(secs)
        cpu_med = statistics.median(o["cpu_seconds"] for o in outs)
        last = outs[-1]  # greedy and same prompt: routing and bytes are the same every repeat
        cfg = configs[name]
        take = layer_shares(cfg, last["take_decode"])
        ctx = P + (N + 1) / 2  # mean context of a decode step, itself included
        flops, nbytes = decode_cost(
            cfg,
            take,
            last["cached_share"],
            ctx,
            busy=layer_shares(cfg, last["busy_decode"]),
            batch_size=b,
            element_size=last["element_size"],
        )
        rows[name, b] = {
            "ms_per_step": 1e3 * med / N,
            "tokens_per_s": b * N / med,
            "cpu_ms_per_step": 1e3 * cpu_med / N,
            "range_rel": (max(secs) - min(secs)) / med,
            "nbytes_used": last["nbytes_used"],
            "nbytes_allocated": last["nbytes_allocated"],
            "take_prompt": last["take_prompt"],
            "take_decode": last["take_decode"],
            "busy_decode": last["busy_decode"],
            "cached_share": last["cached_share"],
            "flops_per_token": flops,
            "bytes_read_per_step": nbytes,
            "work_layers": sum((a + m) / 2 for a, m in take),
            "take_decode_mean": statistics.mean(last["take_decode"] or [1.0]),
        }
    return rows


def ratios_of(rows: dict, mod_cfg: MoDConfig, batch_sizes: Sequence[int]) -> dict[int, dict]:
    """MoD over dense per batch size, measured and predicted, and whether the bars hold."""
    out = {}
    for b in batch_sizes:
        m, d = rows["mod", b], rows["dense", b]
        r = {
            "speedup": m["tokens_per_s"] / d["tokens_per_s"],
            "speedup_cpu_time": d["cpu_ms_per_step"] / m["cpu_ms_per_step"],
            "speedup_pred_layers": mod_cfg.n_layers / m["work_layers"],
            "speedup_pred_flops": d["flops_per_token"] / m["flops_per_token"],
            "speedup_pred_bytes": d["bytes_read_per_step"] / m["bytes_read_per_step"],
            "cache_ratio": m["nbytes_used"] / d["nbytes_used"],
            "cache_pred": sum(m["cached_share"]) / mod_cfg.n_layers,
            "alloc_ratio": m["nbytes_allocated"] / d["nbytes_allocated"],
        }
        r["pass"] = r["speedup"] >= SPEEDUP_BAR and r["cache_ratio"] <= CACHE_BAR
        out[b] = r
    return out


def print_report(
    args: argparse.Namespace,
    rows: dict,
    ratios: dict[int, dict],
    mod_cfg: MoDConfig,
    calib_take: list[float] | None,
    wall: float,
    busy: float | None,
) -> None:
    """The settings line, the take-rates, the speed and ratio tables and the notes."""
    P, N = args.prompt_len, args.new_tokens
    names_r = args.router_names
    src = f"checkpoint={args.checkpoint}" if args.checkpoint else f"preset={args.preset}"
    print(
        f"decode: {src} pattern={mod_cfg.layer_pattern} capacity={mod_cfg.capacity:g} "
        f"skipped_kv={mod_cfg.skipped_kv} "
        f"causal_router={mod_cfg.causal_router} calibrated={args.calibrate} feed={args.feed} "
        f"prompt={P} new={N} device={args.device} dtype={args.dtype} "
        f"threads={torch.get_num_threads()} repeats={args.repeats} warmup={args.warmup} "
        f"({wall:.0f} s)"
    )
    if P + N < MIN_CONTEXT:
        print(f"note: context {P + N} < {MIN_CONTEXT} tokens; the bars are meant for long contexts")
    print(
        f"take-rate per routed layer ({', '.join(names_r) or 'none'}): "
        f"nominal {pct([mod_cfg.capacity] * len(names_r))}"
    )
    if calib_take is not None:
        print(f"  calibration ({args.calib_rows}x{P} random tokens): {pct(calib_take)}")
    for b in args.batch_sizes:
        m = rows["mod", b]
        line = f"  batch {b}: prompt {pct(m['take_prompt'])} | decode {pct(m['take_decode'])}"
        if b > 1:
            line += f" | decode steps where some row took it {pct(m['busy_decode'])}"
        print(line)
    _print_speed_table(args, rows, mod_cfg)
    _print_ratio_table(args, ratios, mod_cfg, len(names_r))
    _print_notes(args, rows, ratios, mod_cfg, busy)


def _print_speed_table(args: argparse.Namespace, rows: dict, mod_cfg: MoDConfig) -> None:
    header = (
        f"{'model':<16} {'batch':>5} {'ms/step':>8} {'tokens/s':>9} {'vs dense':>8} "
        f"{'cache used':>11} {'vs dense':>8} {'allocated':>11} {'take':>6} {'range':>6}"
    )
    print(header)
    print("-" * len(header))
    labels = {"mod": f"MoD {mod_cfg.layer_pattern} c={mod_cfg.capacity:g}", "dense": "dense twin"}
    for b in args.batch_sizes:
        for name in ("mod", "dense"):
            r, d = rows[name, b], rows["dense", b]
            take = statistics.mean(r["take_decode"]) if r["take_decode"] else 1.0
            print(
                f"{labels[name]:<16} {b:>5} {r['ms_per_step']:>8.2f} {r['tokens_per_s']:>9,.0f} "
                f"{r['tokens_per_s'] / d['tokens_per_s']:>7.3f}x "
                f"{fmt_bytes(r['nbytes_used']):>11} {r['nbytes_used'] / d['nbytes_used']:>7.3f}x "
                f"{fmt_bytes(r['nbytes_allocated']):>11} {100 * take:>5.1f}% "
                f"{100 * r['range_rel']:>5.1f}%"
            )
    print()


def _print_ratio_table(
    args: argparse.Namespace, ratios: dict[int, dict], mod_cfg: MoDConfig, n_routers: int
) -> None:
    nominal = [(a + m) / 2 for a, m in layer_shares(mod_cfg, [mod_cfg.capacity] * n_routers)]
    n_layers = mod_cfg.n_layers
    print(
        f"MoD/dense, measured vs predicted at the measured take-rates (nominal at capacity "
        f"{mod_cfg.capacity:g}: speed {n_layers / sum(nominal):.2f}x, cache "
        f"{sum(nominal) / n_layers:.3f}x); bars: speed >= {SPEEDUP_BAR}x, cache <= {CACHE_BAR}x"
    )
    header = (
        f"{'batch':>5} {'speed':>7} {'layers':>7} {'FLOPs':>7} {'bytes':>7} {'/FLOPs':>7} "
        f"{'cache':>7} {'pred.':>7} {'alloc.':>7}  bars"
    )
    print(header)
    print("-" * len(header))
    for b in args.batch_sizes:
        r = ratios[b]
        print(
            f"{b:>5} {r['speedup']:>6.3f}x {r['speedup_pred_layers']:>6.3f}x "
            f"{r['speedup_pred_flops']:>6.3f}x {r['speedup_pred_bytes']:>6.3f}x "
            f"{r['speedup'] / r['speedup_pred_flops']:>7.2f} {r['cache_ratio']:>6.3f}x "
            f"{r['cache_pred']:>6.3f}x {r['alloc_ratio']:>6.3f}x  {'PASS' if r['pass'] else 'FAIL'}"
        )
    print(
        "(speed: measured tokens/s ratio; predicted by layers: a dense layer counts 1, a routed "
        "one its take-rate; FLOPs and bytes: flops.decode_cost (weights and cache read per "
        "step); /FLOPs: measured over FLOPs-predicted. cache: nbytes_used ratio; pred.: from the "
        "layers' cached shares; alloc.: nbytes_allocated ratio)"
    )


def _print_notes(
    args: argparse.Namespace,
    rows: dict,
    ratios: dict[int, dict],
    mod_cfg: MoDConfig,
    busy: float | None,
) -> None:
    for b in args.batch_sizes:
        mean_take = rows["mod", b]["take_decode_mean"]
        if not 0.5 * mod_cfg.capacity <= mean_take <= 2 * mod_cfg.capacity:
            print(
                f"note: at batch {b} the routed layers took {100 * mean_take:.1f}% of the decoded "
                f"tokens, far from the capacity {100 * mod_cfg.capacity:g}%: the ratios say little "
                "about a trained MoD model (untrained routers take about half; a trained one on "
                "out-of-distribution prompts may take almost none)"
            )
    if args.device == "cpu" and busy is not None and busy > 0.1:
        print(
            f"note: other processes kept {100 * busy:.0f}% of the CPUs busy during the run, so "
            "these numbers are noisy"
        )
        if torch.get_num_threads() == 1:
            cpu_t = ", ".join(
                f"batch {b} {ratios[b]['speedup_cpu_time']:.3f}x" for b in args.batch_sizes
            )
            print(
                f"      MoD/dense speed from this process's CPU time instead (not counting time "
                f"the other processes took the CPU from it): {cpu_t}"
            )


def main(argv: Sequence[str] | None = None, json_line: bool = True) -> dict:
    """Run the benchmark, print its tables and (`json_line`) a last line of JSON."""
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    context = args.prompt_len + args.new_tokens
    models, configs = build_models(args, context, device, getattr(torch, args.dtype))
    mod_cfg = configs["mod"]
    args.router_names = router_names(models["mod"])
    runs, calib_take, wall, busy = measure(args, models, device)
    rows = summarise(args, runs, configs)
    ratios = ratios_of(rows, mod_cfg, args.batch_sizes)
    print_report(args, rows, ratios, mod_cfg, calib_take, wall, busy)
    result = {
        "checkpoint": args.checkpoint,
        "preset": None if args.checkpoint else args.preset,
        "layer_pattern": mod_cfg.layer_pattern,
        "capacity": mod_cfg.capacity,
        "skipped_kv": mod_cfg.skipped_kv,
        "causal_router": mod_cfg.causal_router,
        "calibrated": args.calibrate,
        "feed": args.feed,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "device": device.type,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "router_names": args.router_names,
        "calibration_take": calib_take,
        "results": [
            {"model": name, "batch_size": b, **rows[name, b]}
            for b in args.batch_sizes
            for name in models
        ],
        "ratios": [{"batch_size": b, **ratios[b]} for b in args.batch_sizes],
        "speedup_bar": SPEEDUP_BAR,
        "cache_bar": CACHE_BAR,
        "pass": all(r["pass"] for r in ratios.values()),
        "cpu_busy_others": busy,
        "wall_s": wall,
    }
    if json_line:
        print(json_text(result))
    return result


if __name__ == "__main__":
    main()
