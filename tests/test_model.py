"""`MoDTransformer` against oracles: the loop reference, dense equivalence, recomputation.

No golden numbers: every expected value is recomputed here (tests/reference.py is the loop oracle).
"""

from __future__ import annotations

import copy
import math
from fractions import Fraction

import pytest
import torch
from helpers import V, dense_twin_with_same_weights, unit_gates
from model_helpers import STRICT, B, T, assert_matches_reference, make_model, tokens
from reference import reference_forward, topk_set

import mixture_of_depths.blocks
from mixture_of_depths import capacity_tokens
from mixture_of_depths.config import ROUTE_KINDS
from mixture_of_depths.routing import route_name, topk_indices

MODES = ["joint", "staggered", "mlp", "mlp_kv"]  # config.ROUTING_MODES

# -- the loop oracle ----------------------------------------------------------------------------


@pytest.mark.parametrize("gate", ["raw", "sigmoid"])
@pytest.mark.parametrize("causal_router", ["aux_loss", "predictor"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("routing", ["topk", "causal"])
def test_matches_reference(routing, mode, causal_router, gate):
    model = make_model(routing=mode, causal_router=causal_router, router_gate=gate)
    out, _ = assert_matches_reference(model, tokens(), routing)
    assert model.config.routed_layers == [0, 2, 3]  # "RDR" tiled on 4 layers: R D R R
    assert [r.name for r in out.routes] == [
        route_name(layer, kind) for layer in (0, 2, 3) for kind in ROUTE_KINDS[mode]
    ]
    taken = torch.stack([r.mask for r in out.routes])
    assert taken.any() and not taken.all()  # routing is not trivial in this case
    if routing == "topk":
        assert (taken.sum(-1) == capacity_tokens(0.3, T)).all()
    if mode == "mlp_kv":  # some queries see no taker (a zero update) and some see several
        seen = taken.cumsum(-1)
        assert (seen == 0).any() and (seen > 1).any()


@pytest.mark.parametrize("mode", ["joint", "mlp", "mlp_kv"])
@pytest.mark.parametrize("routing", ["topk", "causal"])
def test_matches_reference_mha_all_routed(routing, mode):
    """Plain multi-head attention, every block routed, a different capacity and length."""
    model = make_model(
        seed=3, n_kv_heads=4, layer_pattern="R", n_layers=3, capacity=0.5, routing=mode
    )
    assert_matches_reference(model, tokens(4, 19, seed=3), routing)


def test_dense_model_matches_reference():
    model = make_model(seed=5, layer_pattern="D")
    idx = tokens(seed=5)
    out, _ = assert_matches_reference(model, idx, "topk")
    assert out.routes == []
    assert torch.equal(model(idx, routing="causal").logits, out.logits)


def test_oracle_tolerance_tells_float64_from_float32(monkeypatch):
    """The oracle tests' 1e-10 can fail: the float64 model meets it, while the same model with
    its rotary tables rounded to float32 (everything else float64) misses it by orders of
    magnitude, and so does the model cast to float32. A float32 step anywhere in the vectorised
    path would fail the comparisons above."""
    model = make_model(router_gate="raw")
    idx = tokens()
    ref = reference_forward(model, idx, "topk").logits
    torch.testing.assert_close(model(idx, routing="topk").logits, ref, **STRICT)

    real = mixture_of_depths.blocks.rope_tables

    def rope32(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        return tuple(t.float().double() for t in real(*args, **kwargs))

    monkeypatch.setattr(mixture_of_depths.blocks, "rope_tables", rope32)
    err_rope = float((model(idx, routing="topk").logits.detach() - ref).abs().max())
    monkeypatch.undo()
    f32 = copy.deepcopy(model).float()(idx, routing="topk").logits.detach().double()
    err_f32 = float((f32 - ref).abs().max())
    assert err_rope > 100 * STRICT["atol"] and err_f32 > 100 * STRICT["atol"], (err_rope, err_f32)


# -- skipped tokens, counts, ordering, ties -----------------------------------------------------


def _record_routed_blocks(model):  # noqa: ANN001, ANN202
    """Per routed block call: (input, output, routes, the stream a token that skips every router
    leaves with): the input, or with routing="mlp" the input plus its dense attention's update,
    added as the block adds it; with "mlp_kv" plus its attention's update where a taker at or
    before it gave it a key (else nothing: the attention is not even run without a taker)."""
    seen, attn_out = [], {}

    def on_attn(module, args, output):  # noqa: ANN001, ANN202
        attn_out[module] = output.detach()

    def hook(module, args, output):  # noqa: ANN001, ANN202
        x_in = args[0].detach().clone()
        a = attn_out.pop(module.attn, None)
        x_skip = x_in + a if module.dense_attention else x_in
        if module.cfg.routing == "mlp_kv" and a is not None:
            keyed = output[1][0].mask.cumsum(1) > 0
            x_skip = x_in + torch.where(keyed.unsqueeze(-1), a, 0.0)
        seen.append((x_in, output[0].detach(), output[1], x_skip))

    handles = []
    for b in model.blocks:
        if b.routed:
            handles.append(b.register_forward_hook(hook))
            handles.append(b.attn.register_forward_hook(on_attn))
    return seen, handles


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("routing", ["topk", "causal"])
def test_skipped_tokens_are_bit_identical(routing, mode, dtype):
    """A token that skips leaves bit for bit as it came (with routing="mlp": as the dense
    attention left it, its MLP-less stream; with "mlp_kv": as its attention over the takers
    left it, its MLP untouched)."""
    model = make_model(routing=mode, dtype=dtype)
    seen, handles = _record_routed_blocks(model)
    model(tokens(), routing=routing)
    for h in handles:
        h.remove()
    assert len(seen) == 3
    for x_in, x_out, routes, x_skip in seen:
        took = torch.zeros_like(routes[0].mask)
        for r in routes:
            took |= r.mask
        assert took.any() and (~took).any()
        assert torch.equal(x_out[~took], x_skip[~took])
        # the others really were updated (an "mlp_kv" taker's MLP is all it adds, gated by the
        # router's weight: with a predictor deciding, that gate can be ~1e-12, below float32)
        if mode != "mlp_kv" or dtype == torch.float64:
            assert (x_out[took] != x_skip[took]).any(-1).all()
        if mode == "mlp":  # attention updated every token
            assert (x_skip != x_in).any(-1).all()
        if mode == "mlp_kv":  # attention updated every token with a taker at or before it
            keyed = routes[0].mask.cumsum(1) > 0
            assert (x_skip != x_in).any(-1).eq(keyed).all() and (~took & keyed).any()


@pytest.mark.parametrize(
    "capacity, length",
    [(0.29, 100), (0.57, 100), (0.58, 100), (0.3, 23), (0.125, 23), (0.5, 2), (1.0, 23)],
)
@pytest.mark.parametrize("mode", MODES)
def test_topk_selects_exactly_k_per_row(capacity, length, mode):
    k = math.floor(Fraction(str(capacity)) * length)
    model = make_model(capacity=capacity, routing=mode, dtype=torch.float32)
    out = model(tokens(4, length, seed=7), routing="topk")
    for r in out.routes:
        assert (r.mask.sum(1) == k).all(), (capacity, length, r.mask.sum(1).tolist())
        assert torch.equal(r.target, r.mask)
    if k == length:
        assert all(r.mask.all() for r in out.routes)


def test_capacity_float_hazard_is_exercised():
    # Precondition of the sweep above: 0.29 * 100 and friends land just below the integer in float.
    assert math.floor(0.29 * 100) == 28 and math.floor(0.57 * 100) == 56
    assert math.floor(0.58 * 100) == 57


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("capacity, length", [(0.01, 23), (0.5, 1), (0.125, 7)])
def test_zero_capacity_leaves_stream_unchanged(capacity, length, mode):
    """capacity * T < 1 gives k = 0: the routed block is the identity (with routing="mlp", its
    dense attention alone) and nothing crashes."""
    assert capacity_tokens(capacity, length) == 0
    model = make_model(capacity=capacity, routing=mode, dtype=torch.float32)
    idx = tokens(B, length, seed=2)
    seen, _ = _record_routed_blocks(model)
    out = model(idx, targets=idx, routing="topk")
    assert len(seen) == 3
    for _, x_out, routes, x_skip in seen:
        assert torch.equal(x_out, x_skip)
        assert all(not r.mask.any() and not r.target.any() for r in routes)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_topk_indices_sorted_exact_and_ties_to_earlier():
    g = torch.Generator().manual_seed(0)
    r = torch.randint(0, 4, (5, 17), generator=g).double()  # many ties
    for k in range(18):
        idx = topk_indices(r, k)
        assert idx.shape == (5, k)
        for b in range(5):
            assert idx[b].tolist() == topk_set(r[b].tolist(), k)


@pytest.mark.parametrize("mode", MODES)
def test_equal_router_weights_pick_the_earliest_tokens(mode):
    model = make_model(routing=mode, router_gate="sigmoid")
    with torch.no_grad():
        for block in model.blocks:
            if block.routed:
                for lin in block.router.values():
                    lin.weight.zero_()
    idx = tokens()
    k = capacity_tokens(0.3, T)
    first = model(idx, routing="topk").routes
    again = model(idx, routing="topk").routes
    expected = torch.zeros(B, T, dtype=torch.bool)
    expected[:, :k] = True
    for r, r2 in zip(first, again, strict=True):
        assert torch.equal(r.mask, expected)
        assert torch.equal(r2.mask, expected)
    assert_matches_reference(model, idx, "topk")


def test_exact_ties_in_router_weights_break_to_lower_position():
    """Repeated tokens give bit-equal r at layer 0; the boundary of top-k falls inside a tie."""
    model = make_model(seed=4, layer_pattern="RD", n_layers=2, capacity=0.25)
    g = torch.Generator().manual_seed(4)
    alphabet = torch.tensor([5, 17, 40])
    idx = alphabet[torch.randint(0, 3, (B, 24), generator=g)]
    out, _ = assert_matches_reference(model, idx, "topk")
    r0 = out.routes[0].logits
    k = capacity_tokens(0.25, 24)
    ties = 0
    for b in range(B):
        ranked = sorted(r0[b].tolist(), reverse=True)
        ties += ranked[k - 1] == ranked[k]
    assert ties > 0  # precondition: the k-th and (k+1)-th router weights are equal in some row


# -- causality ----------------------------------------------------------------------------------


def _change_after(idx: torch.Tensor, t: int, seed: int) -> torch.Tensor:
    idx2 = idx.clone()
    g = torch.Generator().manual_seed(seed)
    shift = torch.randint(1, V, idx2[:, t + 1 :].shape, generator=g)
    idx2[:, t + 1 :] = (idx2[:, t + 1 :] + shift) % V  # every later token differs
    return idx2


@pytest.mark.parametrize("causal_router", ["aux_loss", "predictor"])
@pytest.mark.parametrize("mode", MODES)
def test_causal_mode_is_causal(mode, causal_router):
    model = make_model(routing=mode, causal_router=causal_router)
    idx = tokens()
    out = model(idx, routing="causal")
    for r in out.routes:  # some tokens take each router and some skip it
        assert r.mask.any() and (~r.mask).any(), (r.layer, r.kind)
    for t in (0, 4, 11, 17, T - 2):
        out2 = model(_change_after(idx, t, seed=t), routing="causal")
        torch.testing.assert_close(out2.logits[:, : t + 1], out.logits[:, : t + 1], **STRICT)
        for r, r2 in zip(out.routes, out2.routes, strict=True):
            assert torch.equal(r.mask[:, : t + 1], r2.mask[:, : t + 1])
        assert not torch.allclose(out2.logits[:, t + 1 :], out.logits[:, t + 1 :])


@pytest.mark.parametrize("mode", MODES)
def test_topk_mode_is_not_causal(mode):
    """The same property fails for top-k routing: later tokens change earlier choices and logits."""
    model = make_model(routing=mode)
    idx = tokens()
    out = model(idx, routing="topk")
    leaks = 0
    for t in (2, 6, 11):
        out2 = model(_change_after(idx, t, seed=t), routing="topk")
        leaks += not torch.allclose(out2.logits[:, : t + 1], out.logits[:, : t + 1])
    assert leaks > 0


# -- dense equivalence --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_full_capacity_with_unit_gate_equals_dense(mode, monkeypatch):
    model = make_model(routing=mode, capacity=1.0)
    dense = dense_twin_with_same_weights(model)
    idx = tokens()
    unit_gates(monkeypatch)
    out = model(idx, routing="topk")
    assert all(r.mask.all() for r in out.routes)
    torch.testing.assert_close(out.logits, dense(idx).logits, **STRICT)


@pytest.mark.parametrize("mode", MODES)
def test_causal_all_take_with_unit_gate_equals_dense(mode, monkeypatch):
    """A predictor that always says "take" makes causal routing dense; "skip" makes it identity
    (with routing="mlp", the dense attention alone)."""
    model = make_model(routing=mode, causal_router="predictor")
    dense = dense_twin_with_same_weights(model)
    idx = tokens()
    with torch.no_grad():
        for block in model.blocks:
            if block.routed:
                for pred in block.predictor.values():
                    pred.fc2.weight.zero_()
                    pred.fc2.bias.fill_(5.0)
    unit_gates(monkeypatch)
    out = model(idx, routing="causal")
    assert all(r.mask.all() for r in out.routes)
    torch.testing.assert_close(out.logits, dense(idx).logits, **STRICT)

    with torch.no_grad():
        for block in model.blocks:
            if block.routed:
                for pred in block.predictor.values():
                    pred.fc2.bias.fill_(-5.0)
    seen, _ = _record_routed_blocks(model)
    out = model(idx, routing="causal")
    assert all(not r.mask.any() for r in out.routes)
    assert len(seen) == 3
    for _, x_out, _, x_skip in seen:
        assert torch.equal(x_out, x_skip)
