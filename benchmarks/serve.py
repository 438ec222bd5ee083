"""Serving under load: MoD beside its dense twin, continuous batching beside a static batch,
each a `mod serve` process driven by a load generator in processes of its own
(docs/serving.md, "Measured").

Every configuration (model x batching) is a server process (`mod serve CKPT --port 0` on
127.0.0.1, ready when /health answers, stopped by SIGTERM, which must exit 0). The load is
open-loop: requests arrive at seeded Poisson times at a given rate (``inf``: all at once,
saturation) whatever the server's pace, each with a prompt length and an output length drawn
from their ranges, streamed with ``ignore_eos``; the schedule depends only on the seed and the
rate, so every configuration and repeat sees the same requests (each run's digest of what its
load processes sent is in the JSON). The load runs in `--clients` processes (serve_load.py), so
the client's per-token work shares no GIL with the engine.

Each configuration x rate is measured `--repeats` times, the configurations interleaved round by
round (the order rotates, so over a multiple of the configurations' count each takes each place
in the order equally often: the first measured after the servers start ran fastest, a bias;
every round starts fresh servers) so drift hits all alike. Reported:
the median and the min-max spread of throughput, TTFT and TPOT (p50, p99) and the KV bytes in
use (mean, and per token held); the ratios MoD / dense and continuous / static computed per
repeat (the same round's runs), their medians and spreads; the model's own decode ratio at the
server's batch size (`bench.decode` on the same checkpoint in each round, or read from a
`mod bench` JSON) and the share of it the server keeps; the issue's targets beside the medians
(printed, never asserted); the share of the CPUs other processes kept busy, per round and in all.
`--profile FILE` then profiles each continuous server's engine steps under a saturated load
(serve_profile.py) and writes the tables there.

    python benchmarks/serve.py MOD_CKPT DENSE_CKPT            # two trained checkpoints
    python benchmarks/serve.py --preset base --max-rows 64     # untrained base models
    python benchmarks/serve.py --quick                         # untrained small ones, short

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import serve_report as rep
import serve_servers as srv
from serve_load import request_key, run_load, schedule_digest, summarise

from mixture_of_depths.bench.common import cpu_snapshot, others_busy
from mixture_of_depths.runtime.checkpoint import load_config

CONFIGS = ("mod/continuous", "dense/continuous", "mod/static", "dense/static")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mod", nargs="?", help="the MoD checkpoint (else --preset, untrained)")
    p.add_argument("dense", nargs="?", help="its dense twin's checkpoint")
    p.add_argument(
        "--preset",
        default="small",
        help="untrained models of this preset when no checkpoints are given (default: small)",
    )
    p.add_argument("--quick", action="store_true", help="untrained small models, a short load")
    p.add_argument(
        "--rates",
        default=None,
        help="requests/s, comma-separated; inf: all at once (default: 1,2,4,8,inf; --quick: 4,inf)",
    )
    p.add_argument("--requests", type=int, default=None, help="per rate (default 64; quick 8)")
    p.add_argument("--prompt-lens", default=None, help="LO:HI tokens (default 16:192; quick 8:32)")
    p.add_argument("--output-lens", default=None, help="LO:HI tokens (default 16:64; quick 4:12)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="which of " + ", ".join(CONFIGS))
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="rounds; each configuration x rate once per round, in a rotating order (default: "
        "the number of configurations, so each is measured once in each place; 0: only --profile)",
    )
    p.add_argument("--clients", type=int, default=2, help="load processes (default 2)")
    p.add_argument("--max-rows", type=int, default=16, help="mod serve --max-rows (default 16)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--kv-pages", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads per server (default 1)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--data",
        default=None,
        help="text the prompts are cut from (default: the "
        "MoD checkpoint run's validation split; untrained models: random ids)",
    )
    p.add_argument(
        "--model-ratio",
        default="measure",
        metavar="measure|none|JSON",
        help="the model's own decode ratio: measured each round (bench.decode on the "
        "MoD checkpoint at the server's batch size and mean context), none, or read "
        "from a `mod bench` (or benchmarks/decode.py) JSON",
    )
    p.add_argument("--decode-repeats", type=int, default=3, help="bench.decode's repeats")
    p.add_argument(
        "--profile",
        nargs="?",
        const="serve-profile.txt",
        default=None,
        metavar="FILE",
        help="profile each continuous server's engine steps under a "
        "saturated load; the tables go to FILE (default serve-profile.txt)",
    )
    p.add_argument("--plot", default=None, metavar="PNG", help="medians against the rate")
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
    if (args.mod is None) != (args.dense is None):
        raise SystemExit("give two checkpoints (MoD and its dense twin), or none (--preset)")
    if q and args.mod is not None:
        raise SystemExit("--quick builds untrained models: give no checkpoints with it")
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
    args.repeats = len(args.configs) if args.repeats is None else args.repeats
    if args.repeats % len(args.configs):
        print(
            f"warning: --repeats {args.repeats} is not a multiple of the {len(args.configs)} "
            "configurations: they do not take each place in the order equally often",
            file=sys.stderr,
        )
    if args.repeats < 0 or (args.repeats == 0 and not args.profile):
        raise SystemExit("--repeats must be >= 1 (0 only with --profile)")
    if args.clients < 1 or args.threads < 1 or args.decode_repeats < 1:
        raise SystemExit("--clients, --threads and --decode-repeats must be >= 1")
    if q:
        args.preset = "small"
    return args


def rate_key(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def workload(args: argparse.Namespace, rate: float, vocab: int, text: list[int] | None) -> list:
    """Seeded by (seed, rate) alone: the same arrivals, prompts and lengths for every
    configuration and repeat; prompts cut from held-out `text` where given, else random ids."""
    rng = random.Random(f"{args.seed}:{rate_key(rate)}")
    t, out = 0.0, []
    for i in range(args.requests):
        n = rng.randint(*args.prompt_lens)
        if text and len(text) > n:
            start = rng.randrange(len(text) - n)
            prompt = text[start : start + n]
        else:
            prompt = [rng.randrange(min(vocab, 256)) for _ in range(n)]
        out.append(
            {"i": i, "at": t, "prompt": prompt, "max_tokens": rng.randint(*args.output_lens)}
        )
        if math.isfinite(rate):
            t += rng.expovariate(rate)
    return out


def describe(arrivals: list[dict]) -> dict[str, Any]:
    """A schedule in the JSON: its digest (as its load processes report theirs), its lengths and
    arrival times, and the token rate it offers (its tokens over its arrival span)."""
    span = max(a["at"] for a in arrivals)
    tokens = sum(a["max_tokens"] for a in arrivals)
    return {
        "digest": schedule_digest([request_key(a) for a in arrivals]),
        "requests": len(arrivals),
        "tokens": tokens,
        "span_s": span,
        "offered_tok_s": tokens / span if span > 0 else math.inf,
        "prompt_lens": [len(a["prompt"]) for a in arrivals],
        "output_lens": [a["max_tokens"] for a in arrivals],
        "arrivals_s": [round(a["at"], 6) for a in arrivals],
    }


def load(
    server: srv.Server, arrivals: list[dict], args: argparse.Namespace, clients: int = 0
) -> dict[str, Any]:
    """One load against `server` from `clients` (default `--clients`) load processes."""
    return run_load(
        server.url,
        arrivals,
        clients or args.clients,
        args.timeout,
        args.page_size,
        args.full_layers[server.name.split("/")[0]],
    )


def warm(server: srv.Server, schedule: list[dict], args: argparse.Namespace) -> None:
    """A few requests at once before measuring (first-call costs, the allocator)."""
    n = min(args.max_rows, len(schedule), 8)
    arrivals = [{**a, "at": 0.0} for a in schedule[:n]]
    load(server, arrivals, args, clients=1)


def _progress(rnd: int, args: argparse.Namespace, name: str, rate: str, r: dict) -> None:
    f = lambda x, s=1.0, d=1: "-" if x is None else f"{x * s:.{d}f}"  # noqa: E731
    print(
        f"  round {rnd + 1}/{args.repeats} {name:17} rate {rate:>5}: "
        f"{f(r['throughput_tok_s'])} tok/s, TTFT {f(r['ttft_p50_s'], 1e3, 0)} / "
        f"{f(r['ttft_p99_s'], 1e3, 0)} ms, TPOT {f(r['tpot_p50_s'], 1e3)} / "
        f"{f(r['tpot_p99_s'], 1e3)} ms, KV/token {f(r['kv_bytes_per_token'], 1 / 1024, 2)} "
        f"KiB, {r['completed']} done, client late <= {f(r['client_late_max_s'], 1e3, 0)} ms",
        file=sys.stderr,
        flush=True,
    )


def run_round(
    rnd: int, args: argparse.Namespace, ckpts: dict, schedules: dict, work: Path, runs: dict
) -> dict[str, Any]:
    """One round: a fresh server per configuration (started together, measured one at a time,
    in an order that rotates every round), every rate; then SIGTERM and their exit statuses."""
    order = args.configs[rnd % len(args.configs) :] + args.configs[: rnd % len(args.configs)]
    servers = [srv.start(name, ckpts[name.split("/")[0]], args, work) for name in order]
    t0 = time.monotonic()
    try:
        for s in servers:
            srv.wait_ready(s)
        print(f"  round {rnd + 1}: servers ready in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        for s in servers:
            warm(s, schedules["inf"], args)
            for rate in args.rates:
                key = rate_key(rate)
                row = {
                    **summarise(load(s, schedules[key], args)),
                    "round": rnd,
                    "server_pid": s.proc.pid,
                    "bench_pid": os.getpid(),
                }
                runs[s.name][key].append(row)
                _progress(rnd, args, s.name, key, row)
            srv.read_take_rate(s)
    finally:
        for s in servers:
            srv.stop(s)
        srv.kill_all(servers)
    for s in servers:
        for rows in runs[s.name].values():
            if rows and rows[-1]["round"] == rnd:
                rows[-1].update(server_exit=s.exit_code, take_rate=s.take_rate)
    return {
        "round": rnd,
        "order": order,
        "server_exits": {s.name: s.exit_code for s in servers},
        "take_rate": {s.name: s.take_rate for s in servers},
    }


def measure(args: argparse.Namespace, ckpts: dict, schedules: dict, work: Path) -> tuple:
    """Every round: the model's own decode ratio (when measured), then the servers. The runs
    per configuration and rate, the model's ratios per round, and each round's record."""
    runs: dict[str, dict[str, list]] = {
        c: {rate_key(r): [] for r in args.rates} for c in args.configs
    }
    both = {"mod/continuous", "dense/continuous"} <= set(args.configs)
    model: list[dict] | dict | None = None
    if args.model_ratio not in ("measure", "none") and both:
        model = srv.read_model_ratio(args.model_ratio)
    elif args.model_ratio == "measure" and both:
        model = []
    prompt = round(statistics.fmean(args.prompt_lens))
    new = round(statistics.fmean(args.output_lens))
    rounds = []
    for rnd in range(args.repeats):
        snap, t0 = cpu_snapshot(), time.monotonic()
        if isinstance(model, list):
            batches = sorted({1, args.max_rows})
            model.append(srv.measure_model_ratio(ckpts["mod"], batches, prompt, new, args))
            model[-1]["seconds"] = time.monotonic() - t0
        t1 = time.monotonic()
        record = run_round(rnd, args, ckpts, schedules, work, runs)
        record.update(seconds=time.monotonic() - t1, others_busy=others_busy(snap, cpu_snapshot()))
        rounds.append(record)
        print(f"  round {rnd + 1}/{args.repeats}: {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return runs, model, rounds


def profile(args: argparse.Namespace, ckpts: dict, schedules: dict, work: Path) -> dict:
    """Each continuous configuration's server under serve_profile.py: warmed up, then SIGUSR1
    around one saturated load (the profile's window), SIGTERM, and its record."""
    out = {}
    for name in [c for c in args.configs if c.endswith("/continuous")]:
        path = work / f"{name.split('/')[0]}-profile.json"
        s = srv.start(name, ckpts[name.split("/")[0]], args, work, profile_json=path)
        try:
            srv.wait_ready(s)
            warm(s, schedules["inf"], args)
            s.proc.send_signal(signal.SIGUSR1)
            time.sleep(0.3)  # the handler runs between the server's bytecodes: let it
            done = load(s, schedules["inf"], args)
            s.proc.send_signal(signal.SIGUSR1)
            time.sleep(0.3)
        finally:
            srv.stop(s)
            srv.kill_all([s])
        if s.exit_code != 0 or not path.exists():
            raise RuntimeError(f"the profiled {name} server exited {s.exit_code}")
        out[name] = {
            **json.loads(path.read_text()),
            "load": summarise(done),
            "server_exit": s.exit_code,
        }
    return out


def prepare(args: argparse.Namespace, work: Path) -> tuple[dict[str, str], str | None, list | None]:
    """The checkpoints served (given, or the preset's untrained ones saved), the preset they
    are (for the targets), and the held-out text prompts are cut from (None: random ids)."""
    if args.mod is None:
        ckpts = srv.untrained_checkpoints(args.preset, args.seed, work)
        return ckpts, args.preset, None
    if load_config(args.dense).routed_layers:
        raise SystemExit(f"{args.dense} has routed layers: the second checkpoint must be dense")
    ckpts = {"mod": args.mod, "dense": args.dense}
    return ckpts, srv.preset_of(args.mod), srv.held_out_text(args.mod, args.data)


def print_head(args: argparse.Namespace, ckpts: dict, preset: str | None) -> None:
    src = (
        f"untrained {args.preset} preset, random prompts"
        if args.mod is None
        else f"{args.mod} and {args.dense}, prompts cut from held-out text"
    )
    (p_lo, p_hi), (o_lo, o_hi) = args.prompt_lens, args.output_lens
    print(
        f"serving under load: {src}; {args.requests} requests per rate, prompts {p_lo}-{p_hi}, "
        f"outputs {o_lo}-{o_hi} tokens, max_rows {args.max_rows}, page {args.page_size}, "
        f"device {args.device}, {args.threads} torch thread(s) per server, {args.clients} load "
        f"processes, {args.repeats} repeats (preset for the targets: {preset or 'unknown'})"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    before = cpu_snapshot()
    with tempfile.TemporaryDirectory(prefix="mod-serve-bench-") as tmp:
        work = Path(tmp)
        ckpts, preset, text = prepare(args, work)
        cfg = load_config(ckpts["mod"])
        vocab = cfg.vocab_size
        args.full_layers = {  # the layers that cache every token: a consistent read has
            "mod": [i for i in range(cfg.n_layers) if i not in cfg.routed_layers],  # equal pages
            "dense": list(range(load_config(ckpts["dense"]).n_layers)),
        }
        rates = sorted(set(args.rates) | {math.inf})  # inf: warm-up and profile
        schedules = {rate_key(r): workload(args, r, vocab, text) for r in rates}
        print_head(args, ckpts, preset)
        runs, model, rounds = measure(args, ckpts, schedules, work)
        profiles = profile(args, ckpts, schedules, work) if args.profile else None
    busy = others_busy(before, cpu_snapshot())
    out = report(args, runs, model, rounds, schedules, preset, busy)
    if profiles:
        head = (
            f"{args.requests} requests at once, max_rows {args.max_rows}, prompts "
            f"{args.prompt_lens}, outputs {args.output_lens}, {args.threads} torch thread(s)"
        )
        Path(args.profile).parent.mkdir(parents=True, exist_ok=True)
        Path(args.profile).write_text(rep.profile_text(profiles, head, top=40))
        print("\n" + rep.profile_text(profiles, head, top=10), end="")
        print(f"(the whole profile: {args.profile})")
        out.update(profile=profiles, profile_file=args.profile)
    print(json.dumps(out))
    exits = [r["server_exits"] for r in rounds] + [
        {n: p["server_exit"]} for n, p in (profiles or {}).items()
    ]
    if any(code != 0 for e in exits for code in e.values()):
        print("a server did not exit 0 after SIGTERM (its log is above)", file=sys.stderr)
        sys.exit(1)
    return out


def report(
    args: argparse.Namespace,
    runs: dict,
    model: Any,
    rounds: list,
    schedules: dict,
    preset: str | None,
    busy: float | None,
) -> dict[str, Any]:
    """Print the tables, the targets and what else ran; the JSON object."""
    keys = [rate_key(r) for r in args.rates]
    sched = {k: describe(schedules[k]) for k in keys}
    if not args.repeats:
        return {"settings": _settings(args), "schedule": sched, "others_busy_share": busy}
    results = rep.aggregate(runs)
    rat = rep.ratios(runs)
    keep = rep.keeps(runs, model, args.max_rows)
    offered = {k: s["offered_tok_s"] for k, s in sched.items()}
    targets = rep.targets(results, rat, keep, offered, preset, args.max_rows)
    rep.print_tables(results, rat, keys, args.repeats)
    rep.print_targets(targets, keep)
    per_round = ", ".join(
        "-" if r["others_busy"] is None else f"{r['others_busy']:.0%}" for r in rounds
    )
    total = "-" if busy is None else f"{busy:.0%}"
    print(f"\nother processes kept {total} of the CPUs busy during the run (by round: {per_round})")
    if args.plot:
        rep.plot(results, args.plot)
        print(f"plot: {args.plot}")
    return {
        "settings": _settings(args),
        "preset": preset,
        "checkpoints": [args.mod, args.dense],
        "schedule": sched,
        "runs": runs,
        "results": results,
        "ratios": rat,
        "model_decode": model,
        "keeps": keep,
        "targets": targets,
        "rounds": rounds,
        "others_busy_share": busy,
        "spread": "min-max over the repeats",
        "bench_pid": os.getpid(),
    }


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    settings = {k: v for k, v in vars(args).items() if k not in ("mod", "dense", "full_layers")}
    settings["rates"] = [rate_key(r) for r in args.rates]
    return settings


if __name__ == "__main__":
    main()
