"""Calibrated causal thresholds against oracles: the fitted rate is the asked share (a count over
the scores), every path that decides causally uses the thresholds (cached decoding equals the
full recomputation, the routes' masks are score > threshold), and they survive a checkpoint."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import TINY, make_model, random_tokens, tc, tiny_config

from mixture_of_depths import MoDConfig, generate, generate_reference
from mixture_of_depths.calibrate import causal_take_rates, fit_thresholds, threshold_at
from mixture_of_depths.cli import main
from mixture_of_depths.flops import estimate_flops
from mixture_of_depths.routing import routing_accuracy
from mixture_of_depths.runtime.checkpoint import load_model, save_checkpoint
from mixture_of_depths.train import train


@pytest.mark.parametrize("take", [0.1, 0.125, 0.5])
def test_a_threshold_has_the_asked_share_above_it_and_no_score_near_it(take):
    scores = torch.randn(4000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    thr = threshold_at(scores, take)
    assert abs(float((scores > thr).double().mean()) - take) <= 0.001 + 1 / 4000
    assert float((scores - thr).abs().min()) > 0  # nothing on it
    tied = torch.cat([torch.zeros(30), torch.ones(70)])  # only one place to cut
    assert float((tied > threshold_at(tied, 0.5)).double().mean()) == 0.7


@pytest.mark.parametrize(
    "routing,causal_router",
    [("joint", "predictor"), ("joint", "aux_loss"), ("staggered", "predictor"),
     ("mlp_kv", "predictor")],
)  # fmt: skip
def test_fitted_thresholds_give_each_router_the_capacity(routing, causal_router):
    model = make_model(  # "DR": each router reads a dense block's output, not bare embeddings
        tiny_config(routing=routing, causal_router=causal_router, capacity=0.25, layer_pattern="DR")
    )
    batches = [random_tokens(4, 48, seed=s) for s in range(3)]
    before = causal_take_rates(model, batches)
    thresholds = fit_thresholds(model, batches)
    assert len(thresholds) == len(before) == model.config.n_routers
    assert model.config.causal_thresholds == tuple(thresholds)
    n = sum(x.numel() for x in batches)
    for name, rate in causal_take_rates(model, batches).items():
        assert abs(rate - 0.25) <= 0.001 + 2 / n, (name, before[name], rate)
    # the masks are score > threshold, router by router; accuracy counts the same decisions
    routes = model(batches[0], routing="causal").routes
    for r, thr in zip(routes, thresholds, strict=True):
        assert r.threshold == thr and torch.equal(r.mask, r.decision_logits > thr)
    topk = model(batches[0], routing="topk").routes
    want = {r.name: float(((r.decision_logits > t) == r.target).float().mean())
            for r, t in zip(topk, thresholds, strict=True)}  # fmt: skip
    assert routing_accuracy(topk) == pytest.approx(want)


@pytest.mark.parametrize("recursion_kv", ["recursion", "share"])
def test_recursion_steps_are_fitted_to_their_own_capacities_among_active_tokens(recursion_kv):
    """MoR: a step continues a token iff it is still active and its score clears the threshold,
    so each step's threshold is fitted among the active tokens, for the step's own capacity as a
    share of all tokens (not the MoD `capacity`): the take-rates after fitting are (0.5, 0.25)
    on the fitted tokens, counted over every token; the masks stay nested."""
    cfg = tiny_config(layer_pattern="D", recursions=3, recursion_capacities=(0.5, 0.25),
                      causal_router="predictor", recursion_kv=recursion_kv)  # fmt: skip
    model = make_model(cfg)
    batches = [random_tokens(4, 48, seed=s) for s in range(3)]
    thresholds = fit_thresholds(model, batches)
    assert len(thresholds) == 2 and model.config.causal_thresholds == tuple(thresholds)
    n = sum(x.numel() for x in batches)
    rates = causal_take_rates(model, batches)
    for rate, want in zip(rates.values(), (0.5, 0.25), strict=True):
        assert abs(rate - want) <= 0.001 + 2 / n, rates
    for x in batches:
        first, second = model(x, routing="causal").routes
        assert not (second.mask & ~first.mask).any()  # nested: only active tokens continue
    # accuracy counts a step's causal decision as generation makes it: taken only by a token
    # still active, against the nested top-k target
    first, second = model(batches[0], routing="topk").routes
    d1, d2 = (r.decision_logits > t for r, t in zip((first, second), thresholds, strict=True))
    want = [(d1 == first.target).float().mean(), ((d1 & d2) == second.target).float().mean()]
    assert list(routing_accuracy([first, second]).values()) == pytest.approx(
        [float(w) for w in want]
    )
    token = make_model(tiny_config(layer_pattern="D", recursions=3, recursion_router="token"))
    with pytest.raises(ValueError, match="token-choice recursion .* nothing to calibrate"):
        fit_thresholds(token, batches)


def test_cached_generation_decides_with_the_thresholds():
    """Decode steps decide with the thresholds as the full causal forward does (float64)."""
    model = make_model(tiny_config(capacity=0.25))
    fit_thresholds(model, [random_tokens(4, 48, seed=7)])
    assert any(t != 0 for t in model.config.causal_thresholds)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    got = generate(model, prompts, max_new_tokens=12, temperature=0.0, return_routing=True)
    want = generate_reference(model, prompts, max_new_tokens=12)
    assert got.tokens == want.tokens
    for a, b in zip(got.routing, want.routing, strict=True):
        assert torch.equal(a, b)


def test_thresholds_survive_a_checkpoint_and_json(tmp_path):
    model = make_model(tiny_config(), dtype=torch.float32)
    thresholds = fit_thresholds(model, [random_tokens(2, 40, seed=3)])
    cfg = MoDConfig.from_json(model.config.to_json())
    assert cfg.causal_thresholds == tuple(thresholds)
    save_checkpoint(tmp_path / "ck", model, model.config)
    back, cfg = load_model(tmp_path / "ck")
    assert cfg.causal_thresholds == tuple(thresholds)
    x = random_tokens(2, 40, seed=4)
    with torch.no_grad():
        assert torch.equal(back(x, routing="causal").logits, model(x, routing="causal").logits)


def test_bad_thresholds_are_refused_by_name():
    with pytest.raises(ValueError, match="causal_thresholds"):
        tiny_config(causal_thresholds=(0.1,))  # one, for a model with three routers
    with pytest.raises(ValueError, match="causal_thresholds"):
        tiny_config(causal_thresholds=(0.0, float("nan"), 0.0))
    with pytest.raises(ValueError, match="dense"):
        fit_thresholds(make_model(tiny_config(layer_pattern="D")), [random_tokens(1, 8, seed=0)])


@pytest.mark.parametrize("routing", ["joint", "mlp_kv"])
def test_mod_calibrate_writes_a_checkpoint_whose_take_rates_are_the_capacity(
    corpus, tmp_path, capsys, routing
):
    run = tmp_path / "run"
    cfg = MoDConfig(**TINY, routing=routing)
    train(cfg, tc(corpus, run, steps=8, eval_batches=4, seq_len=32), progress=False)
    out = tmp_path / "calibrated"
    capsys.readouterr()  # the training's lines
    assert main(["calibrate", str(run / "checkpoint"), "--out", str(out), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    cap = res["capacity"]
    after, before = res["after"]["take_rate"], res["before"]["take_rate"]
    # held-out half: closer to the capacity than before, for every router
    assert all(abs(after[k] - cap) <= abs(before[k] - cap) + 0.02 for k in after)
    _, cfg = load_model(out)
    assert list(cfg.causal_thresholds) == list(res["thresholds"].values())
    assert main(["eval", str(out), "--data", str(corpus)]) == 0
    assert "causal take-rate" in capsys.readouterr().out
    assert main(["calibrate", str(run / "checkpoint"), "--out", str(out)]) == 2  # not empty


def test_a_calibrated_model_is_priced_as_the_same_model_uncalibrated():
    """Thresholds move causal decisions, not the top-k forward: the FLOPs and the dense twin
    they are compared with are the uncalibrated model's (the twin has no routers, so no
    thresholds)."""
    cfg = tiny_config(causal_thresholds=(0.1, -0.2, 0.3))
    plain = dataclasses.replace(cfg, causal_thresholds=())
    assert cfg.dense_twin() == plain.dense_twin() and cfg.dense_twin().causal_thresholds == ()
    assert estimate_flops(cfg, 32).to_dict() == estimate_flops(plain, 32).to_dict()
    random = tiny_config(router_scores="random", random_take_rates="0.1,0.2,0.3")
    assert random.dense_twin() == plain.dense_twin()  # nor random routing's rates
    assert estimate_flops(random, 32).dense.to_dict() == estimate_flops(plain, 32).dense.to_dict()
