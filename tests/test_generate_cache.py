"""The KV cache of generation against oracles: per-layer lengths that count the tokens that took
each layer, slots never attended, keys rotated at their original positions, top-k prefill, and
the cache protocol through the model's forward (decode steps equal full recomputation).
"""

from __future__ import annotations

import pytest
import torch
from generate_helpers import (
    F64,
    LENS,
    MAX_LEN,
    N_NEW,
    SOME_MODES,
    TOL32,
    TOL64,
    HandDecoder,
    assert_same_generation,
    cached_tokens,
    causal_routes,
    make_config,
    make_model,
    make_prompts,
    pad,
    unrotated_keys_and_values,
)
from helpers import force_routing, random_tokens
from reference import rotate

from mixture_of_depths import capacity_tokens
from mixture_of_depths.cache import KVCache
from mixture_of_depths.generate import (
    Generation,
    decode_step,
    generate,
    generate_reference,
    prefill,
    router_names,
)

# -- the KV cache -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("routing, causal_router", SOME_MODES)
def test_cache_lengths_count_the_tokens_that_took_each_layer(routing, causal_router, dtype):
    """Each layer caches the tokens that took it (with routing="mlp", whose attention is dense,
    every token in every layer)."""
    model = make_model(routing=routing, causal_router=causal_router, dtype=dtype)
    cfg = model.config
    prompts = make_prompts()
    dec = HandDecoder(model, prompts, N_NEW)
    _, routing_BTR = dec.prefill()
    decisions = [routing_BTR[b, :n] for b, n in enumerate(LENS)]
    bytes_per_slot = 2 * cfg.n_kv_heads * cfg.head_dim * torch.empty(0, dtype=dtype).element_size()
    for step in range(N_NEW + 1):
        if step:
            _, r_NR = dec.step()
            decisions = [torch.cat([d, r_NR[b : b + 1]]) for b, d in enumerate(decisions)]
        lengths = dec.cache.lengths
        assert lengths.shape == (cfg.n_layers, len(prompts))
        for layer, kind in enumerate(cfg.layer_kinds):
            for b in range(len(prompts)):
                if kind == "D":
                    expected = LENS[b] + step  # every token fed
                else:
                    expected = int(cached_tokens(model, layer, decisions[b]).sum())
                assert int(lengths[layer, b]) == expected, (step, layer, b)
        assert dec.cache.nbytes_used == int(lengths.sum()) * bytes_per_slot
    # The decisions made by hand are the full causal forward's (the oracle for the counts above),
    # compared across code paths in float64 only (see the module docstring).
    if dtype == F64:
        for b in range(len(prompts)):
            assert torch.equal(decisions[b], causal_routes(model, dec.seqs[b]))
    routed = [layer for layer, kind in enumerate(cfg.layer_kinds) if kind == "R"]
    lengths = dec.cache.lengths
    if routing == "mlp":  # every token, as in the dense layer 1
        assert torch.equal(lengths[routed], lengths[1].expand(len(routed), -1))
    else:  # fewer than the dense layer holds (a row may have sent every token through one)
        assert (lengths[routed] <= lengths[1]).all() and (lengths[routed] < lengths[1]).any()
        assert (lengths[routed] > 0).any()


def test_cache_of_a_mostly_skipping_model_uses_less_than_it_allocates():
    model = make_model(routing="joint", causal_router="predictor", take=0.15)
    cfg = model.config
    prompts = make_prompts((9, 9, 9))  # equal lengths: the dense layers fill their slots exactly
    dec = HandDecoder(model, prompts, N_NEW, grow=False)
    dec.prefill()
    for _ in range(N_NEW - 1):
        dec.step()
    lengths, cache = dec.cache.lengths, dec.cache
    bytes_per_slot = 2 * cfg.n_kv_heads * cfg.head_dim * 4
    assert cache.nbytes_used == int(lengths.sum()) * bytes_per_slot
    assert cache.nbytes_allocated == cfg.n_layers * 3 * (9 + N_NEW) * bytes_per_slot  # grow=False
    assert (lengths[1] == 9 + N_NEW - 1).all()
    routed = lengths[cfg.routed_layers]
    assert (routed <= (9 + N_NEW - 1) // 2).all()  # mostly skipped
    assert cache.nbytes_used < cache.nbytes_allocated
    assert cache.nbytes_used <= cache.nbytes_allocated - int((lengths[1] - routed).sum()) * (
        bytes_per_slot
    )
    # grow=True allocates the routed layers at a fraction of the dense size.
    small = KVCache(cfg, 3, MAX_LEN, grow=True)
    assert all(small.slots(layer) < MAX_LEN for layer in cfg.routed_layers)
    assert small.nbytes_allocated < KVCache(cfg, 3, MAX_LEN, grow=False).nbytes_allocated


def test_mlp_routed_layers_are_allocated_as_dense_ones():
    """routing="mlp": attention is dense, so a routed layer caches every token and its buffer is
    allocated at full size, not at a fraction of it."""
    cfg = make_config(routing="mlp")
    assert cfg.full_kv_layers == list(range(cfg.n_layers))
    cache = KVCache(cfg, 2, MAX_LEN, grow=True)
    assert all(cache.slots(layer) == MAX_LEN for layer in range(cfg.n_layers))
    isolated = KVCache(make_config(routing="staggered"), 2, MAX_LEN, grow=True)
    assert all(isolated.slots(layer) < MAX_LEN for layer in cfg.routed_layers)  # precondition


@pytest.mark.parametrize("routing", ["joint", "staggered", "mlp", "mlp_kv"])
def test_unused_cache_slots_are_never_attended(routing):
    """Poison every slot past each row's length with huge values after prefill and after every
    step: decoding still equals the no-cache reference, so no unfilled slot (zero hole or a
    skipped token's leftover) is ever given attention weight (with "mlp_kv", a row that holds
    nothing yet reads a poisoned slot whose output is dropped)."""
    model = make_model(routing=routing, dtype=F64)
    prompts = make_prompts()
    exp = generate_reference(model, prompts, N_NEW)
    dec = HandDecoder(model, prompts, N_NEW)
    g = torch.Generator().manual_seed(0)
    logits, _ = dec.prefill()
    for step in range(N_NEW):
        lengths = dec.cache.lengths
        for layer in range(model.config.n_layers):
            for store in (dec.cache.k, dec.cache.v):
                for b in range(len(prompts)):
                    hole = store[layer][b, :, int(lengths[layer, b]) :]
                    hole.copy_(1e4 * torch.randn(hole.shape, generator=g))
        for b in range(len(prompts)):
            torch.testing.assert_close(logits[b], exp.logits[b][step], **TOL64)
        logits, _ = dec.step()
    assert [s[n:] for s, n in zip(dec.seqs, LENS, strict=True)] == [t[:N_NEW] for t in exp.tokens]
    assert (dec.cache.lengths < dec.cache.lengths.max()).any()  # precondition: rows of unequal use


@pytest.mark.parametrize("routing", ["joint", "staggered", "mlp", "mlp_kv"])
def test_decode_runs_routed_blocks_only_on_the_rows_that_take_them(routing):
    """A routed (sub-)block runs on the rows that take it, and only those append to a layer's
    cache; with routing="mlp" attention runs on, and appends, every row; with "mlp_kv" every
    row queries (outside `Attention.forward`: its hook sees nothing) and only the takers append
    and run the MLP."""
    model = make_model(
        routing=routing, causal_router="predictor", n_layers=3, layer_pattern="RDR", dtype=F64
    )
    force_routing(model, take=False, layers=[2])  # layer 2: every token skips
    prompts = make_prompts((5, 11, 8, 3))
    calls = {}

    def recorder(name):  # noqa: ANN001, ANN202
        def hook(module, args, output):  # noqa: ANN001, ANN202
            calls.setdefault(name, []).append(args[0].shape[0])

        return hook

    handles = []
    for layer in (0, 2):
        block = model.blocks[layer]
        handles.append(block.attn.register_forward_hook(recorder((layer, "attn"))))
        handles.append(block.mlp.register_forward_hook(recorder((layer, "mlp"))))
    dec = HandDecoder(model, prompts, N_NEW)
    dec.prefill()
    names = router_names(model)
    partial = 0
    try:
        for _ in range(N_NEW):
            before = dec.cache.lengths
            calls.clear()
            _, r_NR = dec.step()
            grown = dec.cache.lengths - before
            for layer in (0, 2):
                for sub in ("attn", "mlp"):
                    if routing == "mlp" and sub == "attn":  # dense
                        n_take = len(prompts)
                    elif routing == "mlp_kv":  # the queries: mlp_kv.attend_rows, no forward
                        name = f"{layer}.mlp_kv"
                        n_take = 0 if sub == "attn" else int(r_NR[:, names.index(name)].sum())
                    else:
                        name = str(layer) if routing == "joint" else f"{layer}.{sub}"
                        n_take = int(r_NR[:, names.index(name)].sum())
                    assert calls.get((layer, sub), []) == ([n_take] if n_take else []), (
                        layer,
                        sub,
                    )
                    partial += 0 < n_take < len(prompts)
                col = cached_tokens(model, layer, r_NR)
                assert torch.equal(grown[layer], col.long())  # skipping rows add nothing
            assert (grown[1] == 1).all()  # the dense layer stores every row's token
    finally:
        for h in handles:
            h.remove()
    assert partial > 0  # precondition: some steps had some rows take and some skip
    assert (dec.cache.lengths[2] == (0 if routing != "mlp" else dec.cache.lengths[1])).all()
    got = generate(model, prompts, N_NEW, temperature=0, return_logits=True, return_routing=True)
    assert_same_generation(got, generate_reference(model, prompts, N_NEW))


@pytest.mark.parametrize("routing", ["joint", "staggered", "mlp", "mlp_kv"])
def test_cached_keys_are_rotated_at_original_positions(routing):
    """Slot j of a layer holds the key (rotated at its original position) and value of the j-th
    token that took that layer: compared with the unrotated keys of the full causal forward,
    rotated here by the loop oracle's RoPE."""
    model = make_model(routing=routing, causal_router="predictor", dtype=F64)
    cfg = model.config
    prompts = make_prompts()
    gen = Generation(model, prompts, N_NEW, 0.0, None, None, None, None, "causal", True)
    new = [[] for _ in prompts]
    for st in gen.steps():
        for b, t in zip(st.rows, st.tokens, strict=True):
            new[b].append(t)
    cache = gen.cache
    H = cfg.n_kv_heads
    partial = []  # per routed layer and row: it cached some of the row's tokens, not all
    for b, p in enumerate(prompts):
        seq = p + new[b]
        raw, routes = unrotated_keys_and_values(model, seq)
        for layer, kind in enumerate(cfg.layer_kinds):
            took = cached_tokens(model, layer, routes).nonzero()[:, 0].tolist()
            if kind == "R" and routing != "mlp":
                partial.append(0 < len(took) < len(seq))
            assert int(cache.lengths[layer, b]) == len(took)
            for j, pos in enumerate(took):
                for h in range(H):
                    k_exp = rotate(raw[(layer, "k")][pos, h], pos, cfg.rope_theta)
                    torch.testing.assert_close(cache.k[layer][b, h, j], k_exp, **TOL64)
                    torch.testing.assert_close(
                        cache.v[layer][b, h, j], raw[(layer, "v")][pos, h], **TOL64
                    )
    # "mlp_kv": here a short row sends all or none of its tokens through some layers
    assert (any if routing == "mlp_kv" else all)(partial) or routing == "mlp"


@pytest.mark.parametrize("routing", ["joint", "staggered"])
def test_cache_grows_when_every_token_takes_every_block(routing):
    model = make_model(routing=routing, causal_router="predictor", dtype=F64)
    force_routing(model, take=True)
    cfg = model.config
    prompts = make_prompts((20, 7))
    n_new = 30
    total = 20 + n_new
    initial = KVCache(cfg, 2, total, grow=True)
    assert all(initial.slots(layer) < total for layer in cfg.routed_layers)  # precondition
    got = generate(model, prompts, n_new, temperature=0, return_logits=True, return_routing=True)
    assert_same_generation(got, generate_reference(model, prompts, n_new))
    assert all(r.all() for r in got.routing)
    gen = Generation(model, prompts, n_new, 0.0, None, None, None, None, "causal", True)
    for _ in gen.steps():
        pass
    expected = torch.tensor([20 + n_new, 7 + n_new]).expand(cfg.n_layers, 2)
    assert torch.equal(gen.cache.lengths, expected)
    assert all(gen.cache.slots(layer) >= total for layer in range(cfg.n_layers))


def test_cache_past_max_len_raises_runtime_error():
    model = make_model(routing="joint", causal_router="predictor")
    force_routing(model, take=True)
    cfg = model.config
    idx = random_tokens(2, 8, seed=5)
    lens = torch.tensor([8, 8])
    cache = KVCache(cfg, 2, max_len=8, grow=True)
    logits, _ = prefill(model, idx, lens, cache)
    with pytest.raises(RuntimeError, match="max_len"):
        decode_step(model, logits.argmax(-1), cache)
    with pytest.raises(RuntimeError, match="max_len"):
        prefill(model, random_tokens(2, 9, seed=6), torch.tensor([9, 4]), KVCache(cfg, 2, 8))


# -- top-k prefill ------------------------------------------------------------------------------


@pytest.mark.parametrize("routing", ["joint", "staggered", "mlp", "mlp_kv"])
def test_topk_prefill_takes_capacity_tokens_per_row(routing):
    """prefill="topk" routes each prompt with the paper's top-k over that prompt alone: exactly
    capacity_tokens(capacity, len) tokens per row and routed (sub-)block, the choice and the
    last-token logits of the model's own top-k forward on the row alone."""
    model = make_model(routing=routing, dtype=torch.float64)
    cfg = model.config
    lens = (5, 11, 8, 16)
    prompts = make_prompts(lens, seed=6)
    out = generate(
        model, prompts, N_NEW, temperature=0, prefill="topk", return_logits=True,
        return_routing=True,
    )  # fmt: skip
    assert [len(t) for t in out.tokens] == [N_NEW] * len(prompts)
    for b, (p, n) in enumerate(zip(prompts, lens, strict=True)):
        k = capacity_tokens(cfg.capacity, n)
        prompt_routing = out.routing[b][:n]
        assert (prompt_routing.sum(0) == k).all(), (b, prompt_routing.sum(0))
        with torch.no_grad():
            alone = model(torch.tensor([p]), routing="topk")
        assert torch.equal(prompt_routing, torch.stack([r.mask[0] for r in alone.routes], -1))
        torch.testing.assert_close(out.logits[b][0], alone.logits[0, -1], **TOL32)
    assert len({capacity_tokens(cfg.capacity, n) for n in lens}) > 1  # rows really differ in k
    # The cache holds exactly the top-k tokens in each routed layer.
    idx, lens_t = pad(prompts)
    cache = KVCache(cfg, len(prompts), dtype=torch.float64)
    prefill(model, idx, lens_t, cache, mode="topk")
    for layer in cfg.routed_layers:
        want = lens if routing == "mlp" else [capacity_tokens(cfg.capacity, n) for n in lens]
        assert cache.lengths[layer].tolist() == list(want)


# -- the cache protocol through the model's forward ---------------------------------------------


def test_forward_with_a_cache_refuses_what_cannot_be_cached():
    model = make_model(routing="staggered", causal_router="predictor")
    idx = random_tokens(2, 6, seed=1)
    with pytest.raises(ValueError, match="lengths"):
        model(idx, lengths=torch.tensor([6, 4]))  # padding needs a cache
    cache = KVCache(model.config, 2, 16)
    with pytest.raises(ValueError, match="rows"):
        model(random_tokens(3, 6, seed=1), cache=cache, routing="causal")
    with pytest.raises(ValueError, match="float64"):
        model(idx, cache=KVCache(model.config, 2, 16, dtype=F64), routing="causal")
    with pytest.raises(ValueError, match="prefill the whole batch"):
        cache.subset(torch.tensor([0]))  # a view is for decode steps
    with pytest.raises(ValueError, match="integers"):
        model(idx, cache=cache, routing="causal", lengths=torch.tensor([6.0, 4.0]))
    with pytest.raises(ValueError, match="lengths"):
        model(idx, cache=cache, routing="causal", lengths=torch.tensor([7, 4]))
    with pytest.raises(ValueError, match="targets"):
        model(idx, targets=idx, cache=cache, last_only=True)
    model(idx, cache=cache, routing="causal", lengths=torch.tensor([6, 4]))  # the prefill
    assert cache.positions().tolist() == [6, 4]
    one = random_tokens(2, 1, seed=2)
    with pytest.raises(ValueError, match="top-k"):
        model(one, cache=cache, routing="topk")  # top-k cannot decode
    with pytest.raises(ValueError, match="one token"):
        model(random_tokens(2, 2, seed=2), cache=cache, routing="causal")
    with pytest.raises(ValueError, match="strictly increasing"):
        cache.subset(torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="strictly increasing"):
        cache.subset(torch.tensor([2]))
    with pytest.raises(ValueError, match="strictly increasing"):
        cache.subset(torch.tensor([1])).subset(torch.tensor([-1]))
    with pytest.raises(ValueError, match="strictly increasing"):
        decode_step(model, torch.tensor([3, 3]), cache.subset(torch.tensor([1, 1])))
    with pytest.raises(ValueError, match="lengths"):
        model(one, cache=cache, routing="causal", lengths=torch.tensor([1, 1]))
    model(one[1:], cache=cache.subset(torch.tensor([1])), routing="causal")  # row 1 alone
    assert cache.positions().tolist() == [6, 5]


@pytest.mark.parametrize(
    "routing, skipped_kv", [("joint", "none"), ("joint", "residual"), ("mlp_kv", "none")]
)
def test_decode_step_of_some_rows_equals_full_recomputation(routing, skipped_kv):
    """Rows fed unevenly (row 1 every step, row 0 every other step) through cache views: each
    row's logits equal the full causal forward of its own sequence (float64)."""
    model = make_model(routing=routing, causal_router="predictor", dtype=F64, skipped_kv=skipped_kv)
    prompts = make_prompts((7, 4))
    idx, lens = pad(prompts)
    cache = KVCache(model.config, 2, 40, dtype=F64)
    logits, _ = prefill(model, idx, lens, cache)
    seqs = [list(p) for p in prompts]
    for step in range(8):
        rows = torch.tensor([0, 1]) if step % 2 else torch.tensor([1])
        tokens = logits[rows].argmax(-1)
        for b, t in zip(rows.tolist(), tokens.tolist(), strict=True):
            seqs[b].append(t)
        view = cache if len(rows) == 2 else cache.subset(rows)
        new_logits, _ = decode_step(model, tokens, view)
        for i, b in enumerate(rows.tolist()):
            with torch.no_grad():
                full = model(torch.tensor([seqs[b]]), routing="causal").logits[0, -1]
            torch.testing.assert_close(new_logits[i], full, **TOL64)
            logits[b] = new_logits[i]
    assert cache.positions().tolist() == [len(s) for s in seqs]
