"""The second KV strategy, ``skipped_kv="residual"``, against oracles: the loop reference (keys and
values of every token from the layer's input), full recomputation of cached generation, the
batch against each row alone, the cache's own contents against the layer's input, and
FlopCounterMode. docs/semantics.md ("KV strategies") states the semantics.

Comparisons across code paths end in hard decisions (routing thresholds, greedy argmax), so they
run in float64.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from helpers import force_routing, random_tokens, tiny_config
from helpers import make_model as _make_model
from reference import reference_forward
from test_flops import BASE, counted
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mixture_of_depths import MoDConfig, MoDTransformer
from mixture_of_depths.cache import KVCache
from mixture_of_depths.flops import decode_cost, estimate_flops, layer_shares
from mixture_of_depths.generate import (
    decode_step,
    generate,
    generate_reference,
    prefill,
    prefill_calibration,
)
from mixture_of_depths.layers import rope_tables

TOL64 = dict(rtol=0.0, atol=1e-10)
RESIDUAL = dict(skipped_kv="residual")


def make_model(seed: int = 0, **overrides) -> MoDTransformer:
    cfg = tiny_config(**{**RESIDUAL, **overrides})
    return _make_model(cfg, seed, torch.float64, calib_idx=random_tokens(2, 23, seed + 100))


# -- the loop oracle ------------------------------------------------------------------------------


@pytest.mark.parametrize("causal_router", ["aux_loss", "predictor"])
@pytest.mark.parametrize("mode", ["joint", "staggered"])
@pytest.mark.parametrize("routing", ["topk", "causal"])
def test_residual_matches_the_loop_reference(routing, mode, causal_router):
    model = make_model(routing=mode, causal_router=causal_router)
    idx = random_tokens(2, 23, seed=1)
    out = model(idx, routing=routing)
    ref = reference_forward(model, idx, routing)
    torch.testing.assert_close(out.logits, ref.logits, **TOL64)
    for got, exp in zip(out.routes, ref.routes, strict=True):
        assert torch.equal(got.mask, exp.mask), (got.layer, got.kind)
    taken = torch.stack([r.mask for r in out.routes])
    assert taken.any() and not taken.all()  # routing is not trivial
    # The strategy matters: the same weights under routing-isolated attention differ.
    isolated = dataclasses.replace(model.config, skipped_kv="none")
    other = MoDTransformer(isolated).to(torch.float64).eval()
    other.load_state_dict(model.state_dict())
    assert (other(idx, routing=routing).logits - out.logits).abs().max() > 1e-3


def test_residual_mha_every_block_routed_matches_the_loop_reference():
    model = make_model(seed=3, n_kv_heads=4, layer_pattern="R", n_layers=3, capacity=0.5)
    idx = random_tokens(3, 19, seed=3)
    for routing in ("topk", "causal"):
        ref = reference_forward(model, idx, routing)
        torch.testing.assert_close(model(idx, routing=routing).logits, ref.logits, **TOL64)


@pytest.mark.parametrize("routing", ["topk", "causal"])
def test_skipped_tokens_leave_a_residual_layer_bit_for_bit(routing):
    model = make_model(routing="staggered")
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for block in model.blocks:
        if block.routed:
            block.register_forward_hook(
                lambda mod, args, out: seen.__setitem__(mod.layer, (args[0], out[0]))
            )
    out = model(random_tokens(2, 23, seed=4), routing=routing)
    for layer, (x_in, x_out) in seen.items():
        took = torch.zeros_like(out.routes[0].mask)
        for r in out.routes:
            if r.layer == layer:
                took |= r.mask
        assert (~took).any()
        assert torch.equal(x_in[~took], x_out[~took]), layer


def test_none_is_the_default_and_old_configs_load_as_none():
    d = tiny_config().to_dict()
    assert d["skipped_kv"] == "none"
    del d["skipped_kv"]  # a config written before the field existed
    assert MoDConfig.from_dict(json.loads(json.dumps(d))).skipped_kv == "none"
    with pytest.raises(ValueError, match="skipped_kv must be one of"):
        tiny_config(skipped_kv="duplicate")
    assert tiny_config(**RESIDUAL).dense_twin().skipped_kv == "none"


# -- generation -----------------------------------------------------------------------------------
MODES = [("joint", "aux_loss"), ("staggered", "predictor")]
PROMPT_LENS = (5, 11, 8)


def prompts(lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:  # noqa: ANN001
    return [random_tokens(1, n, seed=seed + n)[0].tolist() for n in lens]


@pytest.mark.parametrize("mode, causal_router", MODES)
def test_cached_greedy_equals_full_recomputation_and_batch_equals_alone(mode, causal_router):
    model = make_model(routing=mode, causal_router=causal_router, max_seq_len=64, capacity=0.25)
    ps = prompts()
    kw = dict(temperature=0, return_logits=True, return_routing=True)
    got = generate(model, ps, 12, **kw)
    exp = generate_reference(model, ps, 12)
    assert got.tokens == exp.tokens
    for b in range(len(ps)):
        torch.testing.assert_close(got.logits[b], exp.logits[b], **TOL64)
        alone = generate(model, [ps[b]], 12, **kw)
        assert alone.tokens[0] == got.tokens[b]
        torch.testing.assert_close(alone.logits[0], got.logits[b], **TOL64)
        assert torch.equal(alone.routing[0], got.routing[b])
    decoded = torch.cat([r[n:] for r, n in zip(got.routing, PROMPT_LENS, strict=True)])
    assert decoded.any(0).all() and (~decoded).any(0).all()  # decode steps take and skip


@pytest.mark.parametrize(
    "over",
    [
        dict(n_experts=4),  # staged MoDE
        dict(n_experts=3, n_noop_experts=2, experts_per_token=2, causal_router="predictor"),
    ],
    ids=["staged", "staged-noop-predictor"],
)
def test_residual_with_expert_layers_generates_as_it_recomputes(over):
    model = make_model(max_seq_len=64, **over)
    ps = prompts((5, 9, 3), seed=10)
    got = generate(model, ps, max_new_tokens=8, temperature=0)
    assert got.tokens == generate_reference(model, ps, 8).tokens
    for b, p in enumerate(ps):
        assert generate(model, [p], max_new_tokens=8, temperature=0).tokens[0] == got.tokens[b]


@pytest.mark.parametrize("prefill_mode", ["causal", "topk"])
def test_the_cache_holds_every_token_keyed_from_the_layer_input(prefill_mode):
    """A residual layer's cache holds every real token of every row, top-k prefill or causal, and
    decode steps on which rows skip still append; each stored key and value is the layer's K/V
    projection of that token's stream at the layer's input in the full forward, rotated at its
    position. `nbytes_used` counts them all: a dense model's bytes."""
    model = make_model(max_seq_len=64, capacity=0.25)
    cfg = model.config
    ps = prompts()
    n_new = 6
    g = generate(model, ps, n_new, temperature=0, prefill=prefill_mode, return_routing=True)
    # Rebuild the cache the same way, then read it back.
    P = max(PROMPT_LENS)
    idx = torch.zeros(len(ps), P, dtype=torch.long)
    for b, p in enumerate(ps):
        idx[b, : len(p)] = torch.tensor(p)
    lens = torch.tensor(PROMPT_LENS)
    cache = KVCache(cfg, len(ps), P + n_new, dtype=torch.float64)
    logits, _ = prefill(model, idx, lens, cache, prefill_mode)
    assert logits.argmax(-1).tolist() == [t[0] for t in g.tokens]
    for step in range(n_new - 1):
        tok = torch.tensor([g.tokens[b][step] for b in range(len(ps))])
        logits, _ = decode_step(model, tok, cache)
        assert logits.argmax(-1).tolist() == [g.tokens[b][step + 1] for b in range(len(ps))]
    seen_tokens = lens + n_new - 1
    assert torch.equal(cache.lengths, seen_tokens.expand(cfg.n_layers, -1))
    assert cache.nbytes_used == int(seen_tokens.sum()) * cfg.n_layers * cache._bytes_per_slot
    # Some routed decisions skipped in the decoded tokens, yet every row appended.
    assert any((~r[len(p) :]).any() for r, p in zip(g.routing, ps, strict=True))
    if prefill_mode == "topk":
        return  # the full causal forward below is the oracle of causal prefill and decode
    for b, p in enumerate(ps):
        seq = torch.tensor([p + g.tokens[b][: n_new - 1]])
        inputs = layer_inputs(model, seq)
        T = seq.shape[1]
        for layer in cfg.routed_layers:
            blk = model.blocks[layer]
            cos, sin = rope_tables(cfg.head_dim, T, cfg.rope_theta, dtype=torch.float64)
            k, v = blk.attn.kv(blk.attn_norm(inputs[layer]), cos[:T], sin[:T])
            torch.testing.assert_close(cache.k[layer][b : b + 1, :, :T], k, **TOL64)
            torch.testing.assert_close(cache.v[layer][b : b + 1, :, :T], v, **TOL64)


def layer_inputs(model: MoDTransformer, seq: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each block's input stream in the full causal forward of `seq`."""
    inputs: dict[int, torch.Tensor] = {}
    hooks = [
        blk.register_forward_hook(lambda m, a, o: inputs.__setitem__(m.layer, a[0]))
        for blk in model.blocks
    ]
    with torch.no_grad():
        model(seq, routing="causal")
    for h in hooks:
        h.remove()
    return inputs


def test_residual_cache_is_allocated_at_full_size():
    cfg = tiny_config(**RESIDUAL)
    full, isolated = (
        KVCache(cfg, 2, 100),
        KVCache(dataclasses.replace(cfg, skipped_kv="none"), 2, 100),
    )
    assert all(full.slots(i) == 100 for i in range(cfg.n_layers))
    assert all(isolated.slots(i) < 100 for i in cfg.routed_layers)


# -- FLOPs and bytes ------------------------------------------------------------------------------
FLOP_CASES = [
    dict(layer_pattern="DR", capacity=0.125),
    dict(layer_pattern="DR", capacity=0.5, routing="staggered"),
    dict(layer_pattern="R", capacity=0.25, causal_router="predictor"),
    dict(layer_pattern="DR", capacity=0.01),  # k = 0: the routed layers run nothing
]


@pytest.mark.parametrize("over", FLOP_CASES, ids=[str(c) for c in FLOP_CASES])
def test_residual_forward_and_training_step_equal_flop_counter(over):
    cfg = MoDConfig(**{**BASE, **over, **RESIDUAL})
    model = MoDTransformer(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    rep = estimate_flops(cfg, 40, batch_size=3)
    assert rep.forward == pytest.approx(counted(model, idx), rel=0.01)
    assert rep.train == pytest.approx(counted(model, idx, backward=True), rel=0.01)


@pytest.mark.parametrize("takes", [[True, False], [False, False], [True, True]])
def test_residual_decode_step_equals_flop_counter(takes):
    """A decode step of two rows: the rows that skip a routed layer still project a key and a
    value; the rows that take attend over every cached token."""
    cfg = MoDConfig(**{**BASE, "layer_pattern": "DR", "causal_router": "predictor", **RESIDUAL})
    torch.manual_seed(0)
    model = MoDTransformer(cfg).eval()
    force_routing(model, takes)
    P = 20
    idx = torch.randint(0, cfg.vocab_size, (1, P), generator=torch.Generator().manual_seed(2))
    cache = KVCache(cfg, 1, P + 1)
    logits, _ = prefill(model, idx, torch.tensor([P]), cache)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        _, routing = decode_step(model, logits.argmax(-1), cache)
    assert routing[0].tolist() == takes
    assert cache.lengths[:, 0].tolist() == [P + 1] * cfg.n_layers  # every layer stored it
    flops, _ = decode_cost(cfg, layer_shares(cfg, [float(t) for t in takes]), [1.0] * 4, P + 1)
    assert flops == pytest.approx(fc.get_total_flops(), rel=1e-9)


def test_residual_kv_bytes_equal_dense_and_projections_cost_the_skippers():
    cfg = MoDConfig(**{**BASE, "layer_pattern": "DR", "capacity": 0.125, "max_seq_len": 256})
    none = estimate_flops(cfg, 256)
    res = estimate_flops(dataclasses.replace(cfg, **RESIDUAL), 256)
    assert res.kv_bytes_per_token == none.dense.kv_bytes_per_token
    assert none.kv_bytes_per_token == pytest.approx(none.dense.kv_bytes_per_token * 9 / 16)
    D, kv = cfg.d_model, 2 * cfg.n_kv_heads * cfg.head_dim
    k = 32  # 12.5% of 256
    # Routed layers: the 224 skippers' K/V projections, and k queries over 256 keys, not k.
    assert res.layers[1].matmul - none.layers[1].matmul == pytest.approx(2 * D * kv * (256 - k))
    assert res.layers[1].attention == pytest.approx(none.layers[1].attention * 256 / k)
    assert res.decode_per_token > none.decode_per_token
    assert res.layers[0] == none.layers[0]  # dense layers are untouched


# -- prefill calibration --------------------------------------------------------------------------
@pytest.mark.parametrize("skipped_kv", ["none", "residual"])
def test_prefill_calibration_against_the_full_forward(skipped_kv):
    """The causal prefill's teacher-forced loss is the full causal forward's on the same targets;
    the share of differing decisions is read off the two prompt forwards' routes; a top-k
    prefill that differs in its decisions changes the loss."""
    model = make_model(max_seq_len=64, capacity=0.25, skipped_kv=skipped_kv)
    idx = random_tokens(3, 40, seed=5)
    P = 20
    got = prefill_calibration(model, idx, P)
    with torch.no_grad():
        logits = model(idx, routing="causal").logits[:, P - 1 : -1]
        topk = model(idx[:, :P], routing="topk").routes
        causal = model(idx[:, :P], routing="causal").routes
    want = F.cross_entropy(logits.flatten(0, 1), idx[:, P:].flatten())
    assert got["loss_causal_prefill"] == pytest.approx(float(want), abs=1e-10)
    differ = torch.stack([a.mask != b.mask for a, b in zip(topk, causal, strict=True)])
    assert got["decisions_differ"] == pytest.approx(float(differ.float().mean()))
    assert 0 < got["decisions_differ"] < 1
    assert got["loss_gap"] == got["loss_topk_prefill"] - got["loss_causal_prefill"] != 0
    with pytest.raises(ValueError, match="prompt_len"):
        prefill_calibration(model, idx, 40)
