"""Mixture-of-Recursions against oracles: the loop reference (shared weights applied step by step,
the active set filtered per step), exact k and nesting, shared weights, causality, batch
independence, FLOPs against FlopCounterMode, KV bytes against a filled cache, gradients to every
router, the config's refusals. Comparisons ending in a hard decision run in float64
(docs/semantics.md, "Numerics and tests")."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import V, make_model, random_tokens
from recursion_helpers import CASES as BASE_CASES
from recursion_helpers import IDS as BASE_IDS
from recursion_helpers import mor_config
from reference import reference_recursion
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mixture_of_depths import MoDConfig, MoDTransformer, capacity_tokens
from mixture_of_depths.cache import KVCache
from mixture_of_depths.flops import estimate_flops
from mixture_of_depths.generate import prefill

TOL = dict(rtol=0.0, atol=1e-10)


CASES = [
    *BASE_CASES,
    dict(recursions=4, recursion_capacities=(1.0, 0.5, 0.25), recursion_kv="share"),
]
IDS = [*BASE_IDS, "unrouted-step-share"]


@pytest.mark.parametrize("over", CASES, ids=IDS)
def test_forward_equals_the_loop_reference(over):
    model = make_model(mor_config(**over))
    idx = random_tokens(2, 11, seed=3)
    for routing in ("topk", "causal"):
        out = model(idx, routing=routing)
        ref = reference_recursion(model, idx, routing)
        torch.testing.assert_close(out.logits, ref.logits, **TOL)
        assert [r.name for r in out.routes] == model.route_names()
        assert len(out.routes) == len(ref.routes) == len(model.config.recursion_routed_steps)
        for got, want in zip(out.routes, ref.routes, strict=True):
            assert got.kind == "recursion" and got.layer == want.layer
            assert torch.equal(got.mask, want.mask), (routing, got.layer)
            assert torch.equal(got.target, want.target)
            torch.testing.assert_close(got.logits, want.logits, **TOL)
            if want.predictor_logits is not None:
                torch.testing.assert_close(got.predictor_logits, want.predictor_logits, **TOL)
    # routing matters: some tokens stop, some go on
    assert any(0 < r.mask.float().mean() < 1 for r in model(idx, routing="causal").routes)


@pytest.mark.parametrize("T", [10, 23])
def test_exact_k_per_row_and_each_step_a_subset_of_the_last(T):
    cfg = mor_config(recursions=4, recursion_capacities=(0.6, 0.6, 0.15))
    model = make_model(cfg)
    idx = random_tokens(3, T, seed=5)
    for routing in ("topk", "causal"):
        routes = model(idx, routing=routing).routes
        prev = torch.ones(3, T, dtype=torch.bool)
        for r, route in zip((1, 2, 3), routes, strict=True):
            if routing == "topk":
                k = capacity_tokens(cfg.recursion_capacity(r), T)
                assert route.mask.sum(1).tolist() == [k] * 3
            assert not (route.mask & ~prev).any()
            prev = route.mask


def test_weights_are_shared_the_parameters_are_the_unique_layers_plus_routers():
    for over in CASES:
        cfg = mor_config(**over)
        model = MoDTransformer(cfg)
        plain = MoDTransformer(cfg.dense_twin())
        extra = sum(p.numel() for p in model.recursion.parameters())
        assert model.num_params() == plain.num_params() + extra > plain.num_params()
        assert set(model.state_dict()) - set(plain.state_dict()) == {
            k for k in model.state_dict() if k.startswith("recursion.")
        }
    # the same modules run at every step: count each layer's applications
    cfg = mor_config()
    model = make_model(cfg)
    calls = [0] * cfg.n_layers
    for i, block in enumerate(model.blocks):
        block.attn.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    model(random_tokens(2, 12, seed=1))
    assert calls == [1, 3, 3, 1]


@pytest.mark.parametrize("over", [CASES[0], CASES[2], CASES[4]], ids=["expert", "aux", "token"])
def test_causal_mode_never_reads_a_later_token(over):
    model = make_model(mor_config(**over))
    idx = random_tokens(2, 16, seed=7)
    base = model(idx, routing="causal")
    for t in (5, 11):
        changed = idx.clone()
        changed[:, t:] = (changed[:, t:] + 1) % V
        out = model(changed, routing="causal")
        torch.testing.assert_close(out.logits[:, :t], base.logits[:, :t], **TOL)
        for a, b in zip(out.routes, base.routes, strict=True):
            assert torch.equal(a.mask[:, :t], b.mask[:, :t])


@pytest.mark.parametrize("over", [CASES[1], CASES[3]], ids=["expert-share", "token"])
def test_a_batch_equals_each_row_alone(over):
    model = make_model(mor_config(**over))
    idx = random_tokens(3, 13, seed=8)
    for routing in ("topk", "causal"):
        out = model(idx, routing=routing)
        for b in range(3):
            alone = model(idx[b : b + 1], routing=routing)
            torch.testing.assert_close(out.logits[b : b + 1], alone.logits, **TOL)
            for a, c in zip(out.routes, alone.routes, strict=True):
                assert torch.equal(a.mask[b : b + 1], c.mask)


def counted(model: MoDTransformer, idx: torch.Tensor, backward: bool) -> int:
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        out = model(idx, idx)
        if backward:
            out.loss.backward()
    return fc.get_total_flops()


@pytest.mark.parametrize("over", CASES, ids=IDS)
def test_forward_and_training_step_equal_flop_counter(over):
    cfg = mor_config(**over)
    model = MoDTransformer(cfg)
    idx = random_tokens(2, 40, seed=2)
    report = estimate_flops(cfg, 40, batch_size=2)
    assert report.forward == pytest.approx(counted(model, idx, False), rel=0.01)
    assert report.train == pytest.approx(counted(model, idx, True), rel=0.01)
    assert report.dense is not None and report.dense.config == cfg.dense_twin()


@pytest.mark.parametrize("over", [CASES[0], CASES[1], CASES[3]], ids=["expert", "share", "token"])
def test_kv_bytes_per_token_equal_what_a_prefill_caches(over):
    cfg = mor_config(**over)
    model = make_model(cfg)
    B, T = 3, 20
    idx = random_tokens(B, T, seed=4)
    cache = KVCache(cfg, B, T, dtype=torch.float64)
    _, table = prefill(model, idx, torch.full((B,), T), cache)
    takes = table.double().mean((0, 1)).tolist()  # each routed step's share of the tokens
    est = estimate_flops(cfg, T, take_rate=takes, bytes_per_element=8).kv_bytes_per_token
    assert est * B * T == pytest.approx(cache.nbytes_used, rel=1e-12)
    if cfg.recursion_kv == "share":  # later steps cache nothing
        assert est == estimate_flops(cfg.dense_twin(), T, bytes_per_element=8).kv_bytes_per_token


@pytest.mark.parametrize("over", [CASES[0], CASES[2], CASES[3]], ids=["pred", "aux", "token"])
def test_every_router_and_predictor_gets_a_gradient(over):
    cfg = mor_config(**over)
    torch.manual_seed(0)
    model = MoDTransformer(cfg).train()
    idx = random_tokens(2, 24, seed=6)
    out = model(idx, idx)
    assert out.aux_loss is not None and torch.isfinite(out.loss)
    out.loss.backward()
    for name, p in model.recursion.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert all(p.grad is not None for p in model.blocks.parameters())


def test_token_choice_balancing_loss_is_one_when_the_depths_are_even():
    model = MoDTransformer(mor_config(recursion_router="token", recursion_capacities=None))
    with torch.no_grad():
        model.recursion.router["depth"].weight.zero_()  # uniform probabilities
    out = model(random_tokens(2, 12, seed=1))
    # every token takes the first max (depth 1): all mass on one depth, probabilities 1/3
    assert out.aux_loss.item() == pytest.approx(1.0)
    assert all(not r.mask.any() for r in out.routes)


@pytest.mark.parametrize(
    "over, message",
    [
        (dict(layer_pattern="DR"), "layer_pattern='DR' with recursions=3"),
        (
            dict(recursion_capacities=(0.5,)),
            "1 share for 3 recursion steps; give 3 shares in (0, 1], non-increasing",
        ),
        (dict(recursion_capacities=(0.25, 0.5)), "the shares increase"),
        (dict(recursion_capacities=(0.0, 0.0)), "a share outside (0, 1]"),
        (dict(recursion_capacities=(0.5, 0.25, 0.125)), "the first is 0.5, not 1.0"),
        (dict(recursion_capacities=(1.0, 0.5, 0.25, 0.125)), "or the 2 routed steps' alone"),
        (dict(recursion_router="token"), "is for recursion_router='expert'"),
        (dict(n_layers=2), "needs n_layers >= 3"),
        (
            dict(recursions=1, recursion_capacities=None, recursion_kv="share"),
            "need recursions > 1",
        ),
        (dict(recursions=0), "recursions"),
        (dict(recursion_kv="both"), "recursion_kv"),
        (dict(n_experts=2), "n_experts=2"),
        (dict(causal_thresholds=(0.1,)), "give 2 thresholds"),
    ],
)
def test_bad_recursion_configs_are_refused_clearly(over, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        mor_config(**over)


def test_defaults_json_round_trip_and_the_preset():
    cfg = mor_config(recursion_capacities=None, recursions=4)
    assert cfg.recursion_capacities == (1.0, 0.5, 0.25, 0.125)
    # one share per step (the first 1.0), or the routed steps' alone: the same model
    assert mor_config(recursion_capacities=(0.5, 0.25, 0.125), recursions=4) == cfg
    assert cfg.recursion_routed_steps == [1, 2, 3]
    assert [cfg.recursion_tokens(r, 16) for r in range(4)] == [16, 8, 4, 2]
    for step in (-1, 4):
        with pytest.raises(
            ValueError, match=f"recursion step {step}: this model's steps are 0 .. 3"
        ):
            cfg.recursion_capacity(step)
    token = mor_config(recursion_router="token", recursion_capacities=None)
    assert [token.recursion_capacity(r) for r in range(3)] == [1.0, 2 / 3, 1 / 3]  # balanced
    # a preset's capacities are its own recursions': another number of steps needs its own
    with pytest.raises(ValueError, match="give recursion_capacities too"):
        MoDConfig.preset("small-mor", recursions=4)
    assert MoDConfig.preset("small-mor", recursions=4, recursion_capacities=None).recursions == 4
    assert MoDConfig.from_json(cfg.to_json()) == cfg
    small, mor = MoDConfig.preset("small"), MoDConfig.preset("small-mor")
    assert mor.recursive and not mor.is_dense and mor.d_model == small.d_model
    ratio = estimate_flops(mor, 256).train / estimate_flops(small, 256).train
    assert 0.95 < ratio < 1.05, ratio
    plain = dataclasses.replace(mor, recursion_capacities=(1.0, 1.0))
    assert plain.is_dense and plain.recursion_routed_steps == []
