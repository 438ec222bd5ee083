"""A live server for the HTTP tests: a tiny float64 model with the byte tokenizer (greedy
comparisons end in an argmax: float64 keeps them off ties), its engine, uvicorn in a thread on a
free port, and raw-socket helpers for what the `openai` client cannot do (drop a stream)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import torch
from helpers import make_model, tiny_config

from mixture_of_depths import MoDTransformer
from mixture_of_depths.data import ByteTokenizer
from mixture_of_depths.generate import generate_reference
from mixture_of_depths.serve.engine import Engine
from mixture_of_depths.serve.metrics import parse_prometheus
from mixture_of_depths.serve.server import ServerThread

VOCAB = 257  # the byte tokenizer's: 256 bytes and end-of-text
MAX_LEN = 64


def http_model(seed: int = 0) -> MoDTransformer:
    cfg = tiny_config(vocab_size=VOCAB, max_seq_len=MAX_LEN)
    calib = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(5))
    return make_model(cfg, seed, torch.float64, take=0.5, calib_idx=calib)


@contextmanager
def live_server(model: MoDTransformer, **engine_kw) -> Iterator[tuple[Engine, ServerThread]]:
    """The real engine behind a live server; both shut down however the test ends."""
    engine = Engine(model, ByteTokenizer(), **engine_kw)
    engine.start()
    server = ServerThread(engine)
    try:
        server.start()
        yield engine, server
    finally:
        server.stop()
        engine.drain(5.0)


def reference(model: MoDTransformer, prompt: list[int], n: int, eos: bool = True) -> list[int]:
    """The oracle: greedy, no cache, this prompt alone; the final end-of-text dropped (it ends
    the completion and has no text)."""
    eot = ByteTokenizer.eot_id
    toks = generate_reference(model, [prompt], n, eos_id=eot if eos else None).tokens[0]
    return toks[:-1] if eos and toks and toks[-1] == eot else toks


def metrics(url: str) -> dict:
    r = httpx.get(f"{url}/metrics", timeout=10)
    r.raise_for_status()
    return parse_prometheus(r.text)


def wait_idle(url: str, timeout_s: float = 20.0) -> dict:
    """/metrics once no request runs or waits (bounded): what it then says."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(url)
        busy = m.get("mod_requests_running", 0) + m.get("mod_queue_depth", 0)
        if busy == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def open_stream(port: int, body: dict, timeout_s: float = 10.0) -> socket.socket:
    """A raw HTTP/1.1 streaming completion, read up to its first event; the socket is left
    open for the caller to drop."""
    payload = json.dumps({**body, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock.sendall(head + payload)
    got = b""
    while b"data: " not in got:
        chunk = sock.recv(4096)
        if not chunk:
            raise AssertionError(f"the server closed the stream before an event: {got!r}")
        got += chunk
    assert got.startswith(b"HTTP/1.1 200"), got[:200]
    return sock
