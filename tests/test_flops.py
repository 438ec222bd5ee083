"""Analytic FLOPs against torch's own FlopCounterMode on the same model and input."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import force_routing
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mixture_of_depths import MoDConfig, MoDTransformer
from mixture_of_depths.cache import KVCache
from mixture_of_depths.config import ROUTE_KINDS
from mixture_of_depths.experts import ExpertMLP, slot_shares
from mixture_of_depths.flops import decode_cost, estimate_flops, format_report, layer_shares
from mixture_of_depths.generate import decode_step, prefill
from mixture_of_depths.layers import MLP, Attention, Predictor

BASE = dict(
    vocab_size=97,
    d_model=48,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    max_seq_len=64,
    predictor_hidden=16,
)


def counted(model: MoDTransformer, idx: torch.Tensor, backward: bool = False) -> int:
    # On the CPU the fused flash kernel counts as 0: the math backend's matmuls are countable.
    # FlopCounterMode has no formula for torch._grouped_mm either: experts run as the loop.
    for m in model.modules():
        if isinstance(m, ExpertMLP):
            m.use_grouped_mm = False
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        out = model(idx, idx)
        if backward:
            out.loss.backward()  # the aux loss too: it trains the predictor
    return fc.get_total_flops()


CASES = [
    dict(layer_pattern="D"),
    dict(layer_pattern="DR", capacity=0.125),
    dict(layer_pattern="DR", capacity=0.5, routing="staggered"),
    dict(layer_pattern="R", capacity=0.25, causal_router="predictor"),
    dict(layer_pattern="RRD", capacity=1.0, routing="staggered", causal_router="predictor"),
    dict(layer_pattern="DR", capacity=0.01),  # k = 0 on these lengths
    # routing="mlp": attention dense in the routed layers, only the MLP routed
    dict(layer_pattern="DR", capacity=0.25, routing="mlp"),
    dict(layer_pattern="RRD", capacity=0.5, routing="mlp", causal_router="predictor"),
    dict(layer_pattern="DR", capacity=0.01, routing="mlp"),  # k = 0: attention alone
    # routing="mlp_kv": every token queries, the takers alone are keys and run the MLP
    dict(layer_pattern="DR", capacity=0.25, routing="mlp_kv"),
    dict(layer_pattern="RRD", capacity=0.5, routing="mlp_kv", causal_router="aux_loss"),
    dict(layer_pattern="DR", capacity=0.01, routing="mlp_kv"),  # k = 0: no key, no query
]
TRAIN_CASES = [*CASES[1:4], *CASES[6:8], *CASES[9:11]]


@pytest.mark.parametrize("over", CASES, ids=[str(c) for c in CASES])
@pytest.mark.parametrize("T", [40, 64])
def test_forward_equals_flop_counter(over, T):
    cfg = MoDConfig(**{**BASE, **over})
    model = MoDTransformer(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, T), generator=torch.Generator().manual_seed(0))
    want = counted(model, idx)
    got = estimate_flops(cfg, T, batch_size=3).forward
    assert got == pytest.approx(want, rel=0.01), (got, want)


@pytest.mark.parametrize("over", TRAIN_CASES, ids=[str(c) for c in TRAIN_CASES])
def test_training_step_equals_flop_counter(over):
    cfg = MoDConfig(**{**BASE, **over})
    model = MoDTransformer(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    want = counted(model, idx, backward=True)
    got = estimate_flops(cfg, 48, batch_size=2).train
    assert got == pytest.approx(want, rel=0.01), (got, want)


def test_routed_weight_flops_are_capacity_share_and_dense_twin_attached():
    """Every other block at 12.5%: projections cost (1 + 1/8) / 2 = 9/16 of the dense twin's."""
    cfg = MoDConfig(**{**BASE, "layer_pattern": "DR", "capacity": 0.125, "max_seq_len": 256})
    rep = estimate_flops(cfg, 256)
    assert rep.dense is not None and rep.dense.dense is None
    mm = sum(lf.matmul for lf in rep.layers) / sum(lf.matmul for lf in rep.dense.layers)
    assert mm == pytest.approx(9 / 16)
    # Attention of a routed block shrinks as (k/T)^2.
    assert rep.layers[1].attention == pytest.approx(rep.dense.layers[1].attention / 64)
    assert rep.kv_bytes_per_token == pytest.approx(rep.dense.kv_bytes_per_token * 9 / 16)
    assert rep.forward_causal < rep.forward
    text = format_report(rep)
    assert "dense twin" in text and "KV-cache bytes per token" in text


def test_mlp_routing_prices_attention_dense_and_the_mlp_at_capacity():
    """routing="mlp": a routed layer's attention costs a dense layer's (T queries over T keys)
    and caches every token (KV bytes as the dense twin's); its MLP runs k = 12.5% of the tokens;
    one router (and predictor) weighs every token."""
    cfg = MoDConfig(**{**BASE, "layer_pattern": "DR", "capacity": 0.125, "max_seq_len": 256})
    mlp = dataclasses.replace(cfg, routing="mlp", causal_router="predictor")
    rep, joint = estimate_flops(mlp, 256), estimate_flops(cfg, 256)
    dense = rep.dense.layers[1]
    assert rep.kv_bytes_per_token == rep.dense.kv_bytes_per_token
    assert rep.layers[1].attention == dense.attention
    assert rep.layers[1].attention_causal == dense.attention_causal
    attn_mm = 2 * 256 * Attention.params(cfg)
    assert rep.layers[1].matmul == pytest.approx(attn_mm + 2 * 32 * MLP.params(cfg))
    assert rep.layers[1].router == joint.layers[1].router == 256 * 2 * cfg.d_model
    assert rep.layers[1].predictor == 256 * Predictor.flops_per_token(cfg)
    assert rep.layers[1].tokens == 256 and rep.layers[0] == joint.layers[0]


def test_mlp_kv_prices_every_query_over_the_takers_keys():
    """routing="mlp_kv": every token projects a query and the output, the k = 12.5% takers a key
    and a value and run the MLP; attention multiplies T queries by k keys (between joint
    routing's k x k and MLP-only routing's T x T); the cache holds the takers (KV bytes as joint
    routing's); one router and predictor weigh every token."""
    cfg = MoDConfig(**{**BASE, "layer_pattern": "DR", "capacity": 0.125, "max_seq_len": 256})
    rep = estimate_flops(dataclasses.replace(cfg, routing="mlp_kv"), 256)
    joint = estimate_flops(cfg, 256)
    mlp = estimate_flops(dataclasses.replace(cfg, routing="mlp"), 256)
    T, k = 256, 32
    routed = rep.layers[1]
    assert rep.kv_bytes_per_token == joint.kv_bytes_per_token
    assert routed.attention == T * k * Attention.flops_per_key(cfg)
    assert joint.layers[1].attention < routed.attention < mlp.layers[1].attention
    q_o = Attention.params(cfg) - Attention.kv_params(cfg)
    want = 2 * (T * q_o + k * Attention.kv_params(cfg) + k * MLP.params(cfg))
    assert routed.matmul == pytest.approx(want)
    assert routed.router == joint.layers[1].router and routed.predictor == joint.layers[1].predictor
    assert routed.tokens == T and rep.layers[0] == joint.layers[0]
    # causal attention: query i reads the takers at or before it, about (k + 1) / 2 on average
    assert routed.attention_causal == pytest.approx(routed.attention * (k + 1) / 2 / k)


def test_decode_expectation_follows_take_rate():
    cfg = MoDConfig(**{**BASE, "layer_pattern": "DR", "causal_router": "aux_loss"})
    none = estimate_flops(cfg, 64, take_rate=0.0)
    full = estimate_flops(cfg, 64, take_rate=1.0)
    # Taking every token costs the dense twin's decode plus the routers.
    routers = 2 * cfg.d_model * len(cfg.routed_layers)
    assert full.decode_per_token == pytest.approx(full.dense.decode_per_token + routers)
    assert none.decode_per_token < full.decode_per_token
    with pytest.raises(ValueError, match="take_rate"):
        estimate_flops(cfg, 64, take_rate=[0.1])
    with pytest.raises(ValueError, match="seq_len"):
        estimate_flops(cfg, 0)


def test_mod_flops_cli(capsys):
    import json

    from mixture_of_depths.cli import main

    assert main(["flops", "--preset", "tiny", "--seq-len", "64", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    cfg = MoDConfig.preset("tiny")
    assert rep["forward"] == estimate_flops(cfg, 64).forward
    assert rep["dense"]["forward"] > rep["forward"]
    assert main(["flops", "--preset", "tiny", "--capacity", "0.5"]) == 0
    assert "capacity 0.5" in capsys.readouterr().out


@pytest.mark.parametrize(
    "over, takes",
    [
        (dict(layer_pattern="DR", causal_router="predictor"), [True, False]),
        (
            dict(layer_pattern="RRD", routing="staggered", causal_router="predictor"),
            [1, 0, 0, 1, 1, 1],  # take attention only, the MLP only, both
        ),
        # aux_loss: r = x @ w decides, so w = 0 (r = 0, not > 0) is the only sure decision: skip.
        (dict(layer_pattern="DR", routing="staggered", causal_router="aux_loss"), [0, 0, 0, 0]),
        # routing="mlp": every row attends over every cached token; only the MLP is decided
        (dict(layer_pattern="RRD", routing="mlp", causal_router="predictor"), [1, 0, 1]),
        (dict(layer_pattern="DR", routing="mlp", causal_router="aux_loss"), [0, 0]),
        # routing="mlp_kv": every row queries the takers' keys; a layer holding none computes
        # no attention at all
        (dict(layer_pattern="RRD", routing="mlp_kv", causal_router="predictor"), [1, 0, 1]),
        (dict(layer_pattern="DR", routing="mlp_kv", causal_router="predictor"), [0, 1]),
        (dict(layer_pattern="DR", routing="mlp_kv", causal_router="aux_loss"), [0, 0]),
    ],
    ids=["joint", "staggered", "aux_loss", "mlp", "mlp-aux_loss", "mlp_kv", "mlp_kv-skip-take",
         "mlp_kv-aux_loss"],
)  # fmt: skip
def test_decode_cost_equals_flop_counter_on_a_decode_step(over, takes):
    """`decode_cost` (the sum of the kinds' cost functions, which the decode benchmark uses) counts
    what FlopCounterMode counts on a real decode step: each router's decision is forced (take or
    skip) and the context each layer attends over is read back from the cache."""
    cfg = MoDConfig(**{**BASE, **over})
    torch.manual_seed(0)
    model = MoDTransformer(cfg).eval()
    force_routing(model, [bool(t) for t in takes])
    P = 20
    idx = torch.randint(0, cfg.vocab_size, (1, P), generator=torch.Generator().manual_seed(2))
    cache = KVCache(cfg, 1, P + 1)
    logits, _ = prefill(model, idx, torch.tensor([P]), cache)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        _, routing = decode_step(model, logits.argmax(-1), cache)
    assert routing[0].tolist() == [bool(t) for t in takes]  # the forcing held
    shares = layer_shares(cfg, [float(t) for t in takes])
    cached = (cache.lengths[:, 0].double() / (P + 1)).tolist()  # keys each layer attended over
    flops, _ = decode_cost(cfg, shares, cached, P + 1)
    assert flops == pytest.approx(fc.get_total_flops(), rel=1e-9)


@pytest.mark.parametrize("routing", ["staggered", "mlp", "mlp_kv"])
def test_decode_cost_matches_the_decode_expectation_of_estimate_flops(routing):
    """At the capacity as take-rate and cached share, the benchmark's per-token decode FLOPs are
    estimate_flops' decode_per_token; the bytes of a dense twin read every weight once."""
    cfg = MoDConfig(**{**BASE, "layer_pattern": "DR", "routing": routing})
    rep = estimate_flops(cfg, 64)
    c = cfg.capacity
    shares = layer_shares(cfg, [c] * len(ROUTE_KINDS[routing]) * len(cfg.routed_layers))
    # the share the attention's keys come from: 1 where attention is dense, the takers' with
    # routing="mlp_kv" (every token queries them)
    cached = [m if routing == "mlp_kv" and a != m else a for a, m in shares]
    flops, _ = decode_cost(cfg, shares, cached, 64)
    assert flops == pytest.approx(rep.decode_per_token)
    dense = cfg.dense_twin()
    named = MoDTransformer(dense).named_parameters()
    n_params = sum(p.numel() for n, p in named if "norm" not in n)
    _, nbytes = decode_cost(dense, layer_shares(dense, []), [1.0] * 4, 0, element_size=4)
    assert nbytes == 4 * n_params  # tied embedding: the lm_head's weights are the embedding's


# -- expert layers ------------------------------------------------------------------------------
EXPERTS = dict(n_experts=4, d_ff_expert=40)
EXPERT_CASES = [
    dict(layer_pattern="D", **EXPERTS),  # MoE, top-1
    dict(layer_pattern="D", **EXPERTS, experts_per_token=2, n_noop_experts=2),  # integrated
    dict(layer_pattern="D", **EXPERTS, expert_capacity_factor=0.5),  # dropping
    dict(layer_pattern="DR", capacity=0.25, **EXPERTS, n_noop_experts=3),  # staged + no-ops
    dict(layer_pattern="R", capacity=0.5, routing="staggered", **EXPERTS, experts_per_token=2),
    dict(layer_pattern="DR", capacity=0.25, routing="mlp", **EXPERTS, n_noop_experts=2),
    dict(layer_pattern="DR", capacity=0.25, routing="mlp_kv", **EXPERTS, n_noop_experts=2),
]


def measured_shares(model: MoDTransformer, idx: torch.Tensor) -> list[float]:
    """Per layer, the share of expert slots that ran a real expert on this forward."""
    return slot_shares(model(idx, idx).expert_routes, model.config.n_layers)


@pytest.mark.parametrize("over", EXPERT_CASES, ids=[str(c) for c in EXPERT_CASES])
def test_expert_forward_equals_flop_counter(over):
    """Router, the experts that ran (no-op and dropped slots cost 0), given the measured share."""
    cfg = MoDConfig(**{**BASE, **over})
    model = MoDTransformer(cfg)  # training mode: the capacity drops
    idx = torch.randint(0, cfg.vocab_size, (3, 40), generator=torch.Generator().manual_seed(2))
    shares = measured_shares(model, idx)
    want = counted(model, idx)
    got = estimate_flops(cfg, 40, batch_size=3, expert_share=shares).forward
    assert got == pytest.approx(want, rel=0.01), (got, want)
    # The default is the bound: never less than what ran.
    bound = estimate_flops(cfg, 40, batch_size=3)
    assert bound.forward >= got * (1 - 1e-12)
    assert all(lf.expert_share >= s for lf, s in zip(bound.layers, shares, strict=True))


@pytest.mark.parametrize("over", EXPERT_CASES[1:3], ids=[str(c) for c in EXPERT_CASES[1:3]])
def test_expert_training_step_equals_flop_counter(over):
    cfg = MoDConfig(**{**BASE, **over})
    model = MoDTransformer(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(3))
    shares = measured_shares(model, idx)  # the same input routes the same way below
    want = counted(model, idx, backward=True)
    got = estimate_flops(cfg, 48, batch_size=2, expert_share=shares).train
    assert got == pytest.approx(want, rel=0.01), (got, want)


def test_expert_bound_and_dense_twin():
    """Without no-ops or a capacity every slot runs (share 1) and the experts cost what the dense
    twin's MLP costs; a capacity factor bounds the share at n_experts * capacity / slots."""
    cfg = MoDConfig(**{**BASE, **EXPERT_CASES[0]})
    rep = estimate_flops(cfg, 64, batch_size=2)
    twin = rep.dense
    assert twin is not None and not twin.config.has_experts
    assert twin.config.d_ff == cfg.d_ff_expert and twin.config.layer_pattern == "D"
    assert [lf.expert_share for lf in rep.layers] == [1.0] * cfg.n_layers
    for lf, dl in zip(rep.layers, twin.layers, strict=True):
        assert lf.matmul == pytest.approx(dl.matmul)
        assert lf.router == pytest.approx(2 * 64 * 2 * cfg.d_model * cfg.n_experts)
    drop = MoDConfig(**{**BASE, **EXPERTS, "expert_capacity_factor": 0.3})
    got = estimate_flops(drop, 50, batch_size=3).layers[0].expert_share
    assert got == pytest.approx(4 * math.ceil(0.3 * 150 / 4) / 150)
    # Decoding never drops: a capacity's training share does not cut the decode figure.
    full = estimate_flops(drop, 50, expert_share=1.0).decode_per_token
    assert estimate_flops(drop, 50, expert_share=0.3).decode_per_token == full
    noop = MoDConfig(**{**BASE, **EXPERTS, "n_noop_experts": 4})
    half = estimate_flops(noop, 50, expert_share=0.5).decode_per_token
    assert half < estimate_flops(noop, 50).decode_per_token  # no-ops do save in decoding
    with pytest.raises(ValueError, match="expert_share"):
        estimate_flops(drop, 50, expert_share=[0.5])
    with pytest.raises(ValueError, match="expert_share"):
        estimate_flops(MoDConfig(**BASE), 50, expert_share=0.5)
