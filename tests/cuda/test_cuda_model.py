"""The model's oracles on every device (`pytest -m cuda` selects the CUDA variants; they skip
without one): the loop oracle (tests/reference.py) in float64 and, beyond the margin, float32
and bf16; skipped tokens bit for bit in every dtype; causality; the dense twin; gradients
against the CPU's; top-k's tie rule. The reference always runs on the CPU in float64."""

from __future__ import annotations

import pytest
import torch
from devices import (
    CUDA_ONLY,
    DTYPES,
    MARGIN,
    MODES,
    TOLERANCE,
    assert_close_rel,
    moved,
    rows_beyond_margin,
)
from helpers import dense_twin_with_same_weights, force_routing, unit_gates
from model_helpers import make_model, tokens
from reference import reference_forward, topk_set

from mixture_of_depths.routing import topk_indices

ORACLE_MODES = ["joint-aux", "joint-pred", "stag-pred", "mlp-pred", "mlp-kv-pred", "residual"]


def _some_rows(model, ref, routing, dtype):  # noqa: ANN001, ANN202
    rows = rows_beyond_margin(model, ref.routes, routing, MARGIN[dtype])
    assert any(rows), "no row clears the margin: pick another seed"
    return rows


@pytest.mark.parametrize("mode", ORACLE_MODES)
@pytest.mark.parametrize("routing", ["topk", "causal"])
@pytest.mark.parametrize("dtype", ["f64", "f32"])
def test_forward_equals_the_loop_oracle(device, dtype, routing, mode):
    """Logits and decisions of the vectorised model on the device against the loop oracle on
    the CPU; in float32 only the rows whose every decision clears the margin are compared."""
    if device == "cpu" and dtype == "f32":
        pytest.skip("float64 on the CPU is tests/test_model.py's")
    dt = DTYPES[dtype]
    ref_model = make_model(seed=3, **MODES[mode])
    idx = tokens(batch=4, seed=3)
    ref = reference_forward(ref_model, idx, routing)
    rows = _some_rows(ref_model, ref, routing, dt)
    with torch.no_grad():
        out = moved(ref_model, device, dt)(idx.to(device), routing=routing)
    for b, ok in enumerate(rows):
        if not ok:
            continue
        assert_close_rel(out.logits[b], ref.logits[b], TOLERANCE[dt])
        for got, exp in zip(out.routes, ref.routes, strict=True):
            assert torch.equal(got.mask[b].cpu(), exp.mask[b]), (b, got.layer, got.kind)


@pytest.mark.parametrize("mode", [*ORACLE_MODES, "stag-aux"])
@pytest.mark.parametrize("routing", ["topk", "causal"])
@pytest.mark.parametrize("dtype", ["f64", "f32", "bf16"])
def test_skipped_tokens_leave_each_routed_block_bit_for_bit(device, dtype, routing, mode):
    """Whatever the dtype and device: a token the router did not choose leaves the routed
    (sub-)block exactly as it came in (the stream after each routed block, by forward hook)."""
    if device == "cpu" and dtype != "bf16":
        pytest.skip("tests/test_model.py has the CPU's float32 and float64")
    model = moved(make_model(seed=1, **MODES[mode]), device, DTYPES[dtype])
    seen = {}

    def hook(block, args, out):  # noqa: ANN001, ANN202
        seen[block.layer] = (args[0], out[0])

    handles = [b.register_forward_hook(hook) for b in model.blocks if b.routed]
    try:
        with torch.no_grad():
            out = model(tokens(seed=1).to(device), routing=routing)
    finally:
        for h in handles:
            h.remove()
    by_layer: dict[int, torch.Tensor] = {}
    for r in out.routes:  # a token untouched by the layer is one no router of it chose
        chosen = by_layer.get(r.layer, torch.zeros_like(r.mask))
        by_layer[r.layer] = chosen | r.mask
    if MODES[mode]["routing"] in ("mlp", "mlp_kv"):  # every token queries: every token changes
        return
    for layer, chosen in by_layer.items():
        x_in, x_out = seen[layer]
        skip = ~chosen
        assert skip.any() and chosen.any()
        assert torch.equal(x_in[skip], x_out[skip]), layer
        assert not torch.equal(x_in[chosen], x_out[chosen]), layer


@pytest.mark.parametrize("mode", ["joint-pred", "stag-aux", "mlp-pred", "mlp-kv-pred", "residual"])
@pytest.mark.parametrize("dtype", ["f64", "f32"])
def test_causal_routing_never_reads_a_later_token(device, dtype, mode):
    """Changing the tokens after t changes no logit and no decision at or before t."""
    if device == "cpu":
        pytest.skip("tests/test_model.py's on the CPU")
    dt = DTYPES[dtype]
    model = moved(make_model(seed=2, **MODES[mode]), device, dt)
    idx = tokens(seed=2).to(device)
    t = 11
    other = idx.clone()
    other[:, t + 1 :] = (other[:, t + 1 :] + 7) % model.config.vocab_size
    with torch.no_grad():
        a, b = model(idx, routing="causal"), model(other, routing="causal")
    assert_close_rel(a.logits[:, : t + 1], b.logits[:, : t + 1], TOLERANCE[dt] / 10)
    for ra, rb in zip(a.routes, b.routes, strict=True):
        assert torch.equal(ra.mask[:, : t + 1], rb.mask[:, : t + 1])


@pytest.mark.parametrize("dtype", ["f64", "f32"])
@pytest.mark.parametrize("routing", ["topk", "causal"])
def test_every_token_taking_with_unit_gates_is_the_dense_twin(device, dtype, routing, monkeypatch):
    """Capacity 1.0, every token taking, g = 1: the routed model computes its dense twin."""
    if device == "cpu":
        pytest.skip("tests/test_model.py's on the CPU")
    unit_gates(monkeypatch)
    model = make_model(seed=4, capacity=1.0, causal_router="predictor")
    force_routing(model, True)
    dense = dense_twin_with_same_weights(model)
    idx = tokens(seed=4).to(device)
    dt = DTYPES[dtype]
    with torch.no_grad():
        got = moved(model, device, dt)(idx, routing=routing).logits
        want = moved(dense, device, dt)(idx).logits
    assert_close_rel(got, want, TOLERANCE[dt])


@pytest.mark.parametrize("device", CUDA_ONLY)
@pytest.mark.parametrize("mode", ORACLE_MODES)
def test_gradients_on_the_device_equal_the_cpus(device, mode):
    """float64: a training forward and backward on the device gives the CPU's loss and every
    parameter's gradient (same decisions: float64 leaves no round-off near a boundary)."""
    cpu = make_model(seed=1, **MODES[mode]).train()
    dev = moved(cpu, device, torch.float64)
    idx, y = tokens(seed=5), tokens(seed=6)
    for m, d in ((cpu, "cpu"), (dev, device)):
        out = m(idx.to(d), y.to(d), routing="topk")
        out.loss.backward()
    for (name, p), q in zip(cpu.named_parameters(), dev.parameters(), strict=True):
        if p.grad is None:
            assert q.grad is None, name
            continue
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("dtype", ["f64", "f32", "bf16"])
def test_topk_breaks_ties_by_position_on_every_device(device, dtype):
    """Scores with many exact ties (small integers, exact in every dtype): the chosen set is
    the loop rule's (earlier wins), sorted by position."""
    if device == "cpu" and dtype != "bf16":
        pytest.skip("tests/test_routing.py's on the CPU")
    g = torch.Generator().manual_seed(0)
    r = torch.randint(-3, 4, (5, 29), generator=g).to(DTYPES[dtype])
    for k in (0, 1, 7, 29):
        got = topk_indices(r.to(device), k).cpu()
        want = torch.tensor([sorted(topk_set(row.tolist(), k)) for row in r]).view(5, k)
        assert torch.equal(got, want), k
