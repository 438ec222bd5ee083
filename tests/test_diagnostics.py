"""The routing diagnostics a trainer logs at each evaluation (`routing_diag` in metrics.jsonl),
against direct computations on the routes of a forward pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import make_model, random_tokens, tiny_config

from mixture_of_depths.routing import decision_flips, routing_diagnostics
from mixture_of_depths.train import pack_masks, unpack_masks


@pytest.mark.parametrize("routing", ["joint", "staggered"])
def test_diagnostics_are_the_statistics_of_the_routes(routing):
    model = make_model(tiny_config(routing=routing))
    x = random_tokens(3, 40, seed=1)
    with torch.no_grad():
        topk, causal = model(x, routing="topk").routes, model(x, routing="causal").routes
    stats, masks = routing_diagnostics(model.config, topk, causal)
    assert list(stats) == [r.name for r in topk]
    k = model.config.capacity_tokens(40)
    for t, c in zip(topk, causal, strict=True):
        row, r = stats[t.name], t.logits.double()
        assert row["r_mean"] == pytest.approx(float(r.mean()), rel=1e-12)
        want = np.percentile(r.flatten().numpy(), [5, 50, 95])  # numpy's own, linear
        got = [row["r_p05"], row["r_p50"], row["r_p95"]]
        assert got == pytest.approx(want.tolist(), rel=1e-12, abs=1e-15)
        chosen = torch.sigmoid(r[t.mask])
        assert row["gate_chosen_mean"] == pytest.approx(float(chosen.mean()), rel=1e-12)
        want = np.percentile(chosen.numpy(), [10, 50, 90])
        got = [row["gate_chosen_p10"], row["gate_chosen_p50"], row["gate_chosen_p90"]]
        assert got == pytest.approx(want.tolist(), rel=1e-12)
        boundary = sorted(r[0].tolist(), reverse=True)[k - 1]  # row 0's k-th largest weight
        rows = [sorted(r[b].tolist(), reverse=True)[k - 1] for b in range(3)]
        assert boundary in rows and row["topk_boundary"] == pytest.approx(sum(rows) / 3)
        assert row["causal_take_rate"] == pytest.approx(float(c.mask.double().mean()))
        assert torch.equal(masks[f"{t.name}/topk"], t.mask) and torch.equal(
            masks[f"{c.name}/causal"], c.mask
        )
    assert all(v == 0 for v in decision_flips(masks, masks).values())
    other = {key: m.clone() for key, m in masks.items()}
    name = f"{topk[0].name}/topk"
    other[name][0, :5] = ~other[name][0, :5]  # flip 5 of 120 decisions
    flips = decision_flips(masks, other)
    assert flips[name] == pytest.approx(5 / 120) and sum(flips.values()) == pytest.approx(5 / 120)


def test_packed_masks_round_trip():
    g = torch.Generator().manual_seed(0)
    for shape in [(1, 1), (3, 7), (8, 256), (2, 9)]:
        m = {
            "a/topk": torch.rand(shape, generator=g) < 0.3,
            "b": torch.ones(shape, dtype=torch.bool),
        }
        back = unpack_masks(pack_masks(m))
        assert all(torch.equal(back[key], m[key]) for key in m)
