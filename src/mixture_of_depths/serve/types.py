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
    addresses, `localhost` and the bound host (`*` among them: any). A key or a name that could
    never match is refused here (`key_problem`, `name_problem`)."""

    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    bound: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.api_key is not None and (problem := key_problem(self.api_key)):
            raise ValueError(f"api_key {problem}")
        for name in self.allowed_hosts:
            if problem := name_problem(name):
                raise ValueError(f"allowed_hosts {name}: {problem}")

    def host_allowed(self, host: str | None) -> bool:
        if host is None or "*" in self.allowed_hosts:  # HTTP/1.0 sends none: no browser
            return True
        name = host_name(host)
        if name is None:
            return False
        if _is_ip(name):
            return True
        names = {"localhost", _bare(self.bound), *(_bare(h) for h in self.allowed_hosts)}
        return name in names

    def key_ok(self, authorization: str | None) -> bool:
        if self.api_key is None:
            return True
        scheme, _, given = (authorization or "").partition(" ")
        ok = hmac.compare_digest(given.strip().encode(), self.api_key.encode())
        return scheme.lower() == "bearer" and ok


def key_problem(key: str) -> str | None:
    """Why `key` could never match an `Authorization` header, or None: header values are
    latin-1 with the whitespace around them stripped, so a key is printable ASCII, no spaces."""
    if not key.strip():
        return "must not be empty (leave it out to ask for no key)"
    if key != key.strip():
        return "must not begin or end with whitespace (a header's value is stripped)"
    if not all("!" <= ch <= "~" for ch in key):
        return "must be printable ASCII without spaces (HTTP headers are latin-1 bytes)"
    return None


def name_problem(name: str) -> str | None:
    """Why `name` (an allowed host name) could never match a `Host` header, or None."""
    if name == "*" or _is_ip(_bare(name)):
        return None
    if ":" in name or "/" in name:  # the check ignores ports: "gpu-box:8000" would never match
        rest = name.split("//")[-1].split("/")[0]
        bare = rest.rpartition(":")[0] if ":" in rest else rest
        return f"give the name without a port or scheme ({bare}): the Host check ignores ports"
    return None


def host_name(host: str) -> str | None:
    """The name a `Host` header value gives (lower case, no port, no trailing dot): an IPv6
    address in brackets or bare; None where the value is malformed (an unclosed bracket,
    something after it, a port that is not a number)."""
    value = host.strip().lower()
    if value.startswith("["):
        inside, closed, rest = value[1:].partition("]")
        port_ok = rest == "" or (rest[0] == ":" and _digits(rest[1:]))
        return inside if closed and port_ok and _is_ip(inside) and ":" in inside else None
    if _is_ip(value):  # a bare IPv6 literal (its colons are no port)
        return value
    name, colon, port = value.rpartition(":")
    if colon and not _digits(port):
        return None
    return (name if colon else value).rstrip(".")


def _digits(text: str) -> bool:
    return text == "" or (text.isascii() and text.isdigit())


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _bare(host: str) -> str:
    return host.lower().strip("[]").rstrip(".")


def parse_hosts(values: Sequence[str] | None) -> tuple[str, ...]:
    """`--allowed-host` values, each possibly comma-separated; a name that could never match
    (one with a port) is a ValueError naming the flag."""
    names = tuple(h.strip() for v in values or () for h in v.split(",") if h.strip())
    for name in names:
        if problem := name_problem(name):
            raise ValueError(f"--allowed-host {name}: {problem}")
    return names
