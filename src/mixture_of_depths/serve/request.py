"""One request of the serving engine: what it feeds, how it samples, the text it has produced,
and the events its caller reads (blocking, from any thread, or from asyncio).

Text: each token's event carries the text it completes, the decoded completion's new suffix. A
tokenizer may split a multi-byte character over tokens: the text waits ("") until the character
is complete. Text that could be the start of a `stop` string is held back too, until it is not;
the finish event carries whatever was held (so the events' texts always add up to the answer).
A stop string ends the completion and is not part of its text.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator

import torch

from .types import Event, SamplingParams

_INCOMPLETE = "\ufffd"  # what a decoder shows for the bytes of an unfinished character


class TextStream:
    """Incremental decoding of a completion with stop strings (see the module docstring)."""

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:  # noqa: ANN001
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.sent = ""  # the text emitted so far

    def _decode(self) -> str:
        if self.tokenizer is None:
            return ""
        try:
            return self.tokenizer.decode(self.ids)
        except ValueError:  # an id the tokenizer does not know (a model vocabulary larger)
            return self.sent

    def _cut(self, text: str) -> int | None:
        """Where the first stop string in `text` starts, if any."""
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def add(self, token: int) -> tuple[str, bool]:
        """Feed one token: the new text to emit, and whether a stop string ended the text."""
        self.ids.append(token)
        text = self._decode().rstrip(_INCOMPLETE)
        if not text.startswith(self.sent):  # a decoder that rewrote earlier text: wait
            return "", False
        cut = self._cut(text)
        if cut is not None:
            return self._emit(text[: max(cut, len(self.sent))]), True
        hold = 0  # the longest tail of the text that begins a stop string
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:n]):
                    hold = n
                    break
        return self._emit(text[: max(len(text) - hold, len(self.sent))]), False

    def flush(self) -> str:
        """At the end: whatever is left (an unfinished character shows as the decoder shows it),
        up to a stop string."""
        text = self._decode()
        if not text.startswith(self.sent):
            return ""
        cut = self._cut(text)
        return self._emit(text if cut is None else text[: max(cut, len(self.sent))])

    def _emit(self, text: str) -> str:
        new, self.sent = text[len(self.sent) :], text
        return new


class Request:
    """A submitted request (`Engine.submit`). `events()` / `aevents()` yield its events until the
    finish event; `result()` waits for the end. The engine's scheduler thread alone writes it."""

    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        tokenizer,  # noqa: ANN001
        generator: torch.Generator,
        cancel: Callable[[str], None],
    ) -> None:
        self.id, self.params, self.generator = request_id, params, generator
        self.prompt_tokens = len(prompt)
        self.tokens = list(prompt)  # what the row feeds: the prompt, then each sampled token
        self.text = TextStream(tokenizer, params.stop)
        self.finish_reason: str | None = None
        self.submitted = time.monotonic()
        self.decoded = 0  # generated tokens fed back whose routing was counted (metrics)
        self._cancel = cancel
        self._events: list[Event] = []
        self._cond = threading.Condition()
        self._wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._done = threading.Event()

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_tokens :]

    # -- written by the engine ------------------------------------------------------------------
    def push(self, event: Event, wake: bool = True) -> None:
        """Add an event; its asyncio readers are woken now, or (`wake=False`) by the engine's
        `wake_all` once its step has pushed every row's event."""
        with self._cond:
            self._events.append(event)
            self._cond.notify_all()
        if wake:
            wake_all([self])
        if event.finish_reason is not None:
            self._done.set()

    def finish(self, reason: str, error: Exception | None = None) -> None:
        """The finish event (with any text held back; an `error` says why it failed), once."""
        if self.finish_reason is not None:
            return
        # The held-back text first: a tokenizer that fails on it leaves the request unfinished,
        # so that the engine's finish("error") still sends an event (a reader waits for one).
        text = self.text.flush() if reason not in ("cancelled", "error") else ""
        self.finish_reason = reason
        n = len(self.generated)
        self.push(
            Event(
                text=text,
                finish_reason=reason,
                prompt_tokens=self.prompt_tokens,
                completion_tokens=n,
                error=error,
            )
        )

    # -- read by the caller ---------------------------------------------------------------------
    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """The events from the first, blocking; TimeoutError when none comes for `timeout`."""
        i = 0
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda n=i: len(self._events) > n, timeout):
                    raise TimeoutError(f"request {self.id}: no event for {timeout} s")
                new = self._events[i:]
            i += len(new)
            for event in new:
                yield event
                if event.finish_reason is not None:
                    return

    async def aevents(self) -> AsyncIterator[Event]:
        """The events from the first, for asyncio: the scheduler thread wakes this loop with
        `call_soon_threadsafe`. Closing the iterator before the finish event (a client that
        went away) cancels the request."""
        waker = (asyncio.get_running_loop(), asyncio.Event())
        ready = waker[1]
        with self._cond:
            self._wakers.append(waker)
        i, finished = 0, False
        try:
            while not finished:
                ready.clear()
                with self._cond:
                    new = self._events[i:]
                if not new:
                    await ready.wait()
                    continue
                i += len(new)
                for event in new:
                    finished = event.finish_reason is not None
                    yield event
                    if finished:
                        break
        finally:
            with self._cond:
                self._wakers.remove(waker)
            if not finished:
                self._cancel(self.id)

    def result(self, timeout: float | None = None) -> tuple[list[int], str, str]:
        """Wait for the end: the generated ids (an end-of-text token not included), the text,
        and the finish reason ("stop", "length", "cancelled" or "error")."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        with self._cond:
            text = "".join(e.text for e in self._events)
        return list(self.generated), text, str(self.finish_reason)


def wake_all(requests: Iterable[Request]) -> None:
    """Wake the asyncio readers of `requests` with one call per event loop, not one per event:
    each call writes to the loop's self-pipe and takes a turn of the loop (and of the GIL)."""
    ready: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}
    for request in requests:
        with request._cond:
            for loop, event in request._wakers:
                ready.setdefault(loop, []).append(event)
    for loop, events in ready.items():
        try:
            loop.call_soon_threadsafe(_set_all, events)
        except RuntimeError:  # the loop is closed: nobody is listening
            pass


def _set_all(events: list[asyncio.Event]) -> None:
    for event in events:
        event.set()
