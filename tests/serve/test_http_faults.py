"""The HTTP layer under faults: a full queue (429 with Retry-After), a draining engine (503), a
client that leaves (its request cancelled), SIGTERM on `mod serve` (the running request
finishes, exit 0), and `mod serve` without the `[serve]` extra (a clear error)."""

from __future__ import annotations

import importlib.util
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from fake_engine import FakeEngine  # noqa: E402
from http_helpers import http_model, open_stream  # noqa: E402

from mixture_of_depths.cli import main  # noqa: E402
from mixture_of_depths.data import ByteTokenizer  # noqa: E402
from mixture_of_depths.runtime.checkpoint import save_checkpoint  # noqa: E402
from mixture_of_depths.serve.server import ServerThread  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    return http_model()


@pytest.fixture()
def slow(model):  # noqa: ANN001, ANN201
    """A stand-in engine that takes 20 ms a token, behind a live server."""
    engine = FakeEngine(model, ByteTokenizer(), step_s=0.02)
    engine.start()
    with ServerThread(engine) as server:
        yield engine, server


def _until(cond, timeout_s: float = 10.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_full_queue_is_429_with_retry_after_and_draining_is_503(slow):  # noqa: ANN001
    engine, server = slow
    url = f"{server.url}/v1/completions"
    engine.full = True
    r = httpx.post(url, json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 429 and r.headers["retry-after"] == "3"  # 2.5 s, rounded up
    assert r.json()["error"]["code"] == "queue_full"
    engine.full = False
    assert httpx.post(url, json={"prompt": "x", "max_tokens": 2}).status_code == 200
    engine.closing = True
    r = httpx.post(url, json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    engine.closing = False


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_has_its_request_cancelled(slow, stream):  # noqa: ANN001
    engine, server = slow
    body = {"prompt": "abc", "max_tokens": 50, "temperature": 0}
    if stream:
        sock = open_stream(server.port, body)
    else:
        sock = httpx.Client(base_url=server.url)
        with pytest.raises(httpx.TimeoutException):  # leaves after 0.2 s, long before 50 tokens
            sock.post("/v1/completions", json=body, timeout=0.2)
    assert _until(lambda: len(engine.running) == 1)
    req = next(iter(engine.running.values()))
    sock.close()
    assert _until(req.cancelled.is_set), "the request of a client that left was not cancelled"
    assert _until(lambda: not engine.running)


def test_serve_without_the_extra_says_how_to_install_it(monkeypatch, capsys, tmp_path):  # noqa: ANN001
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a)
    )
    assert main(["serve", str(tmp_path), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "mod serve needs the [serve] extra: pip install -e '.[serve]'" in err


def _port(proc: subprocess.Popen, timeout_s: float) -> int:
    """The port `mod serve` says it listens on, read from its stderr (bounded)."""
    deadline, seen = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stderr], [], [], 0.1)[0]:
            line = proc.stderr.readline()
            seen += line
            if m := re.search(r"http://127\.0\.0\.1:(\d+)/v1", line):
                return int(m.group(1))
    raise AssertionError(f"mod serve did not say where it listens: {seen}")


def test_sigterm_finishes_the_running_request_and_exits_0(model, tmp_path):  # noqa: ANN001
    ckpt = save_checkpoint(tmp_path / "ck", model, model.config, tokenizer=ByteTokenizer())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mixture_of_depths", "serve", str(ckpt), "--port", "0",
         "--device", "cpu", "--grace", "60", "--log-level", "warning"],
        cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        port = _port(proc, timeout_s=60)
        sock = open_stream(port, {"prompt": "def f(", "max_tokens": 40, "temperature": 0})
        proc.send_signal(signal.SIGTERM)
        got = b""
        sock.settimeout(60)
        while b"data: [DONE]" not in got:
            chunk = sock.recv(65536)
            assert chunk, f"the stream ended before its end: {got[-300:]!r}"
            got += chunk
        sock.close()
        assert b'"finish_reason": "length"' in got or b'"finish_reason": "stop"' in got
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
        said = proc.stderr.read()  # at the end, the take-rates of the tokens it decoded
        assert re.search(r"mod serve: take-rates over the \d+ tokens decoded: L\d", said), said
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_drains_and_exits_0_when_stderr_is_a_closed_pipe(model, tmp_path):  # noqa: ANN001
    """`mod serve ... 2>&1 | head -3`: the reader of stderr has gone when SIGTERM comes, so
    every message the drain prints fails (EPIPE); the drain must happen all the same."""
    ckpt = save_checkpoint(tmp_path / "ck", model, model.config, tokenizer=ByteTokenizer())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mixture_of_depths", "serve", str(ckpt), "--port", "0",
         "--device", "cpu", "--log-level", "warning"],
        cwd=ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        port = _port(proc, timeout_s=60)
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        proc.stderr.close()  # the reader goes away
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_first_signal_drains_and_a_second_stops_at_once(model):  # noqa: ANN001
    """`mod serve`'s signal handling without a process: the first SIGTERM marks the server
    draining (/health 503, new completions refused by the engine) and drains the engine in the
    background, then lets uvicorn close; a second signal forces the exit."""
    import uvicorn

    from mixture_of_depths.serve.app import ServeState, create_app
    from mixture_of_depths.serve.server import DrainingServer

    engine = FakeEngine(model, ByteTokenizer())
    engine.start()
    state = ServeState()
    server = DrainingServer(uvicorn.Config(create_app(engine, state=state)), engine, state, 5.0)
    server.handle_exit(signal.SIGTERM, None)
    assert state.draining  # at once: /health says so before the drain has begun
    assert _until(lambda: server.should_exit) and server.drained is True and engine.closing
    assert not server.force_exit and server._captured_signals == []  # not re-raised at exit
    server.handle_exit(signal.SIGTERM, None)
    assert server.force_exit


@pytest.fixture()
def no_serving(monkeypatch):  # noqa: ANN001, ANN201
    """`mod serve` up to the point of listening: what it would serve with, no socket bound."""
    import mixture_of_depths.serve.server as server

    seen = {}

    def serve(engine, host, port, **kw):  # noqa: ANN001, ANN003, ANN202
        seen.update(kw, engine=engine, host=host)
        return 0

    monkeypatch.setattr(server, "serve", serve)
    return seen


def test_an_api_key_comes_from_the_flag_or_the_environment_and_open_binds_warn(
    model, tmp_path, monkeypatch, capsys, no_serving
):  # noqa: ANN001
    ck = save_checkpoint(tmp_path / "ck", model, model.config, tokenizer=ByteTokenizer())
    ckpt = [str(ck), "--device", "cpu"]
    monkeypatch.delenv("MOD_API_KEY", raising=False)
    assert main(["serve", *ckpt, "--host", "0.0.0.0", "--allowed-host", "a,b", "--allowed-host",
                 "c", "--max-connections", "9", "--header-timeout", "2"]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "warning: listening on 0.0.0.0 without an API key" in err
    access, limits = no_serving["access"], no_serving["limits"]
    assert access.api_key is None and access.allowed_hosts == ("a", "b", "c")
    assert (limits.max_connections, limits.header_timeout_s, limits.body_timeout_s) == (9, 2, 30)
    monkeypatch.setenv("MOD_API_KEY", "from-env")
    assert main(["serve", *ckpt, "--host", "0.0.0.0"]) == 0
    assert no_serving["access"].api_key == "from-env" and "warning" not in capsys.readouterr().err
    assert main(["serve", *ckpt, "--api-key", "from-flag"]) == 0
    assert no_serving["access"].api_key == "from-flag"
    assert main(["serve", *ckpt, "--api-key", " "]) == 2
    assert "--api-key must not be empty" in capsys.readouterr().err
    assert main(["serve", *ckpt, "--page-size", "0"]) == 2  # before any division by it
    assert "error: --page-size must be a positive integer, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--kv-pages", "100000000"], ["--max-rows", "100000000"]])
def test_kv_pools_larger_than_memory_are_refused_by_flag(model, tmp_path, capsys, flags):  # noqa: ANN001
    ckpt = str(save_checkpoint(tmp_path / "ck", model, model.config, tokenizer=ByteTokenizer()))
    assert main(["serve", ckpt, "--port", "0", "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert f"error: {flags[0]} 100000000: the KV page pools would take" in err
    assert "GiB of memory of cpu; give " in err and "Traceback" not in err


@pytest.mark.parametrize(
    "flags, env, says",
    [
        (["--api-key", " "], None, "--api-key must not be empty"),
        (["--api-key", " k3y "], None, "--api-key must not begin or end with whitespace"),
        (["--api-key", "clé-123"], None, "--api-key must be printable ASCII without spaces"),
        (["--api-key", "two words"], None, "--api-key must be printable ASCII without spaces"),
        ([], "", "MOD_API_KEY must not be empty"),
        ([], "  ", "MOD_API_KEY must not be empty"),
        ([], "k3y\n", "MOD_API_KEY must not begin or end with whitespace"),
        (["--allowed-host", "a,gpu-box:8000"], None, "--allowed-host gpu-box:8000: give the name"),
    ],
)  # fmt: skip
def test_a_key_or_host_name_that_could_never_match_is_refused_by_name(
    model, tmp_path, monkeypatch, capsys, no_serving, flags, env, says
):  # noqa: ANN001
    """HTTP headers are latin-1 and their values stripped: a key with whitespace around it or
    beyond ASCII never matches, and the Host check ignores ports; each refused at startup."""
    ck = save_checkpoint(tmp_path / "ck", model, model.config, tokenizer=ByteTokenizer())
    monkeypatch.delenv("MOD_API_KEY", raising=False)
    if env is not None:
        monkeypatch.setenv("MOD_API_KEY", env)
    assert main(["serve", str(ck), "--device", "cpu", *flags]) == 2
    assert f"error: {says}" in capsys.readouterr().err and not no_serving
