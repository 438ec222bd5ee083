"""Expert layers (MoE, staged and integrated MoDE) against slow loop references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import V, random_tokens, tiny_config
from helpers import make_model as _make_model

from mixture_of_depths import MoDConfig, MoDTransformer, generate
from mixture_of_depths.experts import (
    ExpertMLP,
    ExpertRoute,
    balance_loss,
    grouped_mm_supported,
    ran_real_expert,
    z_loss,
)
from mixture_of_depths.generate import generate_reference


def expert_layer(seed: int = 0, **kw) -> ExpertMLP:
    cfg = MoDConfig(vocab_size=V, d_model=16, n_heads=2, n_layers=1, d_ff=24, **kw)
    layer = ExpertMLP(cfg, 0).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            fan_in = p.shape[-2] if p.dim() == 3 else p.shape[-1]
            scale = 1.0 if p is layer.router.weight else fan_in**-0.5
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * scale)
    return layer


def reference(layer: ExpertMLP, x_BTD: torch.Tensor, drop: bool) -> torch.Tensor:
    """Per token, per chosen expert: the rules of docs/semantics.md ("Experts") as loops."""
    cfg = layer.cfg
    B, T, D = x_BTD.shape
    k, E = cfg.experts_per_token, cfg.n_experts
    choices = {}
    for b in range(B):
        for t in range(T):
            w = layer.router.weight.detach().double()
            logits = [float(v) for v in x_BTD[b, t].double() @ w.T]
            m = max(logits)
            z = sum(math.exp(v - m) for v in logits)
            probs = [math.exp(v - m) / z for v in logits]
            ranked = sorted(range(len(probs)), key=lambda i: (-probs[i], i))  # ties: lower index
            choices[b, t] = [(ranked[j], probs[ranked[j]]) for j in range(k)]
    kept = {key: [e < E for e, _ in c] for key, c in choices.items()}
    if drop and cfg.expert_capacity_factor is not None:
        cap = math.ceil(cfg.expert_capacity_factor * B * T * k / E)
        used = [0] * E
        for j in range(k):  # first choices first, then earlier positions, then lower rows
            for t in range(T):
                for b in range(B):
                    e = choices[b, t][j][0]
                    if e < E:
                        kept[b, t][j] = used[e] < cap
                        used[e] += 1
    y = torch.zeros_like(x_BTD)
    for (b, t), c in choices.items():
        for j, (e, p) in enumerate(c):
            if kept[b, t][j]:
                w13, w2 = layer.w13[e].detach(), layer.w2[e].detach()
                h = x_BTD[b, t] @ w13
                a, g = h[: cfg.d_ff_expert], h[cfg.d_ff_expert :]
                y[b, t] += p * ((F.silu(a) * g) @ w2)
    return y


@pytest.mark.parametrize(
    "kw",
    [
        dict(n_experts=4),
        dict(n_experts=4, experts_per_token=2),
        dict(n_experts=3, n_noop_experts=2),
        dict(n_experts=3, n_noop_experts=2, experts_per_token=2),
        dict(n_experts=4, expert_capacity_factor=0.5),
        dict(n_experts=4, experts_per_token=2, expert_capacity_factor=0.75, n_noop_experts=1),
    ],
    ids=["top1", "top2", "noop", "noop-top2", "drop", "drop-top2-noop"],
)
@pytest.mark.parametrize("drop", [False, True])
def test_expert_layer_equals_the_loop_reference(kw, drop):
    layer = expert_layer(**kw)
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y, route = layer(x, drop=drop)
    torch.testing.assert_close(y, reference(layer, x, drop), rtol=1e-12, atol=1e-12)
    assert route.experts.shape == (3, 7, layer.cfg.experts_per_token)
    if drop and kw.get("expert_capacity_factor"):
        assert route.dropped.any()  # the case really drops
    else:
        assert not route.dropped.any()
    # A no-op slot never runs, and it is not a drop.
    assert not (route.kept & ~route.real).any()


def test_a_noop_expert_adds_exactly_zero():
    layer = expert_layer(n_experts=2, n_noop_experts=2)
    with torch.no_grad():
        layer.router.weight[:2] = 0.0
        layer.router.weight[2:] = 0.0
        layer.router.weight[3, 0] = 50.0  # every token with x[0] > 0 picks no-op 3
    x = torch.randn(2, 9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    y, route = layer(x)
    noop = x[..., 0] > 0
    assert (route.experts[..., 0][noop] == 3).all()
    assert torch.equal(y[noop], torch.zeros_like(y[noop]))  # exactly zero, not tiny


def test_every_parameter_gets_a_gradient_whatever_the_tokens_chose():
    """A rank whose tokens all chose no-op experts still has (zero) gradients for the experts:
    FSDP2 reduce-scatters a unit's gradients as one buffer, so which parameters have one must
    not depend on the data, or the ranks' collectives mismatch and the job aborts."""
    layer = expert_layer(n_experts=2, n_noop_experts=2)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[3, 0] = 50.0  # a token with x[0] > 0 picks no-op 3
    x = torch.randn(2, 9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    has_grad = []
    for inp in (x, x.abs()):  # some tokens reach a real expert; none does
        layer.zero_grad(set_to_none=True)
        y, route = layer(inp)
        (y.sum() + route.logits.sum()).backward()
        has_grad.append({n for n, p in layer.named_parameters() if p.grad is not None})
    assert not route.kept.any()
    assert has_grad[0] == has_grad[1] == {n for n, _ in layer.named_parameters()}
    assert not layer.w13.grad.any() and not layer.w2.grad.any()
    with torch.no_grad():  # decoding: no gradient, nothing extra computed
        assert not layer(x.abs())[0].requires_grad


def test_one_expert_with_probability_one_is_the_dense_mlp():
    dense_cfg = tiny_config(layer_pattern="D")
    moe_cfg = tiny_config(layer_pattern="D", n_experts=1, d_ff_expert=dense_cfg.d_ff)
    dense = _make_model(dense_cfg)
    moe = MoDTransformer(moe_cfg).double().eval()
    sd = dense.state_dict()
    with torch.no_grad():
        for name, p in moe.named_parameters():
            if ".mlp.w13" in name:
                p.copy_(sd[name + ".weight"].T[None])
            elif ".mlp.w2" in name:
                p.copy_(sd[name + ".weight"].T[None])
            elif ".mlp.router" in name:
                p.normal_()  # any logits: softmax over one expert is exactly 1
            else:
                p.copy_(sd[name])
    idx = random_tokens(2, 40, seed=5)
    torch.testing.assert_close(moe(idx).logits, dense(idx).logits, rtol=1e-12, atol=1e-12)


def test_balance_and_z_loss_equal_their_formulas_on_a_hand_made_routing():
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0], [1.0, 1.0, 1.0]])
    experts = torch.tensor([[0], [1], [2], [0]])
    route = ExpertRoute(0, experts, None, None, None, logits, n_experts=2)  # expert 2: a no-op
    probs = logits.softmax(-1)
    f = torch.tensor([2 / 4, 1 / 4, 1 / 4])
    want = 3 * (f * probs.mean(0)).sum()
    torch.testing.assert_close(balance_loss(route), want)
    torch.testing.assert_close(z_loss(route), (logits.logsumexp(-1) ** 2).mean())
    uniform = ExpertRoute(0, torch.tensor([[0], [1], [2]]), None, None, None, torch.zeros(3, 3), 2)
    torch.testing.assert_close(balance_loss(uniform), torch.tensor(1.0))  # balanced: 1


VARIANTS = {
    "moe": dict(layer_pattern="D", n_experts=4),
    "staged": dict(layer_pattern="RDR", n_experts=4),
    "integrated": dict(layer_pattern="D", n_experts=3, n_noop_experts=2, experts_per_token=2),
    "staged-predictor": dict(layer_pattern="RDR", n_experts=3, causal_router="predictor"),
    # routing="mlp": attention dense, the routed MLP an expert layer
    "staged-mlp": dict(layer_pattern="RDR", n_experts=3, n_noop_experts=1, routing="mlp",
                       causal_router="predictor"),
    # routing="mlp_kv": every token queries the takers' keys, the takers' MLP an expert layer
    "staged-mlp-kv": dict(layer_pattern="RDR", n_experts=3, n_noop_experts=1, routing="mlp_kv",
                          causal_router="predictor"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_cached_greedy_equals_full_recomputation_and_batch_equals_alone(name):
    model = _make_model(tiny_config(**VARIANTS[name]))
    prompts = [random_tokens(1, n, seed=10 + n)[0].tolist() for n in (5, 9, 3)]
    got = generate(model, prompts, max_new_tokens=8, temperature=0)
    assert got.tokens == generate_reference(model, prompts, 8).tokens
    for row, prompt in enumerate(prompts):
        alone = generate(model, [prompt], max_new_tokens=8, temperature=0)
        assert alone.tokens[0] == got.tokens[row]


def test_training_drops_only_in_the_top_k_forward():
    cfg = tiny_config(layer_pattern="D", n_experts=4, expert_capacity_factor=0.25)
    model = MoDTransformer(cfg)
    idx = random_tokens(2, 32, seed=0)
    model.train()
    assert any(r.dropped.any() for r in model(idx, idx).expert_routes)
    assert not any(r.dropped.any() for r in model(idx, routing="causal").expert_routes)
    model.eval()
    assert not any(r.dropped.any() for r in model(idx).expert_routes)
    out = model.train()(idx, idx)
    assert out.moe_loss is not None and torch.isfinite(out.loss)
    out.loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "mlp" in n)


def test_expert_config_is_checked():
    with pytest.raises(ValueError, match=r"need an expert layer.*n_noop_experts=2"):
        MoDConfig(n_noop_experts=2)
    for field, value in (("experts_per_token", 3), ("d_ff_expert", 7)):
        with pytest.raises(ValueError, match=f"need an expert layer.*{field}={value}"):
            MoDConfig(**{field: value})
    with pytest.raises(ValueError, match="experts_per_token=3 is more than the 2 experts"):
        MoDConfig(n_experts=2, experts_per_token=3)
    with pytest.raises(ValueError, match="expert_capacity_factor must be"):
        MoDConfig(n_experts=2, expert_capacity_factor=float("nan"))
    assert MoDConfig(n_experts=4, experts_per_token=2).d_ff_expert == MoDConfig().d_ff // 2


@pytest.mark.parametrize("mode", ["joint", "mlp", "mlp_kv"])
@pytest.mark.parametrize("routing", ["topk", "causal"])
def test_tokens_that_ran_a_real_expert_map_back_to_the_sequence(routing, mode):
    """A routed block's expert layer sees only its router's tokens: mapped back to (B, T), a
    token ran a real expert only if it took the block, and every kept slot lands on one token."""
    model = _make_model(
        tiny_config(layer_pattern="RD", n_experts=3, n_noop_experts=2, routing=mode)
    )
    idx = random_tokens(3, 20, seed=4)
    out = model(idx, routing=routing)
    take = {r.layer: r.mask for r in out.routes}
    assert [er.layer for er in out.expert_routes] == [0, 1, 2, 3]
    for er in out.expert_routes:
        ran = ran_real_expert(er, out.routes)
        assert ran.shape == idx.shape
        if er.layer in take:
            assert not (ran & ~take[er.layer]).any()
            if routing == "topk":  # the gathered tokens, one record each
                assert int(ran.sum()) == int(er.kept.any(-1).sum())
            else:  # every token computed; the skippers' results were thrown away
                assert torch.equal(ran, er.kept.any(-1) & take[er.layer])
        else:
            assert torch.equal(ran, er.kept.any(-1))
    no_noop = _make_model(tiny_config(layer_pattern="RD", n_experts=3, routing=mode))
    out = no_noop(idx, routing=routing)
    for er in out.expert_routes:  # no no-ops, no capacity: exactly the takers ran an expert
        want = take_of(out, er.layer, idx)
        assert torch.equal(ran_real_expert(er, out.routes), want)


def take_of(out, layer: int, idx: torch.Tensor) -> torch.Tensor:
    masks = [r.mask for r in out.routes if r.layer == layer]
    return masks[0] if masks else torch.ones_like(idx, dtype=torch.bool)


@pytest.mark.parametrize(
    "kw",
    [
        dict(n_experts=4),
        dict(n_experts=4, experts_per_token=2, n_noop_experts=1),
        dict(n_experts=4, expert_capacity_factor=0.5),
    ],
    ids=["top1", "top2-noop", "drop"],
)
def test_grouped_mm_fast_path_equals_the_expert_loop(kw):
    """Where torch._grouped_mm runs (here: float32 on the CPU), it gives the loop's output and
    gradients; float64 and misaligned rows fall back to the loop."""
    layer = expert_layer(seed=5, **kw).float()
    x = torch.randn(3, 20, 16, generator=torch.Generator().manual_seed(6))
    if not grouped_mm_supported(x, layer.w13, layer.w2):
        pytest.skip("this torch has no torch._grouped_mm for float32 on the CPU")
    outs, grads = [], []
    for grouped in (True, False):
        layer.use_grouped_mm = grouped
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        y, route = layer(xi, drop=True)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append(y.detach())
        grads.append([xi.grad, *(p.grad for p in layer.parameters())])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    for g, r in zip(*grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    assert not grouped_mm_supported(x.double(), layer.w13.double(), layer.w2.double())
    odd = expert_layer(n_experts=2, d_ff_expert=18)  # rows of 18 float32 = 72 bytes: not 16-aligned
    assert not grouped_mm_supported(x, odd.w13.float(), odd.w2.float())
