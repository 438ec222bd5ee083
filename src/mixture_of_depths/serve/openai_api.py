"""The OpenAI completions API as data: the request's fields and their types, the error JSON, and
the bodies of a response and of a streamed chunk (docs/serving.md).

Parsing is strict (a string is not a number, 1.0 is not an integer, 1 is not a boolean) so that
a field of the wrong type gets a 400 that names it instead of a silent coercion. Ranges that
depend on the model (context, vocabulary) and on sampling (temperature, top_p, top_k) are the
engine's to check (`Engine.submit` raises `RequestError` naming the field).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from .types import SamplingParams

MAX_STOP = 4  # OpenAI's limit on stop sequences
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class APIError(Exception):
    """An HTTP error in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool | None = False


class CompletionRequest(BaseModel):
    """POST /v1/completions. Unknown fields are ignored (as OpenAI-compatible servers do);
    known fields we cannot honour are refused when set to anything but their neutral value."""

    model_config = ConfigDict(strict=True, extra="ignore")
    prompt: str | list[int] | list[str] | list[list[int]]
    model: str | None = None
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    temperature: float | None = 1.0
    top_p: float | None = None
    top_k: int | None = None  # an extension, as in vLLM
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    echo: bool | None = False
    return_token_ids: bool | None = False  # an extension, as in vLLM: the ids beside the text
    ignore_eos: bool | None = False  # an extension, as in vLLM: run to max_tokens (benchmarks)
    # Not supported: refused unless neutral.
    logprobs: int | None = None
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None


_TYPES = {
    "prompt": "a string, a list of token ids, or a list holding one of either",
    "stop": "a string or a list of up to 4 strings",
    "stream_options": 'an object such as {"include_usage": true}',
}


def parse_request(data: Any) -> CompletionRequest:
    """The request from the decoded JSON body; APIError 400 naming the first bad field."""
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(data).__name__}")
    try:
        return CompletionRequest.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err["loc"]]
        param = loc[0] if loc else None
        if err["type"] == "missing":
            raise APIError(400, f"{param} is required", param) from None
        wanted = _TYPES.get(param or "", err["msg"].removeprefix("Input should be ").lower())
        got = data.get(param) if param else data
        raise APIError(
            400, f"{param} must be {wanted}, got {_short(got)}", param, "invalid_type"
        ) from None


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class Submission:
    """What the engine is given, and what the response needs besides the engine's events."""

    prompt_ids: list[int]
    params: SamplingParams
    echo_text: str | None  # the prompt's text, when echo is asked for
    stream: bool
    include_usage: bool
    return_token_ids: bool
    extra: dict[str, Any] = field(default_factory=dict)


def _refuse_unsupported(req: CompletionRequest) -> None:
    if req.n not in (None, 1):
        raise APIError(400, f"n must be 1 (one completion per request), got {req.n}", "n")
    if req.best_of not in (None, 1):
        raise APIError(400, f"best_of must be 1, got {req.best_of}", "best_of")
    if req.logprobs is not None:
        raise APIError(400, "logprobs are not supported: leave logprobs unset", "logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value not in (None, 0):
            raise APIError(400, f"{name} is not supported: leave it at 0, got {value}", name)
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported: leave it empty", "logit_bias")
    if req.suffix:
        raise APIError(400, "suffix (insertion) is not supported: leave it unset", "suffix")


def _prompt_ids(prompt: Any, tokenizer: Any) -> tuple[list[int], str | None]:
    """The prompt's token ids, and its text where it came as text."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise APIError(
                400,
                f"prompt holds {len(prompt)} prompts; batches are not served: send one prompt "
                "per request (a string, a list of token ids, or a list holding one of either)",
                "prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer.encode(_unicode(prompt, "prompt"))
        if not ids:
            raise APIError(400, "prompt encodes to no tokens: give some text", "prompt")
        return ids, prompt
    if not prompt:
        raise APIError(400, "prompt is an empty list: give at least one token id", "prompt")
    return list(prompt), None


def _unicode(text: str, param: str) -> str:
    """`text`, or a 400 naming `param` when it holds a lone surrogate: JSON's "\\ud800" is valid
    JSON but not Unicode text, and no tokenizer (nor UTF-8) can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        at = f"{text[exc.start]!r} at index {exc.start}"
        msg = f"{param} holds a lone surrogate ({at}): not Unicode text"
        raise APIError(400, msg, param) from None
    return text


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
    stops = [_unicode(s, "stop") for s in stops]
    if len(stops) > MAX_STOP:
        raise APIError(400, f"stop holds {len(stops)} sequences; at most {MAX_STOP}", "stop")
    if any(s == "" for s in stops):
        raise APIError(400, "stop sequences must be non-empty strings", "stop")
    return tuple(stops)


def to_submission(req: CompletionRequest, tokenizer: Any) -> Submission:
    """The engine's prompt and settings from a parsed request (APIError 400 on what the HTTP
    layer can tell alone: batches, n, unsupported fields, stop sequences)."""
    _refuse_unsupported(req)
    ids, text = _prompt_ids(req.prompt, tokenizer)
    params = SamplingParams(
        max_tokens=DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        stop=_stop(req.stop),
        stop_at_eos=not req.ignore_eos,
    )
    echo_text = None
    if req.echo:
        echo_text = text if text is not None else _decode(tokenizer, ids)
    return Submission(
        prompt_ids=ids,
        params=params,
        echo_text=echo_text,
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        return_token_ids=bool(req.return_token_ids),
    )


def _decode(tokenizer: Any, ids: list[int]) -> str:
    try:
        return tokenizer.decode(ids)
    except ValueError as exc:  # ids outside the tokenizer's range
        raise APIError(400, f"prompt: {exc}", "prompt") from None


# -- response bodies ------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    cid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    use: dict[str, int] | None,
    token_ids: dict[str, list[int]] | None = None,
) -> dict[str, Any]:
    """A text_completion object: the whole response, or (use None) one streamed chunk."""
    choice: dict[str, Any] = {
        "text": text,
        "index": 0,
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice.update(token_ids)
    return {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": use,
    }


def usage_chunk(cid: str, created: int, model: str, use: dict[str, int]) -> dict[str, Any]:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
    return {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": use,
    }


def models_body(model: str, created: int, max_context: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "mixture-of-depths",
                "max_model_len": max_context,
            }
        ],
    }


def now() -> int:
    return int(time.time())
