"""`MoDTransformer`'s losses, gradients and inputs against oracles: which parameters each loss
trains, the aux targets per row, rows independent of each other, random routing compute-matched.

No golden numbers: every expected value is recomputed here.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from helpers import V
from model_helpers import STRICT, T, make_model, tokens
from reference import topk_set

from mixture_of_depths import MoDConfig, MoDTransformer, capacity_tokens
from mixture_of_depths.config import ROUTE_KINDS

MODES = ["joint", "staggered", "mlp", "mlp_kv"]  # config.ROUTING_MODES

# -- gradients ----------------------------------------------------------------------------------


def _lm_loss64(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("gate", ["raw", "sigmoid"])
@pytest.mark.parametrize("mode", MODES)
def test_router_learns_from_lm_loss_alone(mode, gate):
    """Top-k mode, aux_loss_weight=0: the LM loss reaches every router through g(r), correctly.

    The gradient is checked against a central finite difference along a random direction (top-k
    selection is piecewise constant, so a small step does not change it).
    """
    model = make_model(routing=mode, router_gate=gate, aux_loss_weight=0.0)
    idx, targets = tokens(seed=1), tokens(seed=2)
    out = model(idx, targets=targets)
    torch.testing.assert_close(out.loss, out.lm_loss, rtol=0, atol=0)
    out.loss.backward()
    routers = [lin.weight for b in model.blocks if b.routed for lin in b.router.values()]
    assert routers and all(w.grad is not None and w.grad.abs().sum() > 0 for w in routers)

    model.zero_grad()
    _lm_loss64(model(idx).logits, targets).backward()
    g = torch.Generator().manual_seed(9)
    # Central differences in float64: truncation error ~eps^2, round-off ~1e-16/eps.
    eps = 1e-5
    for w in routers:
        direction = torch.randn(w.shape, generator=g, dtype=w.dtype)
        analytic = float((w.grad * direction).sum())
        with torch.no_grad():
            w.add_(eps * direction)
            plus = float(_lm_loss64(model(idx).logits, targets))
            w.sub_(2 * eps * direction)
            minus = float(_lm_loss64(model(idx).logits, targets))
            w.add_(eps * direction)
        assert analytic == pytest.approx((plus - minus) / (2 * eps), rel=1e-5, abs=1e-9)


def test_aux_loss_trains_the_router():
    model = make_model(causal_router="aux_loss")
    out = model(tokens(), targets=tokens(seed=2))
    routers = [lin.weight for b in model.blocks if b.routed for lin in b.router.values()]
    grads = torch.autograd.grad(out.aux_loss, routers)
    assert all(g.abs().sum() > 0 for g in grads)


def test_predictor_is_behind_a_stop_gradient():
    model = make_model(causal_router="predictor", routing="staggered", aux_loss_weight=0.5)
    idx, targets = tokens(seed=1), tokens(seed=2)
    pred_params = [(n, p) for n, p in model.named_parameters() if ".predictor." in n]
    other = [(n, p) for n, p in model.named_parameters() if ".predictor." not in n]
    assert pred_params

    out = model(idx, targets=targets, routing="topk")
    lm_grads = torch.autograd.grad(
        out.lm_loss, [p for _, p in model.named_parameters()], retain_graph=True, allow_unused=True
    )
    by_name = dict(zip([n for n, _ in model.named_parameters()], lm_grads, strict=True))
    assert all(by_name[n] is None or not by_name[n].any() for n, _ in pred_params)

    aux_grads = torch.autograd.grad(
        out.aux_loss, [p for _, p in other], retain_graph=True, allow_unused=True
    )
    assert all(g is None or not g.any() for g in aux_grads)
    aux_pred = torch.autograd.grad(out.aux_loss, [p for _, p in pred_params], retain_graph=True)
    assert all(g.abs().sum() > 0 for g in aux_pred)

    # The full loss gives every non-predictor parameter exactly its LM gradient.
    out.loss.backward()
    for n, p in other:
        expected = by_name[n] if by_name[n] is not None else torch.zeros_like(p)
        assert torch.equal(p.grad, expected), n

    # The predictor's weights do not change the LM loss or the logits (top-k mode).
    with torch.no_grad():
        for _, p in pred_params:
            p.add_(torch.randn_like(p))
    out2 = model(idx, targets=targets, routing="topk")
    assert torch.equal(out2.logits, out.logits) and torch.equal(out2.lm_loss, out.lm_loss)
    assert not torch.equal(out2.aux_loss, out.aux_loss)


def test_predictor_presence_does_not_change_the_lm():
    """Same shared weights with and without predictors: same logits, LM loss and LM gradients."""
    with_pred = make_model(causal_router="predictor")
    without = make_model(causal_router="aux_loss")
    without.load_state_dict(with_pred.state_dict(), strict=False)
    idx, targets = tokens(seed=1), tokens(seed=2)
    a, b = (m(idx, targets=targets, routing="topk") for m in (with_pred, without))
    assert torch.equal(a.logits, b.logits) and torch.equal(a.lm_loss, b.lm_loss)
    a.lm_loss.backward()
    b.lm_loss.backward()
    grads_b = dict(without.named_parameters())
    for n, p in with_pred.named_parameters():
        if ".predictor." not in n:
            assert torch.equal(p.grad, grads_b[n].grad), n


# -- aux targets and losses ---------------------------------------------------------------------


def _bce_by_hand(z: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    z, t = z.double(), target.double()
    p = 1 / (1 + torch.exp(-z))
    return -(t * torch.log(p) + (1 - t) * torch.log(1 - p)).mean()


@pytest.mark.parametrize("causal_router", ["aux_loss", "predictor"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("routing", ["topk", "causal"])
def test_aux_targets_and_loss_per_row(routing, mode, causal_router):
    model = make_model(routing=mode, causal_router=causal_router, dtype=torch.float32)
    idx = tokens(5, T, seed=11)
    out = model(idx, routing=routing)
    k = capacity_tokens(0.3, T)
    losses = []
    for r in out.routes:
        for b in range(idx.shape[0]):
            expected = torch.zeros(T, dtype=torch.bool)
            expected[topk_set(r.logits[b].tolist(), k)] = True
            assert torch.equal(r.target[b], expected), (r.layer, r.kind, b)
        assert (r.target.sum(1) == k).all()  # every row has its own k positives
        z = r.predictor_logits if causal_router == "predictor" else r.logits
        assert (r.predictor_logits is not None) == (causal_router == "predictor")
        losses.append(_bce_by_hand(z, r.target))
    expected_aux = torch.stack(losses).mean()
    torch.testing.assert_close(out.aux_loss.double(), expected_aux, rtol=1e-5, atol=1e-6)


def test_loss_is_lm_plus_weighted_aux():
    model = make_model(aux_loss_weight=0.37, dtype=torch.float32)
    idx, targets = tokens(seed=1), tokens(seed=2)
    targets[0, :5] = -100
    targets[2, -3:] = -100
    out = model(idx, targets=targets)
    logits = out.logits.double()
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    keep = targets != -100
    nll = -logp[keep].gather(-1, targets[keep].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out.lm_loss.double(), nll.mean(), rtol=1e-5, atol=1e-6)
    assert out.aux_loss > 0
    torch.testing.assert_close(out.loss, out.lm_loss + 0.37 * out.aux_loss)
    no_targets = model(idx)
    assert no_targets.loss is None and no_targets.lm_loss is None
    assert torch.equal(no_targets.aux_loss, out.aux_loss)


def test_dense_model_has_zero_aux_loss():
    model = make_model(layer_pattern="D", dtype=torch.float32)
    idx = tokens()
    out = model(idx, targets=idx)
    assert out.aux_loss == 0 and out.routes == []
    assert torch.equal(out.loss, out.lm_loss)


# -- inputs, batching, structure ----------------------------------------------------------------


@pytest.mark.parametrize(
    "idx, routing, needle",
    [
        (torch.tensor([[1, 2, -1]]), "topk", "-1"),
        (torch.tensor([[1, V, 2]]), "topk", str(V)),
        (torch.tensor([[1, 2, V + 7]]), "causal", str(V + 7)),
        (torch.zeros(1, 129, dtype=torch.long), "topk", "129"),
        (torch.zeros(1, 4), "topk", "float32"),
        (torch.zeros(1, 4, dtype=torch.bool), "topk", "bool"),
        (torch.zeros(4, dtype=torch.long), "topk", "(4,)"),
        (torch.zeros(2, 3, 4, dtype=torch.long), "topk", "(2, 3, 4)"),
        (torch.zeros(1, 4, dtype=torch.long), "top-k", "'top-k'"),
        (torch.zeros(1, 4, dtype=torch.long), "dense", "'dense'"),
    ],
)
def test_bad_input_raises_value_error_naming_the_value(idx, routing, needle):
    model = make_model(dtype=torch.float32)
    with pytest.raises(ValueError) as err:
        model(idx, routing=routing)
    assert needle in str(err.value)


def test_bad_targets_shape_raises():
    model = make_model(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"\(1, 5\)"):
        model(torch.zeros(1, 4, dtype=torch.long), targets=torch.zeros(1, 5, dtype=torch.long))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("routing", ["topk", "causal"])
def test_rows_are_independent(routing, mode):
    model = make_model(routing=mode, causal_router="predictor")
    idx = tokens(4, T, seed=6)
    out = model(idx, routing=routing)
    for b in range(idx.shape[0]):
        alone = model(idx[b : b + 1], routing=routing)
        torch.testing.assert_close(alone.logits[0], out.logits[b], **STRICT)
        for r, ra in zip(out.routes, alone.routes, strict=True):
            assert torch.equal(ra.mask[0], r.mask[b]) and torch.equal(ra.target[0], r.target[b])


@pytest.mark.parametrize("causal_router", ["aux_loss", "predictor"])
@pytest.mark.parametrize("mode", MODES)
def test_routers_and_predictors_are_found_by_name(mode, causal_router):
    model = make_model(routing=mode, causal_router=causal_router, layer_pattern="DR")
    kinds = ROUTE_KINDS[mode]
    names = {n for n, _ in model.named_modules()}
    want = {f"blocks.{i}.router.{k}" for i in (1, 3) for k in kinds}
    assert {n for n in names if ".router." in n} == want
    want_pred = {f"blocks.{i}.predictor.{k}" for i in (1, 3) for k in kinds}
    preds = {n for n in names if ".predictor." in n and n.count(".") == 3}
    assert preds == (want_pred if causal_router == "predictor" else set())


def test_forward_leaves_no_state_on_the_modules():
    model = make_model(dtype=torch.float32)
    before = {n: set(vars(m)) for n, m in model.named_modules()}
    model(tokens(), targets=tokens(seed=1))
    model(tokens(), routing="causal")
    assert {n: set(vars(m)) for n, m in model.named_modules()} == before


def test_routers_run_in_float32_under_bf16_autocast():
    """Routing compares logits with each other and with 0: bf16 rounding would flip decisions
    between autocast training and plain-precision generation."""
    cfg = MoDConfig(
        d_model=32,
        n_layers=2,
        n_heads=2,
        max_seq_len=32,
        causal_router="predictor",
        predictor_hidden=8,
    )
    model = MoDTransformer(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(idx, idx)
    assert out.logits.dtype == torch.bfloat16  # the rest does run in bf16
    for r in out.routes:
        assert r.logits.dtype == torch.float32 and r.predictor_logits.dtype == torch.float32


def test_random_routing_ablation_is_topk_on_noise_with_unit_gate():
    """router_scores="random": exactly k tokens per row, chosen by noise, gate 1. At capacity 1.0
    every token takes every block, so the model equals its dense twin with the same weights."""
    cfg = MoDConfig(
        d_model=32,
        n_layers=2,
        n_heads=2,
        max_seq_len=32,
        layer_pattern="R",
        router_scores="random",
        capacity=1.0,
    )
    model = MoDTransformer(cfg).double()
    dense = MoDTransformer(cfg.dense_twin()).double()
    dense.load_state_dict(model.state_dict(), strict=False)
    idx = torch.randint(0, cfg.vocab_size, (2, 20))
    torch.testing.assert_close(model(idx).logits, dense(idx).logits, rtol=0, atol=1e-12)
    half = MoDTransformer(dataclasses.replace(cfg, capacity=0.5))
    torch.manual_seed(0)
    masks_a = [r.mask for r in half(idx).routes]
    torch.manual_seed(1)
    masks_b = [r.mask for r in half(idx).routes]
    assert all((m.sum(1) == 10).all() for m in masks_a)
    assert any(not torch.equal(a, b) for a, b in zip(masks_a, masks_b, strict=True))


def test_random_routing_is_compute_matched_in_causal_mode():
    """The causal decision of random routing takes each token with probability `capacity` (or a
    router's own `random_take_rates`), not the 50% of noise > 0: the share over 32k tokens is
    within 6 standard errors of it, per router."""
    base = dict(d_model=16, n_layers=4, n_heads=2, max_seq_len=256, layer_pattern="DR",
                router_scores="random")  # fmt: skip
    idx = torch.randint(0, 257, (128, 256), generator=torch.Generator().manual_seed(0))
    for extra, want in (
        (dict(capacity=0.125), [0.125, 0.125]),
        (dict(capacity=0.125, random_take_rates="0.05,0.3"), [0.05, 0.3]),
        (dict(capacity=0.25, routing="staggered", random_take_rates=[0.1, 0.2, 0.4, 0.6]),
         [0.1, 0.2, 0.4, 0.6]),
        (dict(capacity=0.25, routing="mlp", random_take_rates="0.05,0.3"), [0.05, 0.3]),
    ):  # fmt: skip
        model = MoDTransformer(MoDConfig(**base, **extra)).eval()
        torch.manual_seed(0)
        with torch.no_grad():
            routes = model(idx, routing="causal").routes
        n = idx.numel()
        for r, p in zip(routes, want, strict=True):
            assert abs(r.mask.double().mean().item() - p) < 6 * (p * (1 - p) / n) ** 0.5, r.name
        with torch.no_grad():  # top-k still takes exactly k per row
            topk = model(idx[:2], routing="topk").routes
        assert all((r.mask.sum(1) == model.config.capacity_tokens(256)).all() for r in topk)
    with pytest.raises(ValueError, match="give 2 rates strictly between 0 and 1"):
        MoDConfig(**base, random_take_rates="0.1")
    with pytest.raises(ValueError, match="give 2 rates"):
        MoDConfig(**base, random_take_rates="0.1,1.5")
    with pytest.raises(ValueError, match="give 2 rates"):  # routing="mlp": one router a layer
        MoDConfig(**base, routing="mlp", random_take_rates="0.1,0.2,0.3,0.4")
    with pytest.raises(ValueError, match="needs router_scores='random'"):
        MoDConfig(**{**base, "router_scores": "learned"}, random_take_rates="0.1,0.2")
    # Random scores carry no predictor whatever causal_router says: the noise decides in both.
    masks = {}
    for router in ("predictor", "aux_loss"):
        cfg = MoDConfig(**base, causal_router=router, random_take_rates="0.1,0.2")
        model = MoDTransformer(cfg).eval()
        assert not cfg.has_predictor
        assert not any("predictor" in name for name, _ in model.named_parameters())
        torch.manual_seed(3)
        with torch.no_grad():
            masks[router] = [r.mask for r in model(idx[:4], routing="causal").routes]
    assert all(map(torch.equal, masks["predictor"], masks["aux_loss"]))


def test_stopgrad_gate_is_sigmoid_forward_and_leaves_the_router_to_its_aux_loss():
    """router_gate="sigmoid_stopgrad": the same forward as "sigmoid"; the LM loss sends the router
    no gradient, so its gradient is exactly that of the aux loss alone."""
    sig = make_model(router_gate="sigmoid", causal_router="aux_loss")
    stop = make_model(router_gate="sigmoid_stopgrad", causal_router="aux_loss")
    idx, targets = tokens(seed=1), tokens(seed=2)
    for routing in ("topk", "causal"):
        assert torch.equal(sig(idx, routing=routing).logits, stop(idx, routing=routing).logits)
    out = stop(idx, targets=targets)
    out.loss.backward()
    routers = [lin.weight for b in stop.blocks if b.routed for lin in b.router.values()]
    got = [w.grad.clone() for w in routers]
    stop.zero_grad()
    (stop.config.aux_loss_weight * stop(idx, targets=targets).aux_loss).backward()
    for g, w in zip(got, routers, strict=True):
        assert g.abs().sum() > 0
        torch.testing.assert_close(g, w.grad, rtol=1e-12, atol=1e-15)
