"""The load generator of benchmarks/serve.py, in processes of its own (docs/serving.md, "Measured").

The server under test must not share a process (nor a GIL) with its client: each token's client
work (httpx, SSE parsing, JSON) would otherwise take turns with the engine and pull every ratio
toward 1. `run_load` starts `clients` processes of this script, each driving every `clients`-th
request of one open-loop schedule, and merges the per-request timings they send back.

A load process (``python serve_load.py URL TIMEOUT``) imports neither torch nor the library:

1. it prints ``{"ready": PID}`` once httpx is imported;
2. it reads one JSON line from stdin: ``{"t0": T, "requests": [{"i", "at", "prompt",
   "max_tokens"}, ...]}``, T on the system-wide monotonic clock (CLOCK_MONOTONIC on Linux, the
   same in every process), each request sent at T + at whatever the server's pace;
3. it prints one JSON line: its PID, its CPU seconds and a record per request (status, tokens
   received, time to first token, time per output token, completion time after T, and how late
   it was sent: a late client would make the load closed-loop).

The parent polls /metrics meanwhile (KV bytes and pages in use) from its own process.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import select
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve()
READY_S = 60.0  # a load process must be up (httpx imported) within this


# -- a load process ---------------------------------------------------------------------------
def request_key(req: dict) -> list:
    """What identifies a request of the schedule: its index, arrival time, prompt (by digest)
    and output length; equal keys across configurations mean they saw the same requests."""
    prompt = hashlib.sha1(json.dumps(req["prompt"]).encode()).hexdigest()[:16]
    return [req["i"], round(req["at"], 6), len(req["prompt"]), req["max_tokens"], prompt]


def schedule_digest(keys: list[list]) -> str:
    """One digest of a schedule's request keys (in index order)."""
    return hashlib.sha256(json.dumps(sorted(keys)).encode()).hexdigest()[:16]


async def _one(http: httpx.AsyncClient, req: dict, t0: float, timeout: float) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, t0 + req["at"] - time.monotonic()))
    body = {
        "prompt": req["prompt"],
        "max_tokens": req["max_tokens"],
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    sent = time.monotonic()
    rec: dict[str, Any] = {
        "i": req["i"],
        "late_s": sent - (t0 + req["at"]),
        "tokens": 0,
        "ttft_s": None,
        "tpot_s": None,
        "done_s": None,
        "sent": request_key(req),
    }
    times: list[float] = []
    try:
        async with http.stream("POST", "/v1/completions", json=body, timeout=timeout) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                await r.aread()
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    times += [time.monotonic()] * len(choice.get("token_ids", []))
    except httpx.HTTPError as exc:
        rec["status"], rec["error"] = 0, repr(exc)
        return rec
    rec.update(tokens=len(times), done_s=time.monotonic() - t0)
    if times:
        rec["ttft_s"] = times[0] - sent
        if len(times) > 1:
            rec["tpot_s"] = (times[-1] - times[0]) / (len(times) - 1)
    return rec


async def _drive(url: str, job: dict, timeout: float) -> list[dict[str, Any]]:
    n = len(job["requests"])
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as http:
        return await asyncio.gather(*(_one(http, r, job["t0"], timeout) for r in job["requests"]))


def worker_main(argv: list[str]) -> None:
    url, timeout = argv[0], float(argv[1])
    print(json.dumps({"ready": os.getpid()}), flush=True)
    job = json.loads(sys.stdin.readline())
    cpu0 = time.process_time()
    records = asyncio.run(_drive(url, job, timeout))
    out = {"pid": os.getpid(), "cpu_s": time.process_time() - cpu0, "records": records}
    print(json.dumps(out), flush=True)


# -- the parent's side ------------------------------------------------------------------------
class KVPoller(threading.Thread):
    """/metrics every `every` seconds while some request runs: KV bytes in use, and the tokens
    held: the pages of a layer that caches every token (`full`: the dense layers) times the page
    size. A scrape can land inside a forward, when the first layers have placed a step's new
    pages and the later ones not yet; such a sample (its full layers' pages differ) counts for
    the bytes in use but not for the bytes per token, whose two sides would disagree."""

    def __init__(self, url: str, page_size: int, full: list[int], every: float = 0.1) -> None:
        super().__init__(daemon=True, name="kv-poller")
        self.url, self.page_size, self.every = url, page_size, every
        self.full = [str(i) for i in full]
        self.samples: list[tuple[float, float | None]] = []  # (bytes in use, tokens held)
        self.stop = threading.Event()

    def run(self) -> None:
        from mixture_of_depths.serve.metrics import parse_prometheus

        with httpx.Client(base_url=self.url, timeout=10.0) as http:
            while not self.stop.wait(self.every):
                try:
                    m = parse_prometheus(http.get("/metrics").text)
                except httpx.HTTPError:
                    continue
                if m.get("mod_requests_running", 0) > 0:
                    pages = m.get("mod_kv_pages_in_use") or {}
                    full = [pages[i] for i in self.full if i in pages] or list(pages.values())
                    held = full[0] * self.page_size if len(set(full)) == 1 else None
                    self.samples.append((float(m.get("mod_kv_bytes_in_use", 0.0)), held))


def _start(url: str, timeout: float, n: int) -> list[subprocess.Popen]:
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE), url, str(timeout)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    deadline = time.monotonic() + READY_S
    for p in procs:  # each says it is ready within the deadline, or none is used
        up = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]
        line = p.stdout.readline() if up else ""
        if not line.startswith('{"ready"'):
            for q in procs:
                q.kill()
            raise RuntimeError(f"a load process did not start (said {line!r})")
    return procs


def run_load(
    url: str, arrivals: list[dict], clients: int, timeout: float, page_size: int, full: list[int]
) -> dict[str, Any]:
    """Drive `arrivals` ({"i", "at", "prompt", "max_tokens"}) against `url` from `clients`
    processes (request i from process i % clients): the merged records, the load processes'
    PIDs and CPU seconds, and the KV samples (`full`: the layers that cache every token)."""
    clients = max(1, min(clients, len(arrivals)))
    procs = _start(url, timeout, clients)
    poller = KVPoller(url, page_size, full)
    t0 = time.monotonic() + 0.2  # every process has its job before the first arrival
    for k, p in enumerate(procs):
        p.stdin.write(json.dumps({"t0": t0, "requests": arrivals[k::clients]}) + "\n")
        p.stdin.flush()  # communicate() closes it
    poller.start()
    span = max((a["at"] for a in arrivals), default=0.0)
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=span + timeout + 30)
            if p.returncode != 0:
                raise RuntimeError(f"a load process exited {p.returncode}")
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        poller.stop.set()
        poller.join(5.0)
        for p in procs:
            if p.poll() is None:
                p.kill()
    records = sorted((r for o in outs for r in o["records"]), key=lambda r: r["i"])
    return {
        "records": records,
        "pids": [o["pid"] for o in outs],
        "cpu_s": sum(o["cpu_s"] for o in outs),
        "kv": poller.samples,
    }


def pct(xs: list[float], q: float) -> float | None:
    """The q-quantile by rank (nearest rank above), None for no values."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def summarise(load: dict[str, Any]) -> dict[str, Any]:
    """One run's figures: throughput (tokens over first arrival to last completion), TTFT and
    TPOT p50/p99, KV bytes in use (mean, peak) and per token held, and the client's lateness."""
    records, kv = load["records"], load["kv"]
    ok = [r for r in records if r["status"] == 200]
    wall = max((r["done_s"] for r in ok if r["done_s"] is not None), default=0.0)
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    tpot = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    kv_bytes = [b for b, _ in kv]
    whole = [(b, h) for b, h in kv if h]  # samples between forwards (see KVPoller)
    held = sum(h for _, h in whole)
    return {
        "completed": len(ok),
        "rejected": len(records) - len(ok),
        "tokens": tokens,
        "tokens_per_request": [r["tokens"] for r in records],
        "seconds": wall,
        "throughput_tok_s": tokens / wall if wall > 0 else None,
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p99_s": pct(ttft, 0.99),
        "tpot_p50_s": pct(tpot, 0.5),
        "tpot_p99_s": pct(tpot, 0.99),
        "kv_bytes_mean": statistics.fmean(kv_bytes) if kv_bytes else None,
        "kv_bytes_peak": max(kv_bytes) if kv_bytes else None,
        "kv_bytes_per_token": sum(b for b, _ in whole) / held if held else None,
        "kv_samples": len(kv),
        "kv_samples_between_forwards": len(whole),
        "client_late_max_s": max((r["late_s"] for r in records), default=None),
        "schedule_digest": schedule_digest([r["sent"] for r in records]),
        "load_pids": load["pids"],
        "load_cpu_s": load["cpu_s"],
    }


if __name__ == "__main__":
    worker_main(sys.argv[1:])
