"""Which requests run at the next step, and how many tokens each feeds: admission, the step's
plan, preemption. Pure bookkeeping over the paged cache's page counts (paged.py); the engine
(engine.py) runs the plan.

**Admission counts pages, and a row that the pool cannot feed is preempted by recompute.** A
request is admitted (continuous batching: at any step; static: only into an empty batch, see
`Scheduler.admit`) when a row is free and every layer's free pages, less what the running rows
may still need to finish feeding their prompts, hold its whole prompt in the worst case (every
prompt token taking every layer; exact in the layers that cache every token). Decode-time takes
are not reserved: a routed layer's pages follow the tokens that actually take it, so reserving
`prompt + max_tokens` in every routed layer would throw away MoD's smaller cache at admission.
Instead each step checks that every row's tokens of the step fit in the worst case; when a
decoding row's next token cannot be placed (or no row can move), the most recently admitted row
is preempted: its pages are freed and its request goes back to the head of the queue with its
generated tokens appended to its prompt. The causal prefill of that longer prompt makes exactly
the routing decisions and values its decode steps made (docs/semantics.md), and its sampler's
generator carries on where it stopped, so a preempted request's answer does not change. The
pool holds at least one row at full context (`PagedKVCache` refuses less), so the oldest row
can always finish.

Every row feeds `request.tokens[fed:]` (its prompt, then each sampled token): a row with one
token left is decoding and feeds it; a row with more is prefilling and feeds a chunk, the step's
prefill tokens shared out oldest row first up to `prefill_chunk`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .paged import PagedKVCache
from .request import Request

STATIC_IDLE_S = 0.05  # static batching: a partial batch starts after this long without arrivals


@dataclass
class Row:
    """A request in the running batch: its row id in the cache, and how many of its tokens
    the cache has processed."""

    id: int
    request: Request
    fed: int = 0

    @property
    def left(self) -> int:
        return len(self.request.tokens) - self.fed


class Scheduler:
    """The waiting queue and the running rows (the engine's lock guards `waiting`)."""

    def __init__(
        self, cache: PagedKVCache, max_rows: int, prefill_chunk: int, batching: str
    ) -> None:
        self.cache, self.max_rows, self.prefill_chunk = cache, max_rows, prefill_chunk
        self.static = batching == "static"
        self.waiting: deque[Request] = deque()
        self.running: list[Row] = []  # in admission order
        self.preemptions = 0
        self._next_id = 0

    # -- admission ------------------------------------------------------------------------------
    def _reserved(self) -> list[int]:
        """Per layer, the pages the running rows may still take to feed what they hold."""
        out = [0] * len(self.cache.pools)
        for row in self.running:
            need = self.cache.worst_case_pages(row.id, row.left)
            out = [a + max(b, 0) for a, b in zip(out, need, strict=True)]
        return out

    def _fits(self, request: Request) -> bool:
        need = math.ceil(len(request.tokens) / self.cache.page_size)
        free = self.cache.free_pages()
        reserved = self._reserved()
        return all(f - r >= need for f, r in zip(free, reserved, strict=True))

    def admit(self, idle_s: float, draining: bool) -> list[Row]:
        """Move waiting requests into free rows while their prompts fit, in queue order.
        Static batching admits only into an empty batch, once `max_rows` requests wait or the
        queue has been idle `STATIC_IDLE_S` (or the engine drains)."""
        if self.static:
            if self.running or not self.waiting:
                return []
            full = len(self.waiting) >= self.max_rows
            if not (full or draining or idle_s >= STATIC_IDLE_S):
                return []
        admitted = []
        while self.waiting and len(self.running) < self.max_rows:
            if not self._fits(self.waiting[0]):
                break
            row = Row(self._next_id, self.waiting.popleft())
            self._next_id += 1
            self.cache.add_row(row.id)
            self.running.append(row)
            admitted.append(row)
        return admitted

    # -- one step -------------------------------------------------------------------------------
    def _try_plan(self) -> list[tuple[Row, int]] | None:
        """Each row's tokens this step, oldest first; None when a decoding row cannot place
        its token or nothing can move."""
        free = self.cache.free_pages()
        budget, plan = self.prefill_chunk, []
        for row in self.running:
            want = 1 if row.left == 1 else min(row.left, budget)
            t = min(want, self.cache.max_new_tokens(row.id, free))
            if row.left == 1 and t < 1:
                return None
            if row.left > 1:
                budget -= t
            if t > 0:
                need = self.cache.worst_case_pages(row.id, t)
                free = [f - n for f, n in zip(free, need, strict=True)]
                plan.append((row, t))
        return plan or None

    def plan(self, requeue: Callable[[Request], None]) -> list[tuple[Row, int]]:
        """The step's plan, preempting the newest rows (handed to `requeue`) until it fits."""
        while self.running:
            plan = self._try_plan()
            if plan is not None:
                return plan
            if len(self.running) == 1:
                raise RuntimeError("one row does not fit the KV page pool: a sizing bug")
            row = self.running[-1]
            self.remove(row)
            self.preemptions += 1
            requeue(row.request)
        return []

    def remove(self, row: Row) -> None:
        """Drop a row from the batch, freeing its pages at once."""
        self.running.remove(row)
        self.cache.free_row(row.id)

    def find(self, request_id: str) -> Row | None:
        return next((r for r in self.running if r.request.id == request_id), None)
