"""What the HTTP layer and the engine exchange: a request's sampling settings, the events a
request yields, and the errors the HTTP layer turns into status codes."""

from __future__ import annotations

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
