"""The HTTP API of `mod serve` (FastAPI, the `[serve]` extra): `create_app(engine)`.

`POST /v1/completions` (whole or streamed as server-sent events), `GET /v1/models`,
`GET /health`, `GET /metrics` (Prometheus). Errors are OpenAI's JSON (`openai_api.APIError`);
the engine's `RequestError`, `QueueFull` and `ShuttingDown` become 400, 429 (with Retry-After)
and 503. A client that goes away before its completion is done has its request cancelled, so
its row and pages are freed at the engine's next step (docs/serving.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .guard import TIMED_OUT, Guard
from .metrics import CONTENT_TYPE, prometheus_text
from .openai_api import (
    APIError,
    Submission,
    completion_body,
    models_body,
    now,
    parse_request,
    to_submission,
    usage,
    usage_chunk,
)
from .types import Access, QueueFull, RequestError, ShuttingDown

MAX_BODY_BYTES = 1 << 20  # a completion request is text or token ids: 1 MiB is plenty
CLIENT_CLOSED = 499  # nginx's status for a client that closed the connection (never sent)
log = logging.getLogger("mixture_of_depths.serve")


@dataclass
class ServeState:
    """What the HTTP layer keeps: whether the server is draining (set by `server` on SIGTERM),
    when it started, and its error responses by status (for /metrics)."""

    draining: bool = False
    created: int = field(default_factory=now)
    errors: Counter = field(default_factory=Counter)


def create_app(
    engine: Any,
    *,
    tokenizer: Any = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    state: ServeState | None = None,
    access: Access | None = None,
) -> FastAPI:
    """The app serving `engine` (an `Engine`, started by the caller). `tokenizer` (default: the
    engine's) encodes text prompts and decodes echoed ones; `access` (default: no key, a server
    on 127.0.0.1) is who may ask (guard.py)."""
    tok = tokenizer if tokenizer is not None else engine.tokenizer
    st = state if state is not None else ServeState()
    app = FastAPI(title="mod serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = st
    app.add_middleware(Guard, access=access or Access(), errors=st.errors)
    _error_handlers(app, st)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        _json_only(request.headers.get("content-type"))
        sub, model = _parse(await _read_body(request, max_body_bytes), engine, tok)
        handle = await _submit(engine, sub)
        cid, created = _completion_id(handle.id), now()
        if sub.stream:
            events = _sse(engine, handle, sub, cid, created, model)
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        return await _whole(request, engine, handle, sub, cid, created, model)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return models_body(engine.model_name, st.created, engine.max_context)

    @app.get("/health")
    async def health() -> JSONResponse:
        if st.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok", "model": engine.model_name})

    @app.get("/metrics")
    async def metrics() -> Response:
        values = await run_in_threadpool(engine.metrics)
        return Response(prometheus_text(values, st.errors), media_type=CONTENT_TYPE)

    return app


# -- errors ---------------------------------------------------------------------------------------
def _error_handlers(app: FastAPI, st: ServeState) -> None:
    def reply(exc: APIError, count: bool = True) -> JSONResponse:
        if count:
            st.errors[exc.status] += 1
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        # a body that timed out is the guard's 408, counted there, not also a 499
        timed_out = exc.status == CLIENT_CLOSED and request.scope.get(TIMED_OUT, False)
        return reply(exc, count=not timed_out)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = f"{exc.detail}: {request.method} {request.url.path}"
        return reply(APIError(exc.status_code, msg, code=code, headers=exc.headers))

    @app.exception_handler(RequestValidationError)  # FastAPI's 422, in OpenAI's 400 format
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = loc[0] if loc else None
        return reply(APIError(400, f"{param}: {err.get('msg', 'invalid')}", param))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error serving %s %s", request.method, request.url.path)
        msg = f"internal error ({type(exc).__name__}): see the server's log"
        return reply(APIError(500, msg, kind="server_error", code="internal_error"))


# -- a completion ---------------------------------------------------------------------------------
def _json_only(content_type: str | None) -> None:
    """A 415 unless the body is declared JSON: a web page's cross-site "simple" request
    (text/plain, a form) can then not run a completion without a CORS preflight we refuse."""
    if (content_type or "").split(";")[0].strip().lower() != "application/json":
        raise APIError(
            415,
            f"Content-Type must be application/json, got {content_type!r}",
            code="unsupported_media_type",
        )


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes: by its Content-Length when it has one,
    and as it streams in (a chunked body has none)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise APIError(400, f"Content-Length must be a number of bytes, got {declared!r}")
        if int(declared) > limit:
            raise _too_large(int(declared), limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
    except ClientDisconnect:  # it left, or the body timed out (guard.py): nobody to answer
        raise APIError(CLIENT_CLOSED, "the client left while sending its body") from None
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> APIError:
    return APIError(
        413, f"the body is {size} bytes or more; at most {limit} bytes", code="body_too_large"
    )


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _parse(body: bytes, engine: Any, tokenizer: Any) -> tuple[Submission, str]:
    try:
        data = json.loads(body, parse_constant=_no_constant)  # NaN and Infinity are not JSON
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # arrays nested deeper than the parser's stack, under the size limit
        msg = "the body is not valid JSON: nested too deeply"
        raise APIError(400, msg, code="invalid_json") from None
    req = parse_request(data)
    if req.model is not None and req.model != engine.model_name:
        raise APIError(
            404,
            f"the model {req.model!r} does not exist: this server serves {engine.model_name!r}",
            "model",
            "model_not_found",
        )
    return to_submission(req, tokenizer), engine.model_name


async def _submit(engine: Any, sub: Submission) -> Any:
    try:  # in a thread: submit may wait on the scheduler's lock for a step
        return await run_in_threadpool(engine.submit, sub.prompt_ids, sub.params)
    except RequestError as exc:
        raise APIError(400, str(exc), exc.param, "invalid_value") from None
    except QueueFull as exc:
        wait = str(max(1, math.ceil(exc.retry_after)))
        raise APIError(
            429, str(exc), None, "queue_full", "rate_limit_error", {"Retry-After": wait}
        ) from None
    except ShuttingDown as exc:
        msg = str(exc) or "the server is shutting down"
        raise APIError(503, msg, None, "shutting_down", "server_error") from None


def _failed(reason: str, error: Exception | None = None) -> APIError:
    """A request the engine ended without an answer: cancelled (shutting down), or failed
    computing it (400 where its input was at fault, else 500: that request's alone)."""
    if isinstance(error, RequestError):
        return APIError(400, str(error), error.param, "invalid_value")
    if reason == "error":
        msg = "the engine failed while computing this request (see the server's log)"
        return APIError(500, msg, None, "engine_error", "server_error")
    return _cancelled()


def _completion_id(request_id: str) -> str:
    return request_id if request_id.startswith("cmpl-") else f"cmpl-{request_id}"


def _cancelled() -> APIError:
    return APIError(
        503, "the request was cancelled: the server is shutting down", None, "cancelled",
        "server_error",
    )  # fmt: skip


def _ids(sub: Submission, ids: list[int], prompt: bool = True) -> dict[str, list[int]] | None:
    """The return_token_ids extension: the completion's ids (and the prompt's) beside the text."""
    if not sub.return_token_ids:
        return None
    return {"prompt_token_ids": sub.prompt_ids, "token_ids": ids} if prompt else {"token_ids": ids}


async def _collect(handle: Any) -> tuple[str, list[int], Any]:
    """The whole completion: its text, token ids and final event."""
    pieces, ids, final = [], [], None
    async for ev in handle.aevents():
        pieces.append(ev.text)
        if ev.token is not None:
            ids.append(ev.token)
        if ev.finish_reason is not None:
            final = ev
            break
    return "".join(pieces), ids, final


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _whole(
    request: Request, engine: Any, handle: Any, sub: Submission, cid: str, created: int, model: str
) -> Response:
    """The completion in one response; the request is cancelled if the client goes away."""
    collector = asyncio.ensure_future(_collect(handle))
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not collector.done():  # the client left, or this task was cancelled
            collector.cancel()
            engine.cancel(handle.id)
    if not collector.done() or collector.cancelled():
        return Response(status_code=CLIENT_CLOSED)
    text, ids, final = collector.result()
    if final is None or final.finish_reason in ("cancelled", "error"):
        raise _failed(*((final.finish_reason, final.error) if final else ("cancelled",)))
    if sub.echo_text is not None:
        text = sub.echo_text + text
    use = usage(final.prompt_tokens or len(sub.prompt_ids), final.completion_tokens)
    body = completion_body(cid, created, model, text, final.finish_reason, use, _ids(sub, ids))
    return JSONResponse(body)


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _sse(
    engine: Any, handle: Any, sub: Submission, cid: str, created: int, model: str
) -> AsyncIterator[str]:
    """The completion as server-sent events: OpenAI completion chunks, then `data: [DONE]`.
    Closing the stream early (the client left) cancels the request."""
    finished = False
    try:
        if sub.echo_text is not None:
            yield _data(completion_body(cid, created, model, sub.echo_text, None, None))
        async for ev in handle.aevents():
            ids = [ev.token] if ev.token is not None else []
            if ev.finish_reason is None:
                if ev.text or (sub.return_token_ids and ids):
                    extra = _ids(sub, ids, prompt=False)
                    yield _data(completion_body(cid, created, model, ev.text, None, None, extra))
                continue
            finished = True
            if ev.finish_reason in ("cancelled", "error"):
                yield _data(_failed(ev.finish_reason, ev.error).body())
                break
            extra = _ids(sub, ids, prompt=False)
            last = completion_body(cid, created, model, ev.text, ev.finish_reason, None, extra)
            yield _data(last)
            if sub.include_usage:
                use = usage(ev.prompt_tokens or len(sub.prompt_ids), ev.completion_tokens)
                yield _data(usage_chunk(cid, created, model, use))
            break
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            engine.cancel(handle.id)
