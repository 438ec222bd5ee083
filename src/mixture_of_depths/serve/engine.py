"""`Engine`: the serving engine under `mod serve`. One scheduler thread owns the model; requests
join the running batch at the next step and leave it the moment they finish (docs/serving.md).

Each step (`Engine._step`) admits waiting requests whose prompts fit the KV pages, plans each
row's tokens (scheduler.py: a decoding row feeds its last sampled token, a prefilling row a chunk
of its prompt), runs the model's own forward over the paged cache (paged.py): new rows' first
chunks as one right-padded causal prefill, the other rows' tokens as one forward of entries, where
each routed layer runs only on the entries whose token takes it, samples each row that has
fed all it holds with its own settings and its own `torch.Generator`, emits the events, and drops
finished and cancelled rows, freeing their pages at once. An error computing one row fails that
request alone (`_step`). Admission and preemption: see
scheduler.py's docstring (admit on the prompt's pages, preempt by recompute when the pool runs
dry). `batching="static"` is the baseline: a batch starts only when the last one has finished.

Sampling is `generate.sample_next` on each row's logits alone, with a generator seeded as
`generate` seeds it, so a seeded request samples what `generate(model, [prompt], ..., seed=seed)`
samples for that prompt alone (and greedy requests equal `generate_reference`).
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
import uuid
from collections.abc import Sequence

import torch

from ..generate import GREEDY_BELOW, decode_step, prefill, right_pad, router_names, sample_next
from ..model import MoDTransformer
from ..static_cache import static_step
from .paged import PagedKVCache
from .request import Request, wake_all
from .scheduler import Row, Scheduler
from .types import Event, QueueFull, RequestError, SamplingParams, ShuttingDown

__all__ = ["Engine", "Request"]

log = logging.getLogger(__name__)
BATCHING = ("continuous", "static")
_SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


class Engine:
    """Continuous batching over a paged KV cache for one model (see the module docstring)."""

    def __init__(
        self,
        model: MoDTransformer,
        tokenizer,  # noqa: ANN001  (data.tokenizers.Tokenizer, or None: token ids only)
        *,
        model_name: str = "mod",
        max_rows: int = 16,
        page_size: int = 16,
        kv_pages: int | None = None,
        max_queue: int = 64,
        prefill_chunk: int = 256,
        batching: str = "continuous",
        device: str | torch.device = "cpu",
        static_decode: bool | None = None,
    ) -> None:
        for name, value, lo in (
            ("max_rows", max_rows, 1),
            ("page_size", page_size, 1),
            ("max_queue", max_queue, 0),
            ("prefill_chunk", prefill_chunk, 1),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
        if batching not in BATCHING:
            raise ValueError(f"batching must be one of {BATCHING}, got {batching!r}")
        cfg = model.config
        self.model = model.to(device).eval()
        self.tokenizer, self.model_name = tokenizer, model_name
        self.max_context, self.vocab_size = cfg.max_seq_len, cfg.vocab_size
        self.device = torch.device(device)
        self.eos_id: int | None = getattr(tokenizer, "eot_id", None)
        if kv_pages is None:  # max_rows rows at full context in every layer
            kv_pages = max_rows * math.ceil(cfg.max_seq_len / page_size)
        dtype = next(model.parameters()).dtype
        # The static decode step (docs/serving.md): by default on CUDA, where a graph replays it
        self.static = self.device.type == "cuda" if static_decode is None else static_decode
        rows = max_rows if self.static else 0
        self.cache = PagedKVCache(cfg, kv_pages, page_size, self.device, dtype, rows)
        self.decoder = static_step(self.model, self.cache.static) if self.static else None
        self.max_rows, self.max_queue = max_rows, max_queue
        self.sched = Scheduler(self.cache, max_rows, prefill_chunk, batching)
        self.routers = router_names(model)
        self._cond = threading.Condition()  # guards the queue, the flags and the counters
        self._cancels: set[str] = set()
        self._draining = self._stopping = self._wake = False
        self._thread: threading.Thread | None = None
        self._last_submit = time.monotonic()
        self._counts = dict(
            requests_total=0,
            tokens_prompt_total=0,
            tokens_generated_total=0,
            steps_total=0,
            tokens_decoded_total=0,
        )
        self._takes = [0] * len(self.routers)
        self._woken: list[Request] = []  # requests given events this step, not yet woken
        self._request_s = 1.0  # a running mean of request times, for Retry-After

    # -- the caller's side ----------------------------------------------------------------------
    def start(self) -> None:
        with self._cond:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="mod-engine", daemon=True)
            self._thread.start()

    def submit(self, prompt: Sequence[int], params: SamplingParams) -> Request:
        """Queue a request (thread-safe); RequestError naming the field, QueueFull, or
        ShuttingDown when it cannot be."""
        prompt = self._check(prompt, params)
        seed = secrets.randbits(63) if params.seed is None else params.seed
        generator = torch.Generator(device=self.device).manual_seed(seed)
        request_id = f"cmpl-{uuid.uuid4().hex[:24]}"
        request = Request(request_id, prompt, params, self.tokenizer, generator, self.cancel)
        with self._cond:
            if self._draining:
                raise ShuttingDown("the server is shutting down and admits no new requests")
            room = self.max_queue + max(self.max_rows - len(self.sched.running), 0)
            if len(self.sched.waiting) >= room:
                wait = self._request_s * (len(self.sched.waiting) + 1) / self.max_rows
                raise QueueFull(
                    f"the queue is full ({self.max_queue} requests wait): retry later",
                    retry_after=float(min(max(math.ceil(wait), 1), 60)),
                )
            self.sched.waiting.append(request)
            self._counts["requests_total"] += 1
            self._counts["tokens_prompt_total"] += len(prompt)
            self._last_submit = time.monotonic()
            self._poke()
        return request

    def cancel(self, request_id: str) -> None:
        """Cancel a request: its row and pages are freed at the next step (idempotent)."""
        with self._cond:
            self._cancels.add(request_id)
            self._poke()

    def drain(self, grace_s: float = 30.0) -> bool:
        """Stop admitting; let running and queued requests finish within `grace_s` seconds,
        cancel what is left, stop the thread. True if everything finished in time."""
        with self._cond:
            self._draining = True
            busy = bool(self.sched.waiting or self.sched.running)
            self._poke()
        if busy:
            self.start()
        with self._cond:
            done = self._cond.wait_for(
                lambda: not self.sched.waiting and not self.sched.running, timeout=grace_s
            )
            self._stopping = True
            self._poke()
            thread = self._thread
        if thread is not None:
            thread.join()
        return done

    def metrics(self) -> dict:
        with self._cond:
            counts = dict(self._counts)
            decoded = counts["tokens_decoded_total"]
            take_rate = {
                n: (t / decoded if decoded else 0.0)
                for n, t in zip(self.routers, self._takes, strict=True)
            }
            in_use = self.cache.pages_in_use()
            return {
                **counts,
                "requests_running": len(self.sched.running),
                "queue_depth": len(self.sched.waiting),
                "active_rows": len(self.sched.running),  # rows in the batch, holding pages
                "kv_pages_in_use": dict(enumerate(in_use)),
                "kv_pages_total": {i: p.n_pages for i, p in enumerate(self.cache.pools)},
                "kv_bytes_in_use": self.cache.nbytes_in_use,
                "kv_bytes_allocated": self.cache.nbytes_allocated,
                "take_rate": take_rate,
                "preemptions_total": self.sched.preemptions,
            }

    # -- checks ---------------------------------------------------------------------------------
    def _check(self, prompt: Sequence[int], params: SamplingParams) -> list[int]:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str | bytes) or not isinstance(prompt, Sequence):
            raise RequestError("prompt must be a list of token ids", param="prompt")
        if not prompt:
            raise RequestError("prompt is empty: give at least one token", param="prompt")
        for i, t in enumerate(prompt):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise RequestError(
                    f"prompt token {t!r} at index {i} is not an id in [0, {self.vocab_size})",
                    param="prompt",
                )
        n, ctx = len(prompt), self.max_context
        if n >= ctx:
            raise RequestError(
                f"prompt has {n} tokens: the context is {ctx}, so at most {ctx - 1} leave room "
                "for one new token",
                param="prompt",
            )
        _check_params(params, n, ctx, self.tokenizer is not None)
        return [int(t) for t in prompt]

    # -- the scheduler thread -------------------------------------------------------------------
    def step(self) -> bool:
        """One scheduler iteration on the calling thread: cancellations, admission, one forward
        of the planned rows, sampling and events. False when there was nothing to run. The
        scheduler thread loops on this; a test may call it instead of `start()`."""
        with self._cond:
            self._wake = False
            self._apply_cancels()
            idle = time.monotonic() - self._last_submit
            try:
                self.sched.admit(idle, self._draining)
                plan = self.sched.plan(self.sched.waiting.appendleft)
            except Exception:  # a bug: fail the batch, keep serving
                log.exception("engine planning failed; the running requests end with 'error'")
                for row in list(self.sched.running):
                    self._end(row, "error")
                return True
        if not plan:
            return False
        try:
            self._step(plan)
        except Exception:  # a bug, not a request's fault: fail the batch, keep serving
            log.exception("engine step failed; the running requests end with 'error'")
            for row in list(self.sched.running):
                self._end(row, "error")
        finally:  # one wake-up per event loop for the step's token events
            wake_all(self._woken)
            self._woken.clear()
        with self._cond:
            self._counts["steps_total"] += 1
            self._cond.notify_all()
        return True

    def _poke(self) -> None:
        """Wake the scheduler thread (the caller holds the lock)."""
        self._wake = True
        self._cond.notify_all()

    def _run(self) -> None:
        while not self._stopping:
            if self.step():
                continue
            with self._cond:  # nothing ran: sleep until a submit, cancel or drain (static
                if not (self._wake or self._stopping):  # batching: poll for its idle time)
                    self._cond.wait(0.01 if self.sched.waiting else None)
        with self._cond:
            for row in list(self.sched.running):
                self._end(row, "cancelled")
            while self.sched.waiting:
                self.sched.waiting.popleft().finish("cancelled")
            self._cond.notify_all()

    def _apply_cancels(self) -> None:
        for request_id in self._cancels:
            row = self.sched.find(request_id)
            if row is not None:
                self._end(row, "cancelled")
                continue
            for request in self.sched.waiting:
                if request.id == request_id:
                    self.sched.waiting.remove(request)
                    request.finish("cancelled")
                    break
        self._cancels.clear()

    def _end(self, row: Row, reason: str, error: Exception | None = None) -> None:
        """Drop the row (its pages freed now) and send the finish event. A row already dropped
        (its finish failed on its held-back text, then `_fail` ends it) sends the event alone."""
        if row in self.sched.running:
            self.sched.remove(row)
        request = row.request
        elapsed = time.monotonic() - request.submitted
        self._request_s = 0.9 * self._request_s + 0.1 * elapsed
        request.finish(reason, error)

    def _step(self, plan: list[tuple[Row, int]]) -> None:
        """The plan's forward, then each row's sampling and events. One row's failure fails its
        request alone (docs/serving.md, "Faults"): a failed forward is undone and its rows run
        one by one, so that only a row whose own forward fails ends; a row whose sampling fails
        ends, the others sample on. What the host reads of the step (the sampled tokens, their
        logits' finiteness, the routing, the static step's lengths) comes in one transfer."""
        held = self.cache.snapshot([row.id for row, _ in plan])
        try:
            fw = self._forward(plan)
        except Exception as exc:
            self.cache.restore(held)  # the pages and lengths the forward took are returned
            if len(plan) == 1:
                self._fail(plan[0][0], exc)
                return
            log.warning("a forward of %d rows failed (%r); running them one by one", len(plan), exc)
            for one in plan:
                self._step([one])
            return
        feeds = {row.id: t for row, t in plan}
        ts = [feeds[row.id] for row in fw.rows]
        ready = [i for i, (row, t) in enumerate(zip(fw.rows, ts, strict=True)) if row.left == t]
        picked = [fw.rows[i] for i in ready]
        logits = fw.logits if len(ready) == len(fw.rows) else fw.logits[ready]
        tokens, finite, errors = self._sample(picked, logits)
        tokens, finite, lens, *routing = to_host([tokens, finite, fw.lengths, *fw.routing])
        if lens is not None:
            self.cache.static_done([row.id for row in fw.static_rows], lens)
        self._count_routing(fw.rows, ts, torch.cat([r.long() for r in routing]))
        for row, t in zip(fw.rows, ts, strict=True):
            row.fed += t
        sampled = list(zip(picked, tokens.tolist(), finite.tolist(), errors, strict=True))
        for row, _, ok, error in sampled:
            if error is None and not ok:  # the argmax of NaNs would be a token
                error = FloatingPointError("the model's logits for this request are not finite")
            if error is not None:
                self._fail(row, error)
        sampled = [(row, token) for row, token, ok, error in sampled if ok and error is None]
        with self._cond:
            self._counts["tokens_generated_total"] += len(sampled)
        for row, token in sampled:
            try:
                self._emit(row, token)
            except Exception as exc:  # its text failed (a tokenizer's error): this row alone
                self._fail(row, exc)

    def _forward(self, plan: list[tuple[Row, int]]) -> _Forward:
        """Decode rows through the static step (when the engine has one), new rows' first
        chunks through the model's prefill (one right-padded forward), the other rows' tokens
        as one forward of entries: each row's last logits and every fed token's routing, left
        where the model made them."""
        new = [(row, t) for row, t in plan if row.fed == 0]
        rest = [(row, t) for row, t in plan if row.fed > 0]
        fw = _Forward()
        if self.static:  # one token per row: the static step; chunks: entries, as ever
            self._static_forward([row for row, t in rest if t == 1], fw)
            rest = [(row, t) for row, t in rest if t > 1]
        if new:
            view = self.cache.prefill([row.id for row, _ in new])
            idx, lens = right_pad([row.request.tokens[:t] for row, t in new], self.device)
            logits, table = prefill(self.model, idx, lens, view, host=False)
            fw.add([row for row, _ in new], logits, [table[i, :t] for i, (_, t) in enumerate(new)])
        if rest:
            rows, positions, tokens, last = [], [], [], []
            for row, t in rest:
                rows += [row.id] * t
                positions += range(row.fed, row.fed + t)
                tokens += row.request.tokens[row.fed : row.fed + t]
                last.append(len(rows) - 1)
            view = self.cache.step(rows, positions)
            logits, routing = decode_step(self.model, torch.tensor(tokens), view, host=False)
            fw.add([row for row, _ in rest], logits[last], [routing])
        return fw

    def _static_forward(self, rows: list[Row], fw: _Forward) -> None:
        """The rows' next tokens through the static decode step over the paged cache's row
        slots (`PagedKVCache.static_step`); their lengths are read with the step's tokens."""
        if not rows:
            return
        ids = [row.id for row in rows]
        tokens = self.cache.static_step(
            ids, [r.fed for r in rows], [r.request.tokens[r.fed] for r in rows]
        )
        logits, routing = self.decoder(tokens)
        s = torch.tensor([self.cache.slots[i] for i in ids], device=self.device)
        fw.add(rows, logits[s], [routing[s]])
        fw.static_rows, fw.lengths = rows, self.cache.static.lengths

    def _fail(self, row: Row, exc: Exception) -> None:
        """End one request with an error (its pages freed), the rest of the batch untouched."""
        log.error("request %s failed: %r", row.request.id, exc, exc_info=exc)
        self._end(row, "error", exc)

    def _count_routing(self, rows: list[Row], ts: list[int], routing: torch.Tensor) -> None:
        """Take-rates over generated tokens fed back, each counted once (not again when a
        preempted request recomputes them): one sum over the counted entries of `routing`."""
        i, counted = 0, []
        for row, t in zip(rows, ts, strict=True):
            request = row.request
            first = max(row.fed, request.prompt_tokens + request.decoded)
            if row.fed + t > first:
                counted += range(i + first - row.fed, i + t)
                request.decoded += row.fed + t - first
            i += t
        took = routing[counted].long().sum(0).tolist() if counted else [0] * len(self._takes)
        with self._cond:
            self._counts["tokens_decoded_total"] += len(counted)
            self._takes = [a + b for a, b in zip(self._takes, took, strict=True)]

    def _sample(
        self, rows: list[Row], logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, list[Exception | None]]:
        """Each row's next token (on the device, unread), whether its logits are finite, and
        the error its sampling raised: the greedy rows in one argmax, each other row with its
        own settings and generator on its own logits, as `generate` samples it."""
        tokens = torch.zeros(len(rows), dtype=torch.long, device=logits.device)
        finite = torch.isfinite(logits).all(-1)
        errors: list[Exception | None] = [None] * len(rows)
        greedy = [i for i, r in enumerate(rows) if r.request.params.temperature < GREEDY_BELOW]
        alone = [i for i, r in enumerate(rows) if r.request.params.temperature >= GREEDY_BELOW]
        if greedy:
            try:
                tokens[greedy] = sample_next(logits[greedy], 0.0)
            except Exception:  # noqa: BLE001  (find the row at fault: each alone)
                alone = sorted(greedy + alone)
        if alone:  # a row of NaNs samples from zeros (a CUDA device assert otherwise), then fails
            safe = torch.where(finite[:, None], logits, 0.0)
        for i in alone:
            p = rows[i].request.params
            try:
                tokens[i] = sample_next(
                    safe[i : i + 1], p.temperature, p.top_k, p.top_p, rows[i].request.generator
                )[0]
            except Exception as exc:
                errors[i] = exc
        return tokens, finite, errors

    def _emit(self, row: Row, token: int) -> None:
        """A sampled token: its event (its readers woken once the step has pushed them all),
        and the row's end at end-of-text, a stop string or `max_tokens`."""
        request, p = row.request, row.request.params
        if p.stop_at_eos and token == self.eos_id:
            self._end(row, "stop")
            return
        request.tokens.append(token)
        text, stopped = request.text.add(token)
        n = len(request.generated)
        event = Event(token=token, text=text, prompt_tokens=request.prompt_tokens,
                      completion_tokens=n)  # fmt: skip
        request.push(event, wake=False)
        self._woken.append(request)
        if stopped:
            self._end(row, "stop")
        elif n >= p.max_tokens:
            self._end(row, "length")


class _Forward:
    """One step's forward, as the engine reads it: its rows in output order, each row's last
    logits (R, vocab), its fed tokens' routing (pieces, each (entries, n_routers), in the rows'
    order) and, after a static step, its rows and the cache's lengths (layers, slots)."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self._logits: list[torch.Tensor] = []
        self.routing: list[torch.Tensor] = []
        self.static_rows: list[Row] = []
        self.lengths: torch.Tensor | None = None

    def add(self, rows: list[Row], logits: torch.Tensor, routing: list[torch.Tensor]) -> None:
        self.rows += rows
        self._logits.append(logits)
        self.routing += routing

    @property
    def logits(self) -> torch.Tensor:
        return self._logits[0] if len(self._logits) == 1 else torch.cat(self._logits)


def to_host(tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """The tensors on the host (None stays None): those on a device moved in one transfer (a
    step's one sync), as long integers; those already on the host as they are."""
    moved = [t for t in tensors if t is not None and t.device.type != "cpu"]
    if not moved:
        return list(tensors)
    flat = torch.cat([t.reshape(-1).long() for t in moved]).cpu()
    out: list[torch.Tensor | None] = []
    i = 0
    for t in tensors:
        if t is None or t.device.type == "cpu":
            out.append(t)
            continue
        out.append(flat[i : i + t.numel()].view(t.shape))
        i += t.numel()
    return out


def _check_params(p: SamplingParams, n: int, ctx: int, has_tokenizer: bool) -> None:
    """Each sampling setting in its range, or a RequestError naming it."""

    def number(x: object) -> bool:
        return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)

    if not isinstance(p.max_tokens, int) or isinstance(p.max_tokens, bool) or p.max_tokens < 1:
        raise RequestError(
            f"max_tokens must be an integer >= 1, got {p.max_tokens!r}", param="max_tokens"
        )
    if n + p.max_tokens > ctx:
        raise RequestError(
            f"max_tokens={p.max_tokens} with a prompt of {n} tokens is {n + p.max_tokens} "
            f"positions, more than the context of {ctx}: at most {ctx - n} here",
            param="max_tokens",
        )
    if not number(p.temperature) or p.temperature < 0:
        raise RequestError(
            f"temperature must be a number >= 0 (0: greedy), got {p.temperature!r}",
            param="temperature",
        )
    if p.top_p is not None and (not number(p.top_p) or not 0 < p.top_p <= 1):
        raise RequestError(f"top_p must be in (0, 1], got {p.top_p!r}", param="top_p")
    if p.top_k is not None and (
        not isinstance(p.top_k, int) or isinstance(p.top_k, bool) or p.top_k < 1
    ):
        raise RequestError(f"top_k must be an integer >= 1, got {p.top_k!r}", param="top_k")
    if p.seed is not None and (
        not isinstance(p.seed, int)
        or isinstance(p.seed, bool)
        or not _SEED_RANGE[0] <= p.seed <= _SEED_RANGE[1]
    ):
        raise RequestError(
            f"seed must be an integer in [{_SEED_RANGE[0]}, {_SEED_RANGE[1]}], got {p.seed!r}",
            param="seed",
        )
    stops = p.stop
    if isinstance(stops, str) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be a list of non-empty strings, got {stops!r}", param="stop")
    if stops and not has_tokenizer:
        raise RequestError(
            "stop strings need a tokenizer: this engine serves token ids only", param="stop"
        )
