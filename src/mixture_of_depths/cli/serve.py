"""`mod serve`: an OpenAI-compatible HTTP server for a checkpoint (docs/serving.md).

The server's modules import FastAPI and uvicorn (the `[serve]` extra), so they are imported
inside the handler: `mod --help` and every other command work without the extra.
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any

from ..checks import Range

EXTRA = "mod serve needs the [serve] extra: pip install -e '.[serve]'"


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="serve a checkpoint over an OpenAI-compatible HTTP API",
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
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
    )


def _check(args: argparse.Namespace) -> None:
    Range(lo=0, hi=65535, integer=True).check("--port", args.port)
    Range(lo=0).check("--grace (seconds)", args.grace)
    if not args.model_name.strip():
        raise ValueError("--model-name must not be empty")


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
    model, _ = load_model(ckpt, map_location=device)
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
    return serve(engine, args.host, args.port, grace_s=args.grace, log_level=args.log_level)
