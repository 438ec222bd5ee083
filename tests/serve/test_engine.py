"""The serving engine against oracles: every greedy completion served beside others (staggered
arrivals, different lengths, chunked prefills, preemption) equals `generate_reference` for its
prompt alone, a seeded sampled one equals `generate(..., seed=)` alone; pages held equal what
each row's layers cache, and all come back; bad requests name their field; the queue's bound,
cancel and drain; text with stop strings and split characters; a hammer from many threads."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from engine_helpers import (
    LetterTokenizer,
    engine_pages_match_their_rows,
    prompts,
    serve_model,
)
from generate_helpers import causal_routes

from mixture_of_depths.data.tokenizers import ByteTokenizer
from mixture_of_depths.generate import generate, generate_reference, prefill
from mixture_of_depths.serve.engine import Engine
from mixture_of_depths.serve.metrics import take_rate_text
from mixture_of_depths.serve.request import TextStream
from mixture_of_depths.serve.types import QueueFull, RequestError, SamplingParams, ShuttingDown

LENS = (5, 17, 3, 9, 12, 1, 20)  # prompt lengths: 17 and 20 are prefilled in chunks of 8
NEW = (7, 3, 10, 5, 8, 6, 4)
GREEDY = dict(temperature=0.0, stop_at_eos=False)


def _engine(model, **kw) -> Engine:  # noqa: ANN001
    return Engine(model, None, **{"max_rows": 3, "page_size": 4, "prefill_chunk": 8, **kw})


def _references(model, ps, ns) -> list[list[int]]:  # noqa: ANN001
    return [generate_reference(model, [p], n).tokens[0] for p, n in zip(ps, ns, strict=True)]


def _serve(engine: Engine, ps, ns, gap_s: float = 0.002) -> list[tuple]:  # noqa: ANN001
    """Submit with staggered arrivals to the running engine; wait for every result."""
    reqs = []
    for p, n in zip(ps, ns, strict=True):
        reqs.append(engine.submit(p, SamplingParams(max_tokens=n, **GREEDY)))
        time.sleep(gap_s)
    return [r.result(60) for r in reqs]


def _all_pages_back(engine: Engine) -> None:
    m = engine.metrics()
    assert m["requests_running"] == 0 and m["queue_depth"] == 0 and m["active_rows"] == 0
    assert set(m["kv_pages_in_use"].values()) == {0} and m["kv_bytes_in_use"] == 0


# -- exactness ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind", ["mod", "predictor", "staggered", "mlp-kv", "residual", "dense", "mode", "mor",
             "mor-share", "mor-token"]
)  # fmt: skip
def test_greedy_completions_served_together_equal_each_prompt_alone(kind):
    model = serve_model(kind)
    ps = prompts(LENS)
    expected = _references(model, ps, NEW)
    engine = _engine(model)
    engine.start()
    try:
        got = _serve(engine, ps, NEW)
    finally:
        assert engine.drain(10)
    assert [g[0] for g in got] == expected
    assert [g[2] for g in got] == ["length"] * len(ps)
    _all_pages_back(engine)
    m = engine.metrics()
    assert m["tokens_generated_total"] == sum(NEW) and m["tokens_prompt_total"] == sum(LENS)
    if kind != "dense":  # each router's share of the decoded tokens, from the decisions
        assert set(m["take_rate"]) == set(model.route_names())
        assert all(0.0 <= r <= 1.0 for r in m["take_rate"].values())


@pytest.mark.parametrize(
    "kind", ["predictor", "staggered", "mlp-kv", "residual", "mor", "mor-share"]
)
def test_new_rows_take_the_models_prefill_in_one_padded_forward(kind, monkeypatch):
    """Prompts of several lengths arriving together are prefilled by one right-padded forward of
    the model's prefill (padded to the longest); the continuation chunk of a long prompt stays
    entries; pages and answers stay exact."""
    import mixture_of_depths.serve.engine as engine_mod

    calls = []

    def spy(model, idx, lens, cache, **kw):  # noqa: ANN001, ANN003
        calls.append(lens.tolist())
        return prefill(model, idx, lens, cache, **kw)

    monkeypatch.setattr(engine_mod, "prefill", spy)
    model = serve_model(kind)
    lens, ns = (5, 11, 2, 8, 30), (6, 4, 7, 5, 3)
    ps = prompts(lens, seed=3)
    engine = _engine(model, max_rows=5, prefill_chunk=40)
    reqs = [
        engine.submit(p, SamplingParams(max_tokens=n, **GREEDY))
        for p, n in zip(ps, ns, strict=True)
    ]
    while engine.step():
        engine_pages_match_their_rows(engine)
    assert calls[0] == [5, 11, 2, 8, 14]  # the 30-token prompt: its first chunk only
    assert len(calls) == 1  # its second chunk (fed > 0) ran as entries
    assert [r.result(0)[0] for r in reqs] == _references(model, ps, ns)
    _all_pages_back(engine)


def test_static_batching_gives_the_same_answers():
    model = serve_model("predictor")
    ps = prompts(LENS)
    engine = _engine(model, batching="static")
    engine.start()
    try:
        got = _serve(engine, ps, NEW)
    finally:
        assert engine.drain(10)
    assert [g[0] for g in got] == _references(model, ps, NEW)
    _all_pages_back(engine)


def test_pages_follow_what_each_row_caches_at_every_step():
    """Driven step by step: after each step every row's (row, layer) length is what the full
    causal forward of its fed tokens caches there, on ceil(length / page_size) pages."""
    model = serve_model("staggered")
    engine = _engine(model, max_rows=4)
    ps = prompts(LENS)
    reqs = [
        engine.submit(p, SamplingParams(max_tokens=n, **GREEDY))
        for p, n in zip(ps, NEW, strict=True)
    ]
    steps = 0
    while engine.step():
        engine_pages_match_their_rows(engine)
        steps += 1
    assert steps > max(NEW)
    assert [r.result(0)[0] for r in reqs] == _references(model, ps, NEW)
    _all_pages_back(engine)


@pytest.mark.parametrize("static", [False, True], ids=["entries", "static-step"])
@pytest.mark.parametrize("kind", ["predictor", "dense", "mor", "mor-share"])
def test_preemption_under_a_tiny_pool_keeps_every_answer_exact(kind, static):
    """A pool of one row at full context (16 pages of 4) for four rows: rows are preempted,
    requeued with their tokens as prompt, and recomputed; answers do not change (a seeded
    sampled request's neither). Decode steps as entries, or through the static step (pages
    taken ahead for it in every layer, and those no token reached given back)."""
    model = serve_model(kind)
    ps, ns = prompts((10, 14, 6, 12, 9)), [22, 18, 25, 20, 16]
    engine = _engine(model, max_rows=4, kv_pages=16, static_decode=static)
    sampled = dict(max_tokens=24, temperature=0.9, top_k=30, top_p=0.95, seed=7)
    reqs = [
        engine.submit(p, SamplingParams(max_tokens=n, **GREEDY))
        for p, n in zip(ps, ns, strict=True)
    ]
    reqs.append(engine.submit(ps[0], SamplingParams(**sampled)))
    while engine.step():
        engine_pages_match_their_rows(engine)
    assert engine.metrics()["preemptions_total"] > 0
    assert [r.result(0)[0] for r in reqs[:-1]] == _references(model, ps, ns)
    alone = generate(model, [ps[0]], 24, temperature=0.9, top_k=30, top_p=0.95, seed=7)
    assert reqs[-1].result(0)[0] == alone.tokens[0]
    _all_pages_back(engine)


def test_seeded_sampled_requests_equal_generate_alone():
    model = serve_model("predictor")
    ps = prompts((6, 13, 2, 9))
    settings = [
        dict(temperature=0.8, seed=1),
        dict(temperature=1.3, top_k=5, seed=2),
        dict(temperature=0.7, top_p=0.8, seed=3),
        dict(temperature=1.0, top_k=20, top_p=0.9, seed=4),
    ]
    engine = _engine(model)
    engine.start()
    try:
        noise = engine.submit(ps[0], SamplingParams(max_tokens=12, temperature=1.0))  # unseeded
        reqs = [
            engine.submit(p, SamplingParams(max_tokens=9, stop_at_eos=False, **s))
            for p, s in zip(ps, settings, strict=True)
        ]
        got = [r.result(60)[0] for r in reqs]
        assert len(noise.result(60)[0]) == 12
    finally:
        assert engine.drain(10)
    for p, s, g in zip(ps, settings, got, strict=True):
        assert g == generate(model, [p], 9, **s).tokens[0], s


# -- text, stop strings, end of text ---------------------------------------------------------------


def test_stop_strings_and_end_of_text_end_the_completion():
    model = serve_model("predictor")
    p = prompts((8,))[0]
    ref = generate_reference(model, [p], 12).tokens[0]
    text = "".join(chr(65 + t) for t in ref)
    engine = Engine(model, LetterTokenizer(eot_id=ref[7]), page_size=4)
    engine.start()
    try:
        stop = text[4:6]
        r_stop = engine.submit(p, SamplingParams(max_tokens=12, temperature=0, stop=(stop,)))
        r_eos = engine.submit(p, SamplingParams(max_tokens=12, temperature=0))
        r_all = engine.submit(p, SamplingParams(max_tokens=12, temperature=0, stop_at_eos=False))
        events = list(r_stop.events(timeout=30))
    finally:
        assert engine.drain(10)
    cut = text.index(stop)
    ids, got, reason = r_stop.result(0)
    assert (got, reason) == (text[:cut], "stop")
    assert "".join(e.text for e in events) == got  # streamed text adds up to the answer
    assert [e.token for e in events if e.token is not None] == ids == ref[: len(ids)]
    eot = ref.index(ref[7])
    assert r_eos.result(0)[0] == ref[:eot] and r_eos.result(0)[2] == "stop"
    assert r_all.result(0) == (ref, LetterTokenizer(ref[7]).decode(ref), "length")


def test_text_waits_for_split_characters_and_holds_back_a_stop_prefix():
    tok = ByteTokenizer()
    text = "héllo €, wörld ∑x"
    stream = TextStream(tok, ())
    deltas = [stream.add(b) for b in text.encode("utf-8")]
    assert all("\ufffd" not in d for d, _ in deltas) and not any(s for _, s in deltas)
    assert "".join(d for d, _ in deltas) + stream.flush() == text
    stream = TextStream(tok, ("ö", "o €"))
    out = ""
    for b in text.encode("utf-8"):
        delta, stopped = stream.add(b)
        out += delta
        assert text.startswith(out) and not text[: len(out)].endswith("o ")
        if stopped:
            break
    assert stopped and out == "héll"


# -- bad input, the queue, cancel, drain -----------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, settings, param, match",
    [
        ([], {}, "prompt", "empty"),
        ([1, 61], {}, "prompt", r"61 at index 1 is not an id in \[0, 61\)"),
        ([-1], {}, "prompt", "not an id"),
        ([1] * 64, {}, "prompt", "the context is 64"),
        ([1] * 10, dict(max_tokens=0), "max_tokens", ">= 1"),
        ([1] * 10, dict(max_tokens=55), "max_tokens", "at most 54"),
        ([1], dict(temperature=-0.5), "temperature", ">= 0"),
        ([1], dict(top_p=0.0), "top_p", r"\(0, 1\]"),
        ([1], dict(top_p=1.5), "top_p", r"\(0, 1\]"),
        ([1], dict(top_k=0), "top_k", ">= 1"),
        ([1], dict(seed=2**65), "seed", "integer in"),
        ([1], dict(stop=("x",)), "stop", "need a tokenizer"),
    ],
)
def test_each_bad_request_names_its_field(prompt, settings, param, match):
    engine = _engine(serve_model("dense"))
    with pytest.raises(RequestError, match=match) as err:
        engine.submit(prompt, SamplingParams(**settings))
    assert err.value.param == param
    assert engine.metrics()["requests_total"] == 0


def test_the_queue_is_bounded_and_drain_finishes_what_it_holds():
    model = serve_model("dense")
    engine = _engine(model, max_rows=2, max_queue=3)  # not started: nothing leaves the queue
    ps = prompts((4, 6, 3, 5, 7))
    reqs = [engine.submit(p, SamplingParams(max_tokens=4, **GREEDY)) for p in ps]
    with pytest.raises(QueueFull) as err:
        engine.submit(ps[0], SamplingParams(max_tokens=4))
    assert err.value.retry_after >= 1
    assert engine.metrics()["queue_depth"] == 5
    assert engine.drain(30)  # starts the thread, finishes them all, then stops
    assert [r.result(0)[0] for r in reqs] == _references(model, ps, [4] * 5)
    with pytest.raises(ShuttingDown):
        engine.submit(ps[0], SamplingParams(max_tokens=4))
    _all_pages_back(engine)


def test_cancel_frees_rows_and_pages_and_drain_cancels_past_its_grace():
    model = serve_model("predictor")
    engine = _engine(model, max_rows=2)
    ps = prompts((6, 9, 4))
    running = engine.submit(ps[0], SamplingParams(max_tokens=50, **GREEDY))
    other = engine.submit(ps[1], SamplingParams(max_tokens=50, **GREEDY))
    queued = engine.submit(ps[2], SamplingParams(max_tokens=50, **GREEDY))
    for _ in range(3):
        engine.step()
    assert engine.metrics()["requests_running"] == 2 and sum(engine.cache.pages_in_use()) > 0
    engine.cancel(running.id)
    engine.cancel(queued.id)
    engine.cancel(queued.id)  # idempotent
    engine.cancel("no-such-request")
    engine.step()
    assert running.result(0)[2] == queued.result(0)[2] == "cancelled"
    assert len(running.result(0)[0]) == 3
    engine_pages_match_their_rows(engine)  # only `other`'s pages are left
    assert engine.metrics()["requests_running"] == 1
    assert not engine.drain(grace_s=0.0)  # `other` cannot finish in no time: cancelled
    assert other.result(1)[2] == "cancelled"
    _all_pages_back(engine)


def test_aevents_streams_for_asyncio_and_closing_it_cancels():
    model = serve_model("predictor")
    ps = prompts((5, 8))
    engine = _engine(model)
    engine.start()

    async def main() -> tuple[list[int], str | None]:
        a = engine.submit(ps[0], SamplingParams(max_tokens=6, **GREEDY))
        b = engine.submit(ps[1], SamplingParams(max_tokens=55, **GREEDY))
        tokens = [e.token async for e in a.aevents() if e.token is not None]
        events = b.aevents()
        await anext(events)
        await events.aclose()  # the client went away after one event
        return tokens, b.result(10)[2]

    try:
        tokens, reason = asyncio.run(main())
    finally:
        assert engine.drain(10)
    assert tokens == _references(model, ps[:1], [6])[0]
    assert reason == "cancelled"
    _all_pages_back(engine)


def test_aevents_gets_each_token_at_the_end_of_its_step():
    """Token events are pushed unwoken and the step wakes each event loop once at its end
    (`request.wake_all`): a reader gets the step's token while the request is still running,
    with no later event to wake it, and one wake-up per loop serves several requests."""
    model = serve_model("predictor")
    engine = _engine(model, prefill_chunk=64)  # both prompts in the first step
    ps = prompts((5, 8))
    reqs = [engine.submit(p, SamplingParams(max_tokens=20, **GREEDY)) for p in ps]

    async def first_tokens(loop_calls: list[int]) -> list[int]:
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counted(callback, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            if getattr(callback, "__name__", "") == "_set_all":  # the engine's wake-ups
                loop_calls.append(len(args[0]))
            return real(callback, *args, **kw)

        loop.call_soon_threadsafe = counted
        streams = [r.aevents() for r in reqs]
        waits = [asyncio.ensure_future(anext(s)) for s in streams]
        await asyncio.sleep(0)  # the readers wait, registered with this loop

        def step_until_sampled() -> None:
            while not all(r.generated for r in reqs):
                engine.step()

        await asyncio.to_thread(step_until_sampled)
        events = await asyncio.wait_for(asyncio.gather(*waits), timeout=10)
        for stream in streams:
            await stream.aclose()
        return [e.token for e in events]

    calls: list[int] = []
    tokens = asyncio.run(first_tokens(calls))
    assert tokens == [r.generated[0] for r in reqs]
    assert all(r.finish_reason is None for r in reqs)  # woken by the token, not by a finish
    assert calls == [2]  # both requests' first tokens came in one step: one wake-up
    engine.step()  # the closed readers' cancels
    _all_pages_back(engine)


# -- a hammer ------------------------------------------------------------------------------------


def _hammer(n_requests: int, n_threads: int) -> None:
    model = serve_model("predictor")
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(1, 24, (20,), generator=g).tolist()
    news = torch.randint(1, 12, (20,), generator=g).tolist()
    ps = prompts(lens, seed=6)
    expected = _references(model, ps, news)
    engine = Engine(model, None, max_rows=8, page_size=4, prefill_chunk=16, max_queue=n_requests)
    engine.start()
    failures: list[str] = []

    def client(k: int) -> None:
        for i in range(k, n_requests, n_threads):
            j = i % len(ps)
            req = engine.submit(ps[j], SamplingParams(max_tokens=news[j], **GREEDY))
            streamed = [e.token for e in req.events(timeout=60) if e.token is not None]
            if streamed != expected[j] or req.result(0)[0] != expected[j]:
                failures.append(f"request {i} (prompt {j})")

    threads = [threading.Thread(target=client, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    try:
        assert not failures, failures
        assert engine.metrics()["requests_total"] == n_requests
    finally:
        assert engine.drain(10)
    _all_pages_back(engine)


def test_a_hammer_of_200_requests_from_32_threads():
    _hammer(200, 32)


def test_a_failing_step_ends_its_batch_with_error_and_the_engine_keeps_serving(monkeypatch):
    import mixture_of_depths.serve.engine as engine_module

    model = serve_model("predictor")
    ps = prompts((6, 9))
    engine = _engine(model)
    real = engine_module.decode_step
    calls = {"n": 0}

    def flaky(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")
        return real(*args, **kw)

    monkeypatch.setattr(engine_module, "decode_step", flaky)
    failed = engine.submit(ps[0], SamplingParams(max_tokens=8, **GREEDY))
    while engine.step():
        pass
    assert failed.result(0)[2] == "error"
    _all_pages_back(engine)
    ok = engine.submit(ps[1], SamplingParams(max_tokens=8, **GREEDY))
    while engine.step():
        pass
    assert ok.result(0)[0] == _references(model, ps[1:], [8])[0]


def test_take_rates_are_the_decoded_tokens_share_of_each_routers_decisions():
    """Over generated tokens fed back (not prompts, not the last token, never sampled again),
    each router's take-rate is the share the full causal forward takes."""
    model = serve_model("staggered")
    ps, ns = prompts((7, 4)), [10, 6]
    engine = _engine(model, max_rows=2)
    reqs = [
        engine.submit(p, SamplingParams(max_tokens=n, **GREEDY))
        for p, n in zip(ps, ns, strict=True)
    ]
    while engine.step():
        pass
    fed = []
    for p, r in zip(ps, reqs, strict=True):
        seq = p + r.result(0)[0]
        fed.append(causal_routes(model, seq[:-1])[len(p) :])
    decisions = torch.cat(fed).double()
    m = engine.metrics()
    assert m["tokens_decoded_total"] == len(decisions) == sum(ns) - len(ns)
    names = list(m["take_rate"])
    assert names == ["0.attn", "0.mlp", "2.attn", "2.mlp", "3.attn", "3.mlp"]
    for name, rate in zip(names, decisions.mean(0).tolist(), strict=True):
        assert m["take_rate"][name] == pytest.approx(rate, abs=1e-12), name
    # the line `mod serve` says when it stops
    line = take_rate_text(m, model.config)
    assert line.startswith(f"take-rates over the {len(decisions)} tokens decoded: ")
    assert line.endswith("(capacity 30.0%; causal thresholds 0, uncalibrated)")
    for name, rate in zip(names, decisions.mean(0).tolist(), strict=True):
        assert f"L{name} {rate:.1%}" in line


def test_static_batching_admits_only_into_an_empty_batch():
    model = serve_model("dense")
    ps = prompts((5, 6, 7))
    engine = _engine(model, max_rows=2, batching="static")
    first = [
        engine.submit(p, SamplingParams(max_tokens=n, **GREEDY))
        for p, n in [(ps[0], 3), (ps[1], 9)]
    ]
    assert engine.step()  # a full batch starts at once
    late = engine.submit(ps[2], SamplingParams(max_tokens=4, **GREEDY))
    while first[1].finish_reason is None:
        assert engine.metrics()["queue_depth"] == 1  # the row `first[0]` left stays empty
        engine.step()
    time.sleep(0.06)  # a partial batch starts once the queue has been idle
    while engine.step():
        pass
    assert late.result(0)[0] == _references(model, ps[2:], [4])[0]
