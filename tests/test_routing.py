"""routing.py against oracles: per-row top-k against the loop rule, predictor calibration against
the share it promises, and the layer-kind table against the config's letters."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import make_model as _make_model
from helpers import random_tokens, tiny_config
from reference import topk_set

from mixture_of_depths import BLOCKS, MoDTransformer, routing_accuracy, routing_scores
from mixture_of_depths.config import LAYER_KINDS
from mixture_of_depths.routing import Route, calibrate_predictors, topk_indices, topk_mask
from mixture_of_depths.train import evaluate


def test_topk_mask_per_row_k_over_valid_tokens_matches_the_loop_rule():
    """Right-padded rows of different lengths, many ties: each row's mask is the loop rule's top-k
    of its own valid tokens (ties to the earlier position), never a padding token."""
    g = torch.Generator().manual_seed(3)
    r = torch.randint(0, 5, (6, 19), generator=g).double()  # many ties
    lens = torch.tensor([19, 1, 7, 12, 19, 4])
    valid = torch.arange(19)[None, :] < lens[:, None]
    for k_of in (lambda n: n // 3, lambda n: n, lambda n: 0):
        k = torch.tensor([k_of(int(n)) for n in lens])
        got = topk_mask(r, k, valid)
        for b, n in enumerate(lens.tolist()):
            want = torch.zeros(19, dtype=torch.bool)
            want[topk_set(r[b, :n].tolist(), int(k[b]))] = True
            assert torch.equal(got[b], want), (b, got[b], want)


def test_topk_mask_agrees_with_topk_indices_when_rows_are_full():
    g = torch.Generator().manual_seed(4)
    r = torch.randint(0, 3, (4, 16), generator=g).float()
    for k in (0, 1, 5, 16):
        idx = topk_indices(r, k)
        full = torch.zeros(4, 16, dtype=torch.bool).scatter(1, idx, True)
        got = topk_mask(r, torch.full((4,), k), torch.ones(4, 16, dtype=torch.bool))
        assert torch.equal(got, full)


@pytest.mark.parametrize("routing", ["joint", "staggered", "mlp_kv"])
@pytest.mark.parametrize("take", [0.125, 0.5])
def test_calibrated_predictors_take_the_asked_share_with_a_margin(routing, take):
    """After calibration each router's take-rate on the calibration batch is the asked share (up
    to the ties it had to step around), and no token's logit sits on the threshold."""
    cfg = tiny_config(routing=routing, causal_router="predictor")
    model = _make_model(cfg, seed=2, dtype=torch.float32, take=0.5)  # calibrated once already
    idx = random_tokens(4, 40, seed=5)
    rates = calibrate_predictors(model, idx, take)
    routes = model(idx, routing="causal").routes
    assert rates == [r.mask.float().mean().item() for r in routes]
    for r in routes:
        assert abs(r.mask.float().mean().item() - take) < 0.1, (r.name, rates)
        assert float(r.predictor_logits.detach().abs().min()) > 1e-6


def test_calibration_refuses_what_it_cannot_do():
    aux = MoDTransformer(tiny_config(causal_router="aux_loss"))
    with pytest.raises(ValueError, match="predictor"):
        calibrate_predictors(aux, random_tokens(1, 8, 0), 0.5)
    pred = MoDTransformer(tiny_config(causal_router="predictor"))
    with pytest.raises(ValueError, match="take"):
        calibrate_predictors(pred, random_tokens(1, 8, 0), 1.0)
    # One token repeated: every logit of the first router is equal, no gap to cut in.
    with pytest.raises(ValueError, match="no gap"):
        calibrate_predictors(pred, torch.full((2, 12), 7), 0.5)


def test_every_layer_letter_has_a_block_class_and_a_cost():
    """The table is the one place a kind is added: the config's letters and the block classes
    agree, and each class prices its work (top-k forward of 10 tokens at capacity 0.3: the dense
    kind runs all 10, the routed kind 3 and scores all 10)."""
    assert set(BLOCKS) == set(LAYER_KINDS)
    cfg = tiny_config()
    dense, routed = BLOCKS["D"].cost(cfg, 10), BLOCKS["R"].cost(cfg, 10)
    assert (dense.attn_tokens, routed.attn_tokens) == (10, 3)
    assert dense.router == 0 and routed.router == 10 * 2 * cfg.d_model
    assert routed.matmul == pytest.approx(dense.matmul * 3 / 10)
    model = MoDTransformer(cfg)
    assert [type(b) for b in model.blocks] == [BLOCKS[k] for k in cfg.layer_kinds]


def _route(take: list[list[int]], target: list[list[int]], name_layer: int = 1) -> Route:
    """A hand-built route whose causal decisions are `take` (logit +1 or -1) and top-k set
    `target`."""
    logits = torch.tensor(take, dtype=torch.float64) * 2 - 1
    return Route(name_layer, "block", logits > 0, logits, torch.tensor(target, dtype=torch.bool))


def test_routing_scores_count_the_top_k_set_by_hand():
    """Two rows of 8, top-k sets of 2: 3 of the 4 top-k tokens taken (one missed), 2 taken
    outside them: recall 3/4, precision 3/5, specificity 10/12, the paper's accuracy 13/16."""
    target = [[1, 1, 0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 0, 0, 0]]
    take = [[1, 0, 1, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 0, 1, 0]]
    got = routing_scores([_route(take, target)])["1"]
    want = dict(recall=3 / 4, precision=3 / 5, balanced_accuracy=(3 / 4 + 10 / 12) / 2,
                take_rate=5 / 16, accuracy=13 / 16)  # fmt: skip
    assert got == pytest.approx(want)
    assert routing_accuracy([_route(take, target)]) == {"1": pytest.approx(13 / 16)}


def test_a_router_that_never_fires_scores_recall_zero_whatever_its_accuracy():
    """12.5% positives: never firing is 87.5% "accurate" (the paper's measure), recall 0,
    precision undefined (NaN, null in JSON), balanced accuracy 0.5 (a coin's)."""
    target = [[1] + [0] * 7] * 4
    got = routing_scores([_route([[0] * 8] * 4, target)])["1"]
    assert got["accuracy"] == 0.875 and got["recall"] == 0.0 and got["take_rate"] == 0.0
    assert got["balanced_accuracy"] == 0.5 and math.isnan(got["precision"])
    always = routing_scores([_route([[1] * 8] * 4, target)])["1"]
    assert always["recall"] == 1.0 and always["precision"] == 0.125
    assert always["balanced_accuracy"] == 0.5 and always["accuracy"] == 0.125


def test_evaluation_pools_the_scores_over_its_batches():
    """`train.evaluate` reports recall and precision from the counts of all its batches (and
    the paper's accuracy beside them), equal to `routing_scores` over the concatenated batch."""
    model = _make_model(tiny_config(), dtype=torch.float64).eval()
    x = random_tokens(4, 16, seed=5)
    ev = evaluate(model, [(x[:2], x[:2]), (x[2:], x[2:])], torch.device("cpu"))
    whole = routing_scores(model(x, routing="topk").routes)
    for name, sc in whole.items():
        assert ev["routing_recall"][name] == pytest.approx(sc["recall"], nan_ok=True)
        assert ev["routing_precision"][name] == pytest.approx(sc["precision"], nan_ok=True)
        assert ev["routing_accuracy"][name] == pytest.approx(sc["accuracy"])
