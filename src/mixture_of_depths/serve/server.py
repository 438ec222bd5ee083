"""Running the app on uvicorn: `serve` (the `mod serve` command: SIGTERM drains, then exit 0)
and `ServerThread` (a server in a thread on a free port, for the tests and the benchmark).

On the first SIGTERM or SIGINT the server stops admitting (new completions get 503, /health
says "draining"), lets the engine finish the running requests within the grace period
(`Engine.drain`), then closes. A second signal stops at once (docs/serving.md).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from types import FrameType
from typing import Any

import uvicorn

from .app import ServeState, create_app
from .guard import protocol
from .metrics import take_rate_text
from .types import Access, Limits

log = logging.getLogger("mixture_of_depths.serve")
AFTER_DRAIN_S = 5.0  # how long uvicorn waits for connections to close once the engine drained


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); port 0 picks a free one (no race between finding a
    port and binding it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM/SIGINT drains the engine instead of closing
    connections that still have tokens to receive."""

    def __init__(self, config: uvicorn.Config, engine: Any, state: ServeState, grace_s: float):
        super().__init__(config)
        self.engine, self.state, self.grace_s = engine, state, grace_s
        self.drained: bool | None = None  # engine.drain's answer, once it has returned
        self.signalled: int | None = None
        self._drainer: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drainer is None:
            self.signalled = sig
            self.state.draining = True
            self._drainer = threading.Thread(target=self._drain, name="mod-serve-drain")
            self._drainer.daemon = True
            self._drainer.start()
            return
        self.should_exit = self.force_exit = True  # a second signal: stop now

    def _drain(self) -> None:
        try:
            name = signal.Signals(self.signalled).name if self.signalled else "a signal"
            say(
                f"mod serve: {name}: admitting nothing new; finishing the running requests "
                f"(at most {self.grace_s:g} s)"
            )
            self.drained = bool(self.engine.drain(self.grace_s))
        finally:
            self.should_exit = True


def say(text: str) -> None:
    """A line on stderr, unless its reader has gone (`mod serve 2>&1 | head`): then stderr
    becomes /dev/null, so that no later write (nor the flush at exit) fails the drain or the
    exit status."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # EPIPE, or a closed stream
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115  (for the life of the process)


def uvicorn_config(app: Any, state: ServeState, limits: Limits, **kw: Any) -> uvicorn.Config:
    """uvicorn's settings for `app`: the guarded protocol (guard.py) and its limits."""
    return uvicorn.Config(
        app,
        http=protocol(limits, state.errors),
        timeout_keep_alive=limits.keep_alive_s,
        timeout_graceful_shutdown=int(AFTER_DRAIN_S),
        **kw,
    )


def serve(
    engine: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    grace_s: float = 30.0,
    tokenizer: Any = None,
    log_level: str = "info",
    access: Access | None = None,
    limits: Limits | None = None,
) -> int:
    """Serve `engine` until SIGTERM or SIGINT: start it, listen, drain on the first signal.
    Returns the exit status: 0 after a drain (the running requests finished, or the grace
    period ran out and the engine cancelled the rest), 1 after a second signal."""
    access = access or Access(bound=host)
    sock = bind(host, port)
    state = ServeState()
    app = create_app(engine, tokenizer=tokenizer, state=state, access=access)
    config = uvicorn_config(app, state, limits or Limits(), log_level=log_level)
    server = DrainingServer(config, engine, state, grace_s)
    engine.start()
    where = sock.getsockname()
    say(
        f"mod serve: {engine.model_name!r} on http://{host}:{where[1]}/v1 "
        f"(max context {engine.max_context} tokens); SIGTERM drains and stops"
    )
    server.run(sockets=[sock])
    rates = take_rate_text(engine.metrics(), getattr(engine.model, "config", None))
    if rates:  # the compute the served tokens took, beside the capacity planned
        say(f"mod serve: {rates}")
    if server.force_exit:
        say("mod serve: stopped by a second signal")
        return 1
    if server.drained is False:
        say("mod serve: the grace period ran out: the rest were cancelled")
    say("mod serve: stopped")
    return 0


class ServerThread:
    """The app on uvicorn in a daemon thread on `host` and a free port: `url`, `start()`,
    `stop()`, or `with ServerThread(engine) as s:`. The engine is started and drained by the
    caller. Every wait is bounded."""

    def __init__(
        self,
        engine: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: Limits | None = None,
        **app_kw: Any,
    ) -> None:
        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.state = ServeState()
        app_kw.setdefault("access", Access(bound=host))
        app = create_app(engine, state=self.state, **app_kw)
        # log_config None: leave the process's logging (pytest's, the benchmark's) alone
        config = uvicorn_config(
            app, self.state, limits or Limits(), log_config=None, log_level="warning",
            access_log=False,
        )  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server on {self.url} did not start in {timeout_s:g} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout_s)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
