"""A stand-in with the `Engine` interface (serve/engine.py) for the HTTP layer's own tests: one
request at a time through the library's `stream`, so its completions are `generate`'s. It lets
a test force what the real engine does only under load (QueueFull, ShuttingDown, a slow step)."""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator

from mixture_of_depths.generate import stream
from mixture_of_depths.serve.types import (
    Event,
    QueueFull,
    RequestError,
    SamplingParams,
    ShuttingDown,
)

_ids = itertools.count()


class FakeRequest:
    def __init__(self, prompt: list[int], params: SamplingParams) -> None:
        self.id = f"fake-{next(_ids)}"
        self.prompt, self.params = prompt, params
        self.prompt_tokens = len(prompt)
        self.queue: queue.Queue[Event] = queue.Queue()
        self.cancelled = threading.Event()

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        while True:
            ev = self.queue.get(timeout=timeout)
            yield ev
            if ev.finish_reason is not None:
                return

    async def aevents(self) -> AsyncIterator[Event]:
        while True:
            try:
                ev = self.queue.get_nowait()
            except queue.Empty:
                await asyncio.sleep(0.002)
                continue
            yield ev
            if ev.finish_reason is not None:
                return


class FakeEngine:
    def __init__(self, model, tokenizer, *, model_name: str = "mod", max_queue: int = 64,  # noqa: ANN001
                 step_s: float = 0.0) -> None:  # fmt: skip
        self.model, self.tokenizer, self.model_name = model, tokenizer, model_name
        self.max_context = model.config.max_seq_len
        self.vocab_size = model.config.vocab_size
        self.max_queue, self.step_s = max_queue, step_s
        self.pending: queue.Queue[FakeRequest] = queue.Queue()
        self.running: dict[str, FakeRequest] = {}
        self.counts = dict(requests_total=0, tokens_prompt_total=0, tokens_generated_total=0)
        self.full = False  # a test sets it to see a 429
        self.closing = False
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, prompt: list[int], params: SamplingParams) -> FakeRequest:
        if self.closing:
            raise ShuttingDown("draining")
        if self.full or self.pending.qsize() >= self.max_queue:
            raise QueueFull("the queue is full", retry_after=2.5)
        if params.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {params.max_tokens}", "max_tokens")
        if len(prompt) + params.max_tokens > self.max_context:
            raise RequestError("past the context", "max_tokens")
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise RequestError("token ids outside the vocabulary", "prompt")
        if params.temperature < 0:
            raise RequestError("temperature must be >= 0", "temperature")
        if params.top_p is not None and not 0 < params.top_p <= 1:
            raise RequestError("top_p must be in (0, 1]", "top_p")
        req = FakeRequest(prompt, params)
        self.counts["requests_total"] += 1
        self.pending.put(req)
        return req

    def cancel(self, request_id: str) -> None:
        req = self.running.get(request_id)
        if req is not None:
            req.cancelled.set()

    def drain(self, grace_s: float = 30.0) -> bool:
        self.closing = True
        deadline = time.monotonic() + grace_s
        while (self.running or not self.pending.empty()) and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self.running and self.pending.empty()

    def metrics(self) -> dict:
        return dict(self.counts, requests_running=len(self.running),
                    queue_depth=self.pending.qsize(), active_rows=len(self.running),
                    kv_pages_in_use={"0": len(self.running)}, take_rate={"0": 0.5})  # fmt: skip

    def _loop(self) -> None:
        while True:
            req = self.pending.get()
            self.running[req.id] = req
            try:
                self._run(req)
            finally:
                del self.running[req.id]

    def _run(self, req: FakeRequest) -> None:
        p, eos = req.params, self.tokenizer.eot_id
        ids: list[int] = []
        shown, reason = "", "length"
        steps = stream(self.model, [req.prompt], p.max_tokens, p.temperature, p.top_k, p.top_p,
                       eos_id=eos, seed=p.seed)  # fmt: skip
        for st in steps:
            time.sleep(self.step_s)
            if req.cancelled.is_set():
                reason = "cancelled"
                break
            tok = st.tokens[0]
            self.counts["tokens_generated_total"] += 1
            if tok == eos:
                reason = "stop"
                break
            ids.append(tok)
            text = self.tokenizer.decode(ids)
            new = "" if text.endswith("\ufffd") else text[len(shown) :]
            shown += new
            req.queue.put(Event(token=tok, text=new))
        req.queue.put(Event(text=self.tokenizer.decode(ids)[len(shown) :], finish_reason=reason,
                            prompt_tokens=len(req.prompt), completion_tokens=len(ids)))  # fmt: skip
