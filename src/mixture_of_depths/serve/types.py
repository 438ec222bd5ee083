"""What the HTTP layer and the engine exchange: a request's sampling settings, the events a
request yields, and the errors the HTTP layer turns into status codes; and what `mod serve`
hands the HTTP layer: who may ask (`Access`) and the connection limits (`Limits`), enforced by
guard.py (these need no [serve] extra, so the command's flags can show their defaults)."""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """One request's settings, checked by the engine (`Engine.submit`) against the model."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float | None = None  # in (0, 1]
    top_k: int | None = None  # >= 1 (an extension of the OpenAI API)
    seed: int | None = None  # a seeded request samples what `generate(..., seed=seed)` does
    stop: tuple[str, ...] = ()  # texts that end the completion (not included in it)
    stop_at_eos: bool = True  # the tokenizer's end-of-text token ends the completion


@dataclass
class Event:
    """One step of a request: a new token (and the text it completes, which may be "" while a
    multi-byte character is incomplete), or the end (`finish_reason` "stop" or "length", or
    "cancelled", or "error" when computing this request failed: `error` then says why), with the
    usage counts.

    The finish event may carry text too: what was held back because it could have begun a stop
    string, so the texts of all events add up to the completion. An end-of-text token that
    stops a completion gets no event and is not counted in `completion_tokens`."""

    token: int | None = None
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    routing: list[bool] = field(default_factory=list)  # which routers the token took, if known
    error: Exception | None = None  # with finish_reason "error": a RequestError is the input's


class RequestError(ValueError):
    """A request the engine cannot serve as asked (HTTP 400): `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class QueueFull(RuntimeError):
    """Admission control: no room now and the waiting queue is full (HTTP 429). `retry_after`
    is a suggested wait in seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ShuttingDown(RuntimeError):
    """The engine is draining for shutdown and admits nothing new (HTTP 503)."""


@dataclass(frozen=True)
class Limits:
    """Connection limits (`mod serve --max-connections --header-timeout --body-timeout`)."""

    max_connections: int = 256
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: int = 5


@dataclass(frozen=True)
class Access:
    """Who may ask: the API key (None: anyone) and the names `Host` may give besides IP
    addresses, `localhost` and the bound host (`*` among them: any)."""

    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    bound: str = "127.0.0.1"

    def host_allowed(self, host: str | None) -> bool:
        if host is None or "*" in self.allowed_hosts:  # HTTP/1.0 sends none: no browser
            return True
        name = host.lower()
        name = name[1 : name.find("]")] if name.startswith("[") else name.rpartition(":")[0] or name
        name = name.rstrip(".")
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            pass
        names = {"localhost", _bare(self.bound), *(_bare(h) for h in self.allowed_hosts)}
        return name in names

    def key_ok(self, authorization: str | None) -> bool:
        if self.api_key is None:
            return True
        scheme, _, given = (authorization or "").partition(" ")
        ok = hmac.compare_digest(given.strip().encode(), self.api_key.encode())
        return scheme.lower() == "bearer" and ok


def _bare(host: str) -> str:
    return host.lower().strip("[]").rstrip(".")


def parse_hosts(values: Sequence[str] | None) -> tuple[str, ...]:
    """`--allowed-host` values, each possibly comma-separated."""
    return tuple(h.strip() for v in values or () for h in v.split(",") if h.strip())
