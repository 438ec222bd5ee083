"""The probes against oracles. The copy probe: a model that cannot copy scores exactly 0, a
hand-made perfect copier scores ln V less its floor, and the routers' take-rates on each copy are
those of the forward's routes. Attention reach: with every query zeroed, attention is uniform
over what each query may see, so its reach is a count over the masks (a slow loop)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import V, make_model, tiny_config
from recursion_helpers import CASES, IDS, mor_config

from mixture_of_depths.model import MoDOutput
from mixture_of_depths.probes import (
    attention_reach,
    attention_weights,
    copy_probe,
    copy_tokens,
    format_copy_probe,
    format_reach,
)
from mixture_of_depths.routing import calibrate_predictors


class Copier(torch.nn.Module):
    """Predicts, at every position of the second copy, the token after the earlier occurrence of
    the current one (what an induction head does), with logit `sharp` on it; uniform elsewhere."""

    def __init__(self, half: int, sharp: float) -> None:
        super().__init__()
        self.config = tiny_config()
        self.half, self.sharp = half, sharp
        self.w = torch.nn.Parameter(torch.zeros(()))  # a device for the probe to read

    def forward(self, idx: torch.Tensor, routing: str = "causal") -> MoDOutput:
        B, T = idx.shape
        logits = torch.zeros(B, T, V, dtype=torch.float64)
        for t in range(self.half, T - 1):  # token t+1 repeats token t+1-half
            logits[torch.arange(B), t, idx[:, t + 1 - self.half]] = self.sharp
        return MoDOutput(logits=logits, aux_loss=None, routes=[])


def test_copy_tokens_repeat_a_random_sequence():
    x = copy_tokens(V, 3, 10, seed=5)
    assert x.shape == (3, 20) and torch.equal(x[:, :10], x[:, 10:])
    assert torch.equal(x, copy_tokens(V, 3, 10, seed=5))  # a fixed generator
    assert not torch.equal(x, copy_tokens(V, 3, 10, seed=6))


def test_a_model_that_cannot_copy_scores_zero():
    model = make_model(tiny_config())
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0: each loss is exactly ln V
        if model.lm_head.bias is not None:
            model.lm_head.bias.zero_()
    probe = copy_probe(model, rows=2, length=32)
    assert probe["loss_first"] == pytest.approx(math.log(V), rel=1e-6)
    assert probe["loss_second"] == pytest.approx(math.log(V), rel=1e-6)
    assert abs(probe["score"]) < 1e-6


def test_a_perfect_copier_scores_the_whole_first_copy_loss():
    half, sharp = 16, 30.0
    probe = copy_probe(Copier(half, sharp), rows=3, length=2 * half)
    floor = math.log(1 + (V - 1) * math.exp(-sharp))  # the loss of a logit `sharp` above the rest
    assert probe["loss_first"] == pytest.approx(math.log(V), rel=1e-9)
    assert probe["loss_second"] == pytest.approx(floor, rel=1e-6)  # the seam is not counted
    assert probe["score"] == pytest.approx(math.log(V) - floor, rel=1e-9)


@pytest.mark.parametrize("routing", ["causal", "topk"])
def test_take_rates_are_those_of_the_routes(routing):
    model = make_model(tiny_config(routing="staggered"))
    probe = copy_probe(model, rows=2, length=40, routing=routing)
    with torch.no_grad():
        routes = model(copy_tokens(V, 2, 20), routing=routing).routes
    assert list(probe["take_first"]) == [r.name for r in routes]
    for r in routes:
        assert probe["take_first"][r.name] == pytest.approx(float(r.mask[:, :20].float().mean()))
        assert probe["take_second"][r.name] == pytest.approx(float(r.mask[:, 20:].float().mean()))
    assert "take-rate first->second copy" in format_copy_probe(probe)


def test_the_probe_leaves_the_model_as_it_was_and_checks_its_length():
    model = make_model(tiny_config()).train()
    copy_probe(model, rows=1, length=8)
    assert model.training
    with pytest.raises(ValueError, match="copy probe length"):
        copy_probe(model, length=model.config.max_seq_len + 2)


# -- attention reach ------------------------------------------------------------------------------
def _uniform_queries(model) -> None:  # noqa: ANN001
    """Zero every query projection: each query then spreads its weight evenly over the keys it
    may see, so the reach is a count over the mask alone (the oracle below)."""
    with torch.no_grad():
        for block in model.blocks:
            attn = block.attn
            attn.wqkv.weight[: attn.n_heads * attn.head_dim] = 0.0


def _uniform_reach(sees, far: int) -> tuple[float, float]:  # noqa: ANN001
    """Mean distance back and far share of uniform attention, averaged over the queries of
    `sees`: (query place, the places of the keys it sees), a slow loop."""
    dist, share = [], []
    for i, keys in sees:
        dist.append(sum(i - j for j in keys) / len(keys))
        share.append(sum(i - j >= far for j in keys) / len(keys))
    return sum(dist) / len(dist), sum(share) / len(share)


@pytest.mark.parametrize(
    "over",
    [dict(layer_pattern="D"), dict(), dict(skipped_kv="residual"), dict(routing="mlp"),
     dict(routing="mlp_kv")],
    ids=["dense", "isolated", "residual", "mlp-only", "mlp-kv"],
)  # fmt: skip
def test_attention_reach_of_uniform_attention_is_a_count_over_what_each_query_sees(over):
    far, T = 8, 40
    model = make_model(tiny_config(**over))
    _uniform_queries(model)
    idx = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(0))
    if model.config.has_predictor and not model.config.is_dense:
        calibrate_predictors(model, idx, 0.5)  # about half the tokens take each routed block
    reach = attention_reach(model, idx, far=far)
    assert all("attend" not in b.attn.__dict__ for b in model.blocks)  # the model is as it was
    out = model(idx, routing="causal")
    routes = {r.layer: r.mask for r in out.routes if r.kind in ("block", "mlp_kv")}
    keyed = model.config.routing == "mlp_kv"
    assert [r["layer"] for r in reach] == list(range(len(model.blocks)))  # every call, in order
    for r in reach:
        take = routes.get(r["layer"])
        sees = []
        for b in range(idx.shape[0]):
            for i in range(far, T):
                if take is None:
                    keys = list(range(i + 1))
                elif keyed:  # every query reads the takers up to it; with none, no update
                    keys = [j for j in range(i + 1) if take[b, j]]
                elif not take[b, i]:
                    continue  # a skipper's output is discarded: not averaged
                else:
                    isolated = model.config.skipped_kv == "none"
                    keys = [j for j in range(i + 1) if not isolated or take[b, j] or j == i]
                if keys:
                    sees.append((i, keys))
        dist, share = _uniform_reach(sees, far)
        assert r["routed"] == (take is not None) and r["queries"] == len(sees)
        assert r["mean_distance"] == pytest.approx(dist, abs=1e-9)
        assert r["far_share"] == pytest.approx(share, abs=1e-9)
        assert r["far_share_heads"] == pytest.approx([share] * model.config.n_heads, abs=1e-9)


def _capture(model):  # noqa: ANN001, ANN202
    """Record every attention call's queries, keys, values and mask (the model is unchanged)."""
    calls = []
    for block in model.blocks:

        def record(q, k, v, attn_mask, _attend=block.attn.attend):  # noqa: ANN001, ANN202
            calls.append((q, k, v, attn_mask))
            return _attend(q, k, v, attn_mask)

        block.attn.attend = record
    return calls


@pytest.mark.parametrize(
    "config", [tiny_config(), tiny_config(skipped_kv="residual"), mor_config(),
               mor_config(recursion_kv="share"), tiny_config(routing="mlp_kv")],
    ids=["isolated", "residual", "mor", "mor-share", "mlp-kv"],
)  # fmt: skip
def test_attention_weights_are_those_sdpa_computed(config):
    """On random weights, the weights the reach is computed from, times the values, give what
    SDPA gave on the same call (grouped key heads, causal and isolation masks included)."""
    model = make_model(config)
    idx = torch.randint(0, V, (2, 37), generator=torch.Generator().manual_seed(2))
    calls = _capture(model)
    model(idx, routing="causal")
    assert len(calls) == len(config.layer_schedule)
    for q, k, v, mask in calls:
        if q.shape[-2] != idx.shape[1] or k.shape[-2] != idx.shape[1]:
            continue
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True
        )
        for b in range(idx.shape[0]):
            p = attention_weights(q[b], k[b], None if mask is None else mask[b, 0])
            vals = v[b].repeat_interleave(q.shape[1] // v.shape[1], dim=0).double()
            torch.testing.assert_close(p @ vals, want[b].double(), rtol=0, atol=1e-10)


@pytest.mark.parametrize("over", CASES, ids=IDS)
def test_attention_reach_of_a_recursive_model_counts_each_steps_takers(over):
    far, T = 8, 40
    model = make_model(mor_config(**over))
    _uniform_queries(model)
    idx = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(3))
    if model.config.recursion_router == "expert" and model.config.has_predictor:
        calibrate_predictors(model, idx, 0.5)
    cfg = model.config
    steps = {r.layer: r.mask for r in model(idx, routing="causal").routes}
    reach = attention_reach(model, idx, far=far)
    assert [(r["layer"], r["call"]) for r in reach] == [
        (layer, [x for x, _ in cfg.layer_schedule[:n]].count(layer))
        for n, (layer, _) in enumerate(cfg.layer_schedule)
    ]
    for r in reach:
        take = steps.get(r["call"]) if r["layer"] in cfg.recursion_layers[1] else None
        sees = []
        for b in range(idx.shape[0]):
            for i in range(far, T):
                if take is not None and not take[b, i]:
                    continue
                isolated = take is not None and cfg.recursion_kv == "recursion"
                keys = [j for j in range(i + 1) if not isolated or take[b, j] or j == i]
                sees.append((i, keys))
        assert r["routed"] == (take is not None) and r["queries"] == len(sees)
        if sees:
            dist, share = _uniform_reach(sees, far)
            assert r["mean_distance"] == pytest.approx(dist, abs=1e-9)
            assert r["far_share"] == pytest.approx(share, abs=1e-9)


def test_attention_reach_restores_what_it_shadows_even_when_the_forward_fails():
    model = make_model(tiny_config())
    mine = model.blocks[0].attn.attend
    model.blocks[0].attn.attend = mine  # someone else's instance attribute, kept
    with pytest.raises(ValueError, match="out of range"):
        attention_reach(model, torch.full((1, 20), V + 5))  # ids beyond the vocabulary
    assert model.blocks[0].attn.__dict__["attend"] is mine
    assert all("attend" not in b.attn.__dict__ for b in model.blocks[1:])


def test_attention_reach_leaves_out_calls_on_gathered_tokens():
    model = make_model(tiny_config())
    idx = torch.randint(0, V, (2, 30), generator=torch.Generator().manual_seed(1))
    topk = attention_reach(model, idx, far=4, routing="topk")
    assert [r["layer"] for r in topk] == [i for i, b in enumerate(model.blocks) if not b.routed]
    assert "L1 " in format_reach(topk, far=4) and "places back" in format_reach(topk, far=4)
