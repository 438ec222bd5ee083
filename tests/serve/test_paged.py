"""The paged KV cache against oracles: prefill chunks and decode steps of several rows in one
forward equal the full causal forward of each row alone (logits and routing decisions, float64),
each (row, layer) holds the tokens that layer caches on ceil(tokens / page_size) pages, and the
pools get every page back."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import KINDS, PagedDriver, prompts, serve_model

from mixture_of_depths.serve.paged import PagedKVCache

TOL = dict(rtol=0.0, atol=1e-10)


def _drive(model, page_size: int = 4) -> tuple[PagedDriver, dict[int, list]]:  # noqa: ANN001
    """Three rows: chunked prefills of different lengths beside other rows' decode steps (one
    row joins late, one starts with a one-token chunk), then greedy decoding together."""
    d = PagedDriver(model, n_pages=64, page_size=page_size)
    p = prompts((7, 13, 3))
    got: dict[int, list] = {0: [], 1: [], 2: []}

    def feed(feeds):  # noqa: ANN001, ANN202
        for row, out in d.feed(feeds).items():
            got[row].append(out)

    def greedy(row: int) -> list[int]:
        return [int(got[row][-1][0][-1].argmax())]

    feed({0: p[0][:5], 1: p[1][:1]})
    feed({0: p[0][5:], 1: p[1][1:9], 2: p[2]})
    feed({0: greedy(0), 1: p[1][9:], 2: greedy(2)})
    for _ in range(6):
        feed({2: greedy(2), 0: greedy(0), 1: greedy(1)})
    return d, got


@pytest.mark.parametrize("kind", list(KINDS))
def test_chunks_and_decode_steps_in_one_forward_equal_each_row_alone(kind):
    model = serve_model(kind)
    d, got = _drive(model)
    for row, seq in d.seqs.items():
        full = model(torch.tensor([seq]), routing="causal")
        logits = torch.cat([g[0] for g in got[row]])
        torch.testing.assert_close(logits, full.logits[0], **TOL)
        routing = torch.cat([g[1] for g in got[row]])
        expected = [r.mask[0] for r in full.routes]
        assert torch.equal(routing, torch.stack(expected, -1) if expected else routing), row


@pytest.mark.parametrize(
    "kind", ["predictor", "staggered", "mlp-kv", "residual", "dense", "mor", "mor-share"]
)
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_each_row_holds_ceil_tokens_over_page_size_pages_and_frees_them(kind, page_size):
    model = serve_model(kind)
    d, _ = _drive(model, page_size)
    d.check_pages()  # lengths = what the full causal forward caches; pages = ceil(len / size)
    in_use = d.cache.pages_in_use()
    layers = range(model.config.n_kv_layers)
    assert in_use == [sum(d.cache.pages_held(r)[vl] for r in d.seqs) for vl in layers]
    assert d.cache.nbytes_in_use == sum(in_use) * d.cache.pools[0].page_bytes
    if kind == "predictor" and page_size == 1:  # routed layers hold fewer than the dense 1
        assert max(in_use[0], in_use[2], in_use[3]) < in_use[1]
    for row in list(d.seqs):
        d.cache.free_row(row)
    assert d.cache.pages_in_use() == [0] * len(layers)
    assert d.cache.free_pages() == [64] * len(layers)


def test_pool_storage_grows_with_the_pages_in_use():
    model = serve_model("predictor")
    cache = PagedKVCache(model.config, n_pages=200, page_size=4, dtype=torch.float64)
    assert cache.nbytes_allocated == 0
    d = PagedDriver(model, 200, 4)
    d.feed({0: prompts((9,))[0]})
    allocated = d.cache.nbytes_allocated
    assert 0 < allocated < 200 * 4 * d.cache.pools[0].page_bytes
    assert all(p.k.shape[0] >= p.in_use for p in d.cache.pools)


def test_sizes_and_exhaustion_are_clear_errors():
    cfg = serve_model("dense").config  # max_seq_len 64
    with pytest.raises(ValueError, match="kv_pages=15 cannot hold one row.*needs 16 pages"):
        PagedKVCache(cfg, n_pages=15, page_size=4)
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        PagedKVCache(cfg, n_pages=15, page_size=0)
    d = PagedDriver(serve_model("dense"), n_pages=16, page_size=4)
    d.feed({0: prompts((40,))[0]})
    with pytest.raises(RuntimeError, match="KV page pool exhausted"):
        d.feed({1: prompts((40,))[0]})


def test_worst_case_and_room_count_pages_per_layer():
    d = PagedDriver(serve_model("predictor"), n_pages=64, page_size=4)
    d.feed({0: prompts((6,))[0]})
    cache = d.cache
    lens, held = cache.lengths[0], cache.pages_held(0)
    need = cache.worst_case_pages(0, 3)
    assert need == [-(-(n + 3) // 4) - h for n, h in zip(lens, held, strict=True)]
    free = [2] * 4
    room = cache.max_new_tokens(0, free)
    assert room == min((2 + h) * 4 - n for n, h in zip(lens, held, strict=True))
    assert max(cache.worst_case_pages(0, room)) <= 2 < max(cache.worst_case_pages(0, room + 1))
    assert cache.max_new_tokens(None, free) == 8


@pytest.mark.parametrize("kind", ["predictor", "staggered", "mlp-kv", "residual", "dense"])
def test_a_step_of_first_tokens_only_runs_as_the_models_prefill_and_stays_exact(kind):
    """Every entry at position 0 (one-token prompts): the model's prefill path
    (`write_prefill`), then decode steps; each row equals its full causal forward."""
    model = serve_model(kind)
    d = PagedDriver(model, n_pages=64, page_size=4)
    p = prompts((1, 1, 1))
    got = {row: [out] for row, out in d.feed({0: p[0], 1: p[1], 2: p[2]}).items()}
    for _ in range(5):
        step = d.feed({row: [int(got[row][-1][0][-1].argmax())] for row in got})
        for row, out in step.items():
            got[row].append(out)
    d.check_pages()
    for row, seq in d.seqs.items():
        full = model(torch.tensor([seq]), routing="causal")
        torch.testing.assert_close(torch.cat([g[0] for g in got[row]]), full.logits[0], **TOL)


@pytest.mark.parametrize("kind", ["predictor", "mlp-kv", "residual"])
def test_one_rows_chunk_alone_equals_its_full_forward(kind):
    """A step holding one row's chunk and nothing else (its keys shared by every entry)."""
    model = serve_model(kind)
    d = PagedDriver(model, n_pages=64, page_size=4)
    p = prompts((19,))[0]
    got = [d.feed({0: p[:8]})[0], d.feed({0: p[8:]})[0]]
    full = model(torch.tensor([p]), routing="causal")
    torch.testing.assert_close(torch.cat([g[0] for g in got]), full.logits[0], **TOL)
    d.check_pages()


def test_a_prefill_that_runs_the_pool_dry_part_way_loses_no_page():
    """Row 1's prompt needs more pages than are left after row 0's: the write fails, and the
    pages it took before the failure are in no table (issue 54): the pool must take them
    back, so that freeing both rows leaves every page free."""
    cfg = serve_model("dense").config  # max_seq_len 64: 16 pages of 4 hold one full row
    cache = PagedKVCache(cfg, n_pages=16, page_size=4, dtype=torch.float64)
    for row in (0, 1):
        cache.add_row(row)
    k = torch.zeros(1, cfg.n_kv_heads, 40, cfg.head_dim, dtype=torch.float64)
    cache.prefill([0]).write_prefill(0, k, k, None)  # 10 of the 16 pages
    with pytest.raises(RuntimeError, match="KV page pool exhausted"):
        cache.prefill([1]).write_prefill(0, k, k, None)  # 10 more: 6 are left
    cache.free_row(0)
    cache.free_row(1)
    assert cache.pages_in_use() == [0] * len(cache.pools)
    assert sorted(cache.pools[0]._free) == list(range(16))


def test_a_pool_whose_storage_fails_to_grow_keeps_its_pages(monkeypatch):
    """Growing a pool's storage can fail (out of memory): the page taken for it goes back
    to the free list and is counted free, and the next allocation gets it."""
    cfg = serve_model("dense").config
    cache = PagedKVCache(cfg, n_pages=16, page_size=4, dtype=torch.float64)
    pool = cache.pools[0]
    assert pool.k.shape[0] == 0  # lazily allocated: the first page grows the storage

    def oom(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        raise torch.OutOfMemoryError("injected: no memory for the pool's growth")

    monkeypatch.setattr(torch.Tensor, "new_zeros", oom)
    with pytest.raises(torch.OutOfMemoryError):
        pool.allocate(2)
    monkeypatch.undo()
    assert pool.free == 16 and pool.in_use == 0
    assert pool.allocate(2) == [0, 1]


def _skip_and_compute(engine, model) -> bool:  # noqa: ANN001
    """One static step of the engine's decoding rows from the same state twice, skipping idle
    routed blocks and computing them: the same logits and decisions for the active slots, the
    same pages (but the trash page) and lengths. The cache is then put back as it was. Whether
    a routed block had no active taker (so that something was skipped)."""
    from mixture_of_depths.static_cache import StaticDecoder

    cache = engine.cache
    rows = [r for r in engine.sched.running if r.fed > 0 and r.left == 1]
    ids = [r.id for r in rows]
    held = cache.snapshot(ids)
    tokens = cache.static_step(ids, [r.fed for r in rows], [r.request.tokens[r.fed] for r in rows])
    live = [t for pool in cache.pools for t in (pool.k, pool.v)]
    live += [cache.static.lengths, cache.static.pos]
    before = [t.clone() for t in live]
    slots, outs, after = [cache.slots[i] for i in ids], [], []
    for skip in (True, False):
        for t, was in zip(live, before, strict=True):
            t.copy_(was)
        with torch.no_grad():
            logits, routing = StaticDecoder(model, cache.static, skip_idle=skip)(tokens)
        outs.append((logits[slots], routing[slots]))
        after.append([t.clone() for t in live])
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    trash = cache.static.trash
    for got, want in zip(*after, strict=True):
        assert torch.equal(got[:trash], want[:trash]) if got.dim() == 4 else torch.equal(got, want)
    for t, was in zip(live, before, strict=True):
        t.copy_(was)
    cache.restore(held)  # the pages taken ahead go back: the engine's own step follows
    return not bool(outs[1][1].any(0).all())


@pytest.mark.parametrize("kind", ["predictor", "mlp-kv", "residual", "mode", "mor", "mor-share"])
def test_an_eager_static_step_that_skips_idle_blocks_equals_one_that_computes_them(kind):
    """`Pass.skip_idle` (the server's eager static step) skips a routed block that no active
    slot takes. Before every static step of a served batch (rows prefilling beside decoding
    ones: live slots inactive in the step), the step that skips and the one that computes every
    block agree exactly (`_skip_and_compute`: a skipper's or an inactive slot's key goes to the
    trash page, the only page that may differ); some step had an idle block; the completions
    equal the reference."""
    from engine_helpers import engine_pages_match_their_rows

    from mixture_of_depths.generate import generate_reference
    from mixture_of_depths.serve.engine import Engine
    from mixture_of_depths.serve.types import SamplingParams

    model = serve_model(kind)
    engine = Engine(model, None, max_rows=3, page_size=4, prefill_chunk=8, static_decode=True)
    ps, ns = prompts((6, 19, 2, 9)), [8, 5, 10, 6]
    reqs = [
        engine.submit(p, SamplingParams(max_tokens=n, temperature=0.0, stop_at_eos=False))
        for p, n in zip(ps, ns, strict=True)
    ]
    idle = []
    while True:
        if any(r.fed > 0 and r.left == 1 for r in engine.sched.running):
            idle.append(_skip_and_compute(engine, model))
        if not engine.step():
            break
        engine_pages_match_their_rows(engine)
    assert any(idle), "no step had an idle routed block: nothing was skipped"
    for p, n, r in zip(ps, ns, reqs, strict=True):
        assert r.result(0)[0] == generate_reference(model, [p], n).tokens[0]


def test_a_static_step_that_fails_taking_a_page_ahead_loses_no_page():
    """A page taken ahead for a static step stays in its row's table even when mirroring it
    into the static view's table fails (here: a row already holding max_len tokens, whose next
    page has no entry), so freeing the row returns it: no page leaks on the error."""
    cfg = serve_model("dense").config  # max_seq_len 64: 16 pages of 4 per layer
    cache = PagedKVCache(cfg, n_pages=32, page_size=4, dtype=torch.float64, static_rows=2)
    cache.add_row(0)
    k = torch.zeros(1, cfg.n_kv_heads, cfg.max_seq_len, cfg.head_dim, dtype=torch.float64)
    view = cache.prefill([0])
    for layer in range(len(cache.pools)):
        view.write_prefill(layer, k, k, None)
    with pytest.raises((IndexError, RuntimeError)):
        cache.static_step([0], [cfg.max_seq_len], [1])
    cache.free_row(0)
    assert cache.pages_in_use() == [0] * len(cache.pools)
