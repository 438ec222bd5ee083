"""What keeps one client from hurting the others, and a web page from reaching the server
(docs/serving.md, "Access and limits").

`protocol(limits)` (`types.Limits`): uvicorn's h11 protocol with a cap on open connections (one past
it gets a 503 and is closed before a byte is read) and two read timeouts uvicorn lacks: a
request's headers must arrive within `header_timeout_s` of its first byte (of the connection,
for a new one), its body within `body_timeout_s` of its headers, else a 408 and the connection
closes. Idle keep-alive connections close after `keep_alive_s` (uvicorn's own timer), silently:
no header timer runs without a byte of a next request. Once a request has been read, nothing
here times it out: a completion streams for as long as it runs.

`Guard` (`types.Access`): an ASGI middleware in front of the app. The `Host` header must
name an IP address, `localhost`, the address the server listens on, or a name allowed by
`--allowed-host` (`*`: any), so a DNS-rebinding page (its own name, pointed at 127.0.0.1)
cannot read answers or /metrics; with an API key every `/v1` route asks for
`Authorization: Bearer KEY` (compared in constant time, never logged) and answers 401 otherwise.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Awaitable, Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .types import Access, Limits

ASGIApp = Callable[[dict, Callable, Callable], Awaitable[None]]
# Set in a request's ASGI scope when its body timed out: the 408 is counted (and sent) here,
# so the app does not count its own 499 for the disconnect it then sees (app.py).
TIMED_OUT = "mod.body_timed_out"


def _raw(status: int, reason: str, message: str, code: str, extra: str = "") -> bytes:
    """A whole HTTP response (OpenAI's error JSON) written before or instead of the app's."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": None, "code": code}}).encode()  # fmt: skip
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"{extra}content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the connection cap and the read timeouts of `Limits`."""

    limits = Limits()
    errors: Counter = Counter()  # the app's error counts by status, for /metrics
    _timer: asyncio.TimerHandle | None = None
    _phase: str | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.errors[503] += 1
            msg = f"the server holds {self.limits.max_connections} connections: retry later"
            transport.write(_raw(503, "Service Unavailable", msg, "too_many_connections",
                                 "retry-after: 1\r\n"))  # fmt: skip
            transport.close()
            return
        self._arm("headers")  # a new connection's first request: timed from its first byte

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None)
        super().connection_lost(exc)

    def _watch(self) -> None:
        """Time the part of a request being read: its headers once a byte of them is here (a
        pipelined request's, or one arriving), then its body. An idle keep-alive connection
        is uvicorn's to close: also after a body read once the app had answered (a 401 or 413
        before reading it), where uvicorn stopped its keep-alive timer on the read."""
        state = self.conn.their_state
        if state is h11.IDLE:
            waiting = bool(self.conn.trailing_data[0])  # bytes of a next request, buffered
            self._arm("headers" if waiting else None)
            if not waiting and self.timeout_keep_alive_task is None:
                self._keep_alive()
        else:
            self._arm("body" if state is h11.SEND_BODY else None)

    def _keep_alive(self) -> None:
        """(Re)start uvicorn's keep-alive timer on an idle connection."""
        if not self.transport.is_closing():
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def _arm(self, phase: str | None) -> None:
        """Start the timer of `phase` unless it runs already (its deadline stays)."""
        if phase == self._phase:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._phase, self._timer = phase, None
        if phase is not None and not self.transport.is_closing():
            lim = self.limits
            wait = lim.header_timeout_s if phase == "headers" else lim.body_timeout_s
            self._timer = self.loop.call_later(wait, self._expired, phase, wait)

    def _expired(self, phase: str, wait: float) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if phase == "headers" or not self.cycle.response_started:  # nothing sent: say why
            self.errors[408] += 1
            if phase == "body":  # counted here: the app, reading the body, sees a disconnect
                self.cycle.scope[TIMED_OUT] = True  # type: ignore[typeddict-unknown-key]
            msg = f"the request's {phase} did not arrive within {wait:g} s"
            self.transport.write(_raw(408, "Request Timeout", msg, "request_timeout"))
        self.transport.close()


def protocol(limits: Limits, errors: Counter) -> type[GuardedH11Protocol]:
    """The protocol class for `uvicorn.Config(http=...)` with these limits."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits, "errors": errors})


class Guard:
    """`app` behind the host check (every route) and the API key (the `/v1` routes): an ASGI
    middleware (`FastAPI.add_middleware(Guard, access=..., errors=...)`)."""

    def __init__(self, app: ASGIApp, access: Access, errors: Counter) -> None:
        self.app, self.access, self.errors = app, access, errors

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        refusal = self._refusal(scope) if scope["type"] == "http" else None
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, code, message, extra = refusal
        self.errors[status] += 1
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                     "param": None, "code": code}}).encode()  # fmt: skip
        headers = [(b"content-type", b"application/json"), *extra]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _refusal(self, scope: dict) -> tuple[int, str, str, list] | None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host")
        if not self.access.host_allowed(host):
            msg = (
                f"Host {host!r} is not allowed: this server answers to IP addresses, localhost, "
                "the address it listens on and the names given to --allowed-host"
            )
            return 400, "invalid_host", msg, []
        if scope["path"].startswith("/v1") and not self.access.key_ok(headers.get("authorization")):
            msg = "a valid API key is needed: send 'Authorization: Bearer KEY'"
            return 401, "invalid_api_key", msg, [(b"www-authenticate", b"Bearer")]
        return None


__all__ = ["TIMED_OUT", "Guard", "GuardedH11Protocol", "protocol"]
