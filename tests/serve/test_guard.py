"""Access and limits (docs/serving.md, "Access and limits"): slow or silent connections time out
with a 408, connections past the cap get a 503 before a byte is read, a completion that runs
long is never cut, the Host header and the Content-Type are checked, and with an API key every
/v1 route asks for it (401 otherwise; the key is never logged). Every socket here is on
127.0.0.1 and every wait is bounded."""

from __future__ import annotations

import json
import logging
import socket
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from fake_engine import FakeEngine  # noqa: E402
from http_helpers import http_model  # noqa: E402

from mixture_of_depths.data import ByteTokenizer  # noqa: E402
from mixture_of_depths.serve.server import ServerThread  # noqa: E402
from mixture_of_depths.serve.types import Access, Limits  # noqa: E402

FAST = Limits(max_connections=6, header_timeout_s=0.6, body_timeout_s=0.6)
KEY = "s3cret-key-0123"


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    return http_model()


def _server(model, limits: Limits = FAST, step_s: float = 0.0, **app_kw) -> ServerThread:  # noqa: ANN001
    engine = FakeEngine(model, ByteTokenizer(), step_s=step_s)
    engine.start()
    return ServerThread(engine, limits=limits, **app_kw)


def _read_all(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """What the server sends until it closes the connection (bounded), and when it closed."""
    t0, got = time.monotonic(), b""
    sock.settimeout(timeout_s)
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except TimeoutError:
        raise AssertionError(f"still open after {timeout_s} s: {got!r}") from None
    return got, time.monotonic() - t0


def _trickle(port: int, data: bytes, every_s: float, first: int = 0) -> tuple[bytes, float]:
    """Send `data`'s `first` bytes, then one every `every_s` seconds until the server closes;
    its answer."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    t0 = time.monotonic()
    with sock:
        for i, j in zip([0, *range(first, len(data))], range(first, len(data) + 1), strict=True):
            try:
                sock.sendall(data[i:j])
            except OSError:  # closed under us: read what it said
                break
            time.sleep(every_s)
            if time.monotonic() - t0 > 10:
                raise AssertionError("the server let a trickling request run 10 s")
        got, _ = _read_all(sock, 5)
    return got, time.monotonic() - t0


def test_silent_and_slow_connections_get_408_and_are_closed(model):  # noqa: ANN001
    with _server(model) as server:
        silent = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        with silent:
            got, waited = _read_all(silent, 5)
        assert got.startswith(b"HTTP/1.1 408") and b"headers did not arrive" in got, got
        assert 0.5 <= waited < 3
        body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        got, _ = _trickle(server.port, head, every_s=0.1)  # headers at 10 bytes/s
        assert got.startswith(b"HTTP/1.1 408") and b"headers" in got, got
        got, _ = _trickle(server.port, head + body, every_s=0.1, first=len(head))
        assert got.startswith(b"HTTP/1.1 408") and b"body did not arrive" in got, got
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200  # a request at the speed of a client is untouched
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as kept:
            kept.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            first = b""
            while not first.endswith(b"}"):  # the whole first response
                chunk = kept.recv(4096)
                assert chunk, first
                first += chunk
            assert first.startswith(b"HTTP/1.1 200")
            kept.sendall(b"GET /health HTTP/1.1\r\n")  # a second request, stalled
            got, _ = _read_all(kept, 5)
        assert got.startswith(b"HTTP/1.1 408") and b"headers" in got, got
        assert server.state.errors[408] == 4


def test_a_completion_longer_than_the_timeouts_is_not_cut(model):  # noqa: ANN001
    with _server(model, step_s=0.05) as server:  # 30 tokens: 1.5 s, past both timeouts
        body = {"prompt": "ab", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 30
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                          timeout=30) as s:  # fmt: skip
            assert "data: [DONE]" in "".join(s.iter_text())


def test_connections_past_the_cap_get_503_before_a_byte_is_read(model):  # noqa: ANN001
    limits = Limits(max_connections=4, header_timeout_s=20, body_timeout_s=20)
    with _server(model, limits) as server:
        held = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(4)]
        try:
            for s in held:
                s.sendall(b"GET /health HTTP/1.1\r\n")  # half a request: they stay open
            time.sleep(0.2)
            extra = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            with extra:
                got, waited = _read_all(extra, 5)
            assert got.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in got.lower(), got
            assert b"too_many_connections" in got and waited < 2
        finally:
            for s in held:
                s.close()
        deadline = time.monotonic() + 10
        while httpx.get(f"{server.url}/health").status_code != 200:  # room again once closed
            assert time.monotonic() < deadline
            time.sleep(0.05)


@pytest.mark.parametrize(
    "host, ok",
    [("127.0.0.1:{port}", True), ("localhost:{port}", True), ("[::1]:{port}", True),
     ("10.1.2.3", True), ("gpu-box:{port}", True), ("evil.example:{port}", False),
     ("127.0.0.1.evil.example", False), ("localhost.evil.example:{port}", False)],
)  # fmt: skip
def test_the_host_header_must_name_this_server(model, host, ok):  # noqa: ANN001
    access = Access(allowed_hosts=("gpu-box",), bound="127.0.0.1")
    with _server(model, access=access) as server:
        for path in ("/health", "/metrics", "/v1/models"):
            r = httpx.get(f"{server.url}{path}", headers={"Host": host.format(port=server.port)})
            assert (r.status_code == 200) == ok, (path, r.text)
            if not ok:
                assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"


def test_any_host_with_a_star(model):  # noqa: ANN001
    with _server(model, access=Access(allowed_hosts=("*",))) as server:
        assert (
            httpx.get(f"{server.url}/health", headers={"Host": "evil.example"}).status_code == 200
        )


def test_a_completion_must_be_declared_json(model):  # noqa: ANN001
    with _server(model) as server:
        url, body = f"{server.url}/v1/completions", json.dumps({"prompt": "x", "max_tokens": 2})
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                      None):  # fmt: skip
            headers = {} if ctype is None else {"Content-Type": ctype}
            r = httpx.post(url, content=body, headers=headers)
            assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
        r = httpx.post(
            url, content=body, headers={"Content-Type": "application/json; charset=utf-8"}
        )
        assert r.status_code == 200


def test_an_api_key_guards_every_v1_route_and_is_never_logged(model, caplog):  # noqa: ANN001
    caplog.set_level(logging.DEBUG)
    with _server(model, access=Access(api_key=KEY)) as server:
        url = server.url
        for auth in (None, "Bearer wrong", f"Basic {KEY}", KEY, "Bearer"):
            headers = {} if auth is None else {"Authorization": auth}
            for path in ("/v1/models", "/v1/completions", "/v1/nothing"):
                r = httpx.post(f"{url}{path}", headers=headers, json={"prompt": "x"})
                assert r.status_code == 401, (auth, path)
                assert r.headers["www-authenticate"] == "Bearer"
                assert r.json()["error"]["code"] == "invalid_api_key" and KEY not in r.text
        assert httpx.get(f"{url}/health").status_code == 200  # no key: probes and scrapers
        assert httpx.get(f"{url}/metrics").status_code == 200
        good = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        assert good.completions.create(model="mod", prompt="x", max_tokens=2).usage
        bad = openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    assert KEY not in caplog.text


def _answer(sock: socket.socket) -> bytes:
    """One whole response from a kept-alive connection: its headers and its body (by
    Content-Length, or chunked to its last chunk)."""
    got = b""
    while True:
        head, ended, body = got.partition(b"\r\n\r\n")
        if ended:
            if b"transfer-encoding: chunked" in head.lower():
                if body.endswith(b"0\r\n\r\n"):
                    return got
            elif len(body) >= int(head.lower().partition(b"content-length: ")[2].split()[0]):
                return got
        chunk = sock.recv(4096)
        assert chunk, got
        got += chunk


def test_a_body_sent_after_an_early_answer_leaves_an_idle_connection_silent(model):  # noqa: ANN001
    """The app answers 401 before reading the body; the body comes afterwards: the connection
    is idle and kept alive, so no header timer runs on it (no unsolicited 408, which a pooled
    client would read as the answer to its next request), only the keep-alive's close."""
    limits = Limits(max_connections=6, header_timeout_s=0.3, body_timeout_s=0.3, keep_alive_s=2)
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer wrong\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with _server(model, limits, access=Access(api_key=KEY)) as server:
        for then_ask in (True, False):
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
                sock.sendall(head)
                assert _answer(sock).startswith(b"HTTP/1.1 401")
                sock.sendall(body)
                if then_ask:  # past the header timeout: nothing came, the connection still serves
                    sock.settimeout(1.0)
                    try:
                        unasked = sock.recv(4096)
                    except TimeoutError:
                        unasked = b""
                    assert unasked == b"", unasked
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                    sock.settimeout(5)
                    assert _answer(sock).startswith(b"HTTP/1.1 200")
                else:  # left idle: closed by the keep-alive timer, saying nothing
                    got, waited = _read_all(sock, 5)
                    assert got == b"" and waited >= 1.5, (got, waited)
        assert server.state.errors[408] == 0


@pytest.mark.parametrize(
    "host, ok",
    [("::1", True), ("[::1]", True), ("[::1]:8000", True), ("[::1", False), ("[::1]x", False),
     ("[gpu-box]", False), ("[::1]:80a", False), ("gpu-box:8000", True), ("gpu-box:x", False),
     ("GPU-box.", True), ("10.0.0.1:8000", True)],
)  # fmt: skip
def test_host_values_are_parsed_strictly(host, ok):
    assert Access(allowed_hosts=("gpu-box",)).host_allowed(host) == ok


@pytest.mark.parametrize(
    "kw, says",
    [(dict(api_key=""), "api_key must not be empty"),
     (dict(api_key="k "), "api_key must not begin or end with whitespace"),
     (dict(api_key="ключ"), "api_key must be printable ASCII"),
     (dict(allowed_hosts=("gpu-box:8000",)), "allowed_hosts gpu-box:8000: give the name")],
)  # fmt: skip
def test_access_refuses_what_could_never_match(kw, says):
    with pytest.raises(ValueError, match=says):
        Access(**kw)


def test_a_body_timeout_is_counted_once(model):  # noqa: ANN001
    with _server(model) as server:
        body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        got, _ = _trickle(server.port, head + body, every_s=0.1, first=len(head))
        assert got.startswith(b"HTTP/1.1 408") and b"body did not arrive" in got, got
        time.sleep(0.5)  # the app has seen the connection close
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert dict(server.state.errors) == {408: 1}
