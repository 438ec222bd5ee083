"""The poison-request test (docs/serving.md, "Faults"): concurrent good requests through the
official client with one request of each kind of bad input thrown in (a tiny temperature, a
lone surrogate, a prompt on which the model's logits turn NaN, a client that leaves in the
middle of its prefill). Every good request completes equal to the reference, each bad one gets
its own answer, and no page leaks."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from http_helpers import http_model, live_server, reference, wait_idle  # noqa: E402

from mixture_of_depths.data import ByteTokenizer  # noqa: E402

TOK = ByteTokenizer()
POISON = 255  # after this byte the model's logits turn NaN (the good requests never feed it)


def nan_after_poison(model) -> None:  # noqa: ANN001
    """The model returns NaN logits after a POISON token (the last of a row's prefill, or a
    decode entry's): a model that breaks on one input, beside rows that do not."""
    real = model.forward

    def forward(idx, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        out = real(idx, *args, **kw)
        lengths = kw.get("lengths")
        last = idx[:, -1] if lengths is None else idx[torch.arange(len(idx)), lengths - 1]
        out.logits[(last == POISON).to(out.logits.device)] = float("nan")
        return out

    model.forward = forward


def _leave_mid_prefill(port: int, prompt: list[int]) -> None:
    """Send a completion with a long prompt and close the connection at once."""
    body = json.dumps({"prompt": prompt, "max_tokens": 3, "temperature": 0}).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + body)
        time.sleep(0.02)


def test_poison_requests_fail_alone_and_every_good_one_equals_the_reference():
    model = http_model()
    good = [[(5 * i + j) % 250 + 1 for j in range(3 + i % 13)] for i in range(16)]
    n_new = [3 + i % 9 for i in range(16)]
    expected = [reference(model, p, n) for p, n in zip(good, n_new, strict=True)]
    greedy_hi = reference(model, TOK.encode("hi"), 6)
    assert all(POISON not in p + e for p, e in zip(good, [*expected, greedy_hi], strict=False))
    nan_after_poison(model)
    with live_server(model, max_rows=4, page_size=4, prefill_chunk=8) as (_, server):
        url = f"{server.url}/v1/completions"
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)

        def ask(i: int) -> list[int]:
            r = c.completions.create(
                model="mod",
                prompt=good[i],
                max_tokens=n_new[i],
                temperature=0,
                extra_body={"return_token_ids": True},
            )
            return r.choices[0].model_extra["token_ids"]

        def bad(kind: str) -> object:
            if kind == "tiny temperature":
                r = c.completions.create(model="mod", prompt="hi", max_tokens=6, temperature=1e-40,
                                         extra_body={"return_token_ids": True})  # fmt: skip
                return r.choices[0].model_extra["token_ids"]
            if kind == "leaves mid-prefill":
                return _leave_mid_prefill(server.port, [7] * 60)
            body = {"prompt": "\ud800" if kind == "surrogate" else [9, 9, POISON],
                    "max_tokens": 4, "stream": kind == "nan stream"}  # fmt: skip
            r = httpx.post(url, content=json.dumps(body), timeout=60,
                           headers={"Content-Type": "application/json"})  # fmt: skip
            return r.status_code, r.text

        kinds = ["tiny temperature", "surrogate", "nan", "nan stream", "leaves mid-prefill"]
        with ThreadPoolExecutor(8) as pool:
            goods = [pool.submit(ask, i) for i in range(len(good))]
            bads = [(k, pool.submit(bad, k)) for k in kinds * 2]
            got = [f.result(120) for f in goods]
            answers = [(k, f.result(120)) for k, f in bads]
        assert got == expected
        for kind, answer in answers:
            if kind == "tiny temperature":
                assert answer == greedy_hi
            elif kind != "leaves mid-prefill":
                status, text = answer
                want = {"surrogate": (400, "prompt", None), "nan": (500, None, "engine_error"),
                        "nan stream": (200, None, "engine_error")}[kind]  # fmt: skip
                error = json.loads(text.removeprefix("data: ").split("\n")[0])["error"]
                assert (status, error["param"], error["code"]) == want, (kind, text)
        m = wait_idle(server.url)
        assert m["mod_requests_running"] == 0 and m["mod_queue_depth"] == 0
        assert all(v == 0 for v in m["mod_kv_pages_in_use"].values()), m["mod_kv_pages_in_use"]
        assert m["mod_http_errors_total"].get("500", 0) >= 1
