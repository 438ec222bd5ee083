"""`mod serve`: an OpenAI-compatible HTTP server for a checkpoint (docs/serving.md).

The server's modules import FastAPI and uvicorn (the `[serve]` extra), so they are imported
inside the handler: `mod --help` and every other command work without the extra.
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import math
import os
import sys
from typing import Any

from ..checks import Range
from ..serve.types import Access, Limits, key_problem, parse_hosts
from .flags import ShowDefaults

EXTRA = "mod serve needs the [serve] extra: pip install -e '.[serve]'"


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="serve a checkpoint over an OpenAI-compatible HTTP API",
        formatter_class=ShowDefaults,
        description="Serve a MoD (or dense) checkpoint: POST /v1/completions (streaming too), "
        "GET /v1/models, /health and /metrics (Prometheus). Requests join the running batch "
        "at the next step; each routed layer's KV cache is paged. SIGTERM stops admitting, "
        "finishes the running requests within --grace seconds, and exits 0.",
    )
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (default: 8000)")
    p.add_argument(
        "--model-name", default="mod", help="the name clients ask for (default: %(default)s)"
    )
    p.add_argument("--device", default="auto", help="auto: cuda if there is one, else cpu")
    p.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="the server's log level",
    )
    _engine_args(p.add_argument_group("batching and the KV cache"))
    _access_args(p.add_argument_group("who may call it"))
    _limit_args(p.add_argument_group("connection limits"))


def _engine_args(p: Any) -> None:
    p.add_argument(
        "--max-rows", type=int, default=16, help="requests decoded at once (default: 16)"
    )
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default: 16)")
    p.add_argument(
        "--kv-pages",
        type=int,
        default=None,
        help="pages per layer's pool (default: enough for --max-rows full contexts)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests waiting for room before 429 (default: 64)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=256,
        help="prompt tokens prefilled per step (default: 256)",
    )
    p.add_argument(
        "--batching",
        choices=("continuous", "static"),
        default="continuous",
        help="continuous: join and leave at every step; static: a full batch run to its "
        "longest row (the baseline) (default: continuous)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="seconds SIGTERM waits for the running requests (default: 30)",
    )


def _access_args(p: Any) -> None:
    p.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="ask every /v1 request for 'Authorization: Bearer KEY' (default: $MOD_API_KEY, "
        "else none; the variable keeps the key out of the process list)",
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        metavar="NAME",
        help="a name the Host header may give besides IP addresses, localhost and --host "
        "(repeat, or comma-separate; * allows any): the check keeps web pages out (DNS "
        "rebinding)",
    )


def _limit_args(p: Any) -> None:
    limits = Limits()
    p.add_argument(
        "--max-connections",
        type=int,
        default=limits.max_connections,
        help="open connections; one more gets a 503 (default: %(default)s)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=limits.header_timeout_s,
        help="seconds a request's headers may take to arrive, else 408 (default: %(default)g)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=limits.body_timeout_s,
        help="seconds a request's body may take after its headers, else 408 (default: %(default)g)",
    )


def _check(args: argparse.Namespace) -> None:
    Range(lo=0, hi=65535, integer=True).check("--port", args.port)
    Range(lo=0).check("--grace (seconds)", args.grace)
    for flag in ("--max-connections", "--max-rows", "--page-size", "--kv-pages"):
        value = getattr(args, flag[2:].replace("-", "_"))
        Range(lo=1, integer=True, optional=flag == "--kv-pages").check(flag, value)
    for flag in ("--header-timeout", "--body-timeout"):
        value = getattr(args, flag[2:].replace("-", "_"))
        Range(lo=0, lo_open=True).check(f"{flag} (seconds)", value)
    if not args.model_name.strip():
        raise ValueError("--model-name must not be empty")
    _api_key(args)
    parse_hosts(args.allowed_host)


def _api_key(args: argparse.Namespace) -> str | None:
    """The key of --api-key, else of $MOD_API_KEY where it is set (even to ""), else None;
    one that could never match a request's header is refused, naming where it came from."""
    if args.api_key is not None:
        key, source = args.api_key, "--api-key"
    elif "MOD_API_KEY" in os.environ:
        key, source = os.environ["MOD_API_KEY"], "MOD_API_KEY"
    else:
        return None
    if problem := key_problem(key):
        raise ValueError(f"{source} {problem}")
    return key


def run(args: argparse.Namespace) -> int:
    _check(args)
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(f"{EXTRA} ({' and '.join(missing)} not installed)")
    from ..data import load_tokenizer
    from ..runtime.checkpoint import load_model, resolve_checkpoint
    from ..runtime.device import resolve_device
    from ..serve.engine import Engine
    from ..serve.server import serve

    device = resolve_device(args.device)
    ckpt = resolve_checkpoint(args.checkpoint)
    model, cfg = load_model(ckpt, map_location=device)
    _check_memory(args, cfg, next(model.parameters()).dtype, device)
    engine = Engine(
        model.eval(),
        load_tokenizer(ckpt),
        model_name=args.model_name,
        max_rows=args.max_rows,
        page_size=args.page_size,
        kv_pages=args.kv_pages,
        max_queue=args.max_queue,
        prefill_chunk=args.prefill_chunk,
        batching=args.batching,
        device=str(device),
    )
    key = _api_key(args)
    access = Access(api_key=key, allowed_hosts=parse_hosts(args.allowed_host), bound=args.host)
    if key is None and not _loopback(args.host):
        print(
            f"mod serve: warning: listening on {args.host} without an API key: anyone who can "
            "reach it can run completions; set MOD_API_KEY (or --api-key)",
            file=sys.stderr,
        )
    limits = Limits(args.max_connections, args.header_timeout, args.body_timeout)
    return serve(
        engine,
        args.host,
        args.port,
        grace_s=args.grace,
        log_level=args.log_level,
        access=access,
        limits=limits,
    )


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _check_memory(args: argparse.Namespace, cfg: Any, dtype: Any, device: Any) -> None:
    """The KV page pools at full size must fit the device's memory: named by the flag that
    sized them (--kv-pages, else --max-rows full contexts)."""
    from ..serve.paged import device_memory, pool_bytes

    per_row = math.ceil(cfg.max_seq_len / args.page_size)
    pages = args.kv_pages if args.kv_pages is not None else args.max_rows * per_row
    need, have = pool_bytes(cfg, pages, args.page_size, dtype), device_memory(device)
    if have is None or need <= have:
        return
    most = have * pages // need
    flag, value, fewer = (
        ("--kv-pages", args.kv_pages, f"--kv-pages {most:,}")
        if args.kv_pages is not None
        else ("--max-rows", args.max_rows, f"--max-rows {most // per_row:,} (or a --kv-pages)")
    )
    raise ValueError(
        f"{flag} {value}: the KV page pools would take {need / 2**30:,.1f} GiB at full size "
        f"({pages:,} pages of {args.page_size} tokens in each of {cfg.n_kv_layers} layers), more "
        f"than the {have / 2**30:,.1f} GiB of memory of {device}; give {fewer} or fewer"
    )
