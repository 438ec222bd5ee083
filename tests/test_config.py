"""`MoDConfig`: serialisation, presets, validation, capacity rounding and layer tiling."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from mixture_of_depths import PRESETS, MoDConfig, MoDTransformer, capacity_tokens

# -- JSON ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        MoDConfig(),
        MoDConfig.preset(
            "tiny",
            capacity=0.3,
            routing="staggered",
            router_gate="raw",
            causal_router="predictor",
            n_kv_heads=2,
            d_ff=100,
            tie_embeddings=False,
        ),
        MoDConfig.preset("base", capacity=1, aux_loss_weight=0.0),
    ],
)
def test_json_round_trip(cfg, tmp_path):
    text = cfg.to_json()
    assert json.loads(text) == cfg.to_dict()
    again = MoDConfig.from_json(text)
    assert again == cfg
    assert again.to_dict() == cfg.to_dict()
    # the resolved values keep their types (JSON holds them all, explicit)
    assert [type(v) for v in again.resolved().values()] == [
        type(v) for v in cfg.resolved().values()
    ]
    path = tmp_path / "sub dir" / "config.json"
    path.parent.mkdir()
    assert cfg.to_json(path) == text
    assert MoDConfig.from_json(path) == cfg
    assert MoDConfig.from_json(str(path)) == cfg
    assert MoDConfig.from_dict(cfg.to_dict()) == cfg


def test_from_json_rejects_unknown_field():
    text = json.dumps({**MoDConfig().to_dict(), "capcity": 0.5})
    with pytest.raises(ValueError, match="capcity"):
        MoDConfig.from_json(text)


# -- presets ------------------------------------------------------------------------------------


def _count_params(cfg: MoDConfig) -> int:
    with torch.device("meta"):  # no memory, no init cost
        return MoDTransformer(cfg).num_params()


def test_presets_exist_and_pair_up():
    assert {"tiny", "small", "base"} <= set(PRESETS)
    for name in PRESETS:
        cfg = MoDConfig.preset(name)
        assert MoDConfig.from_json(cfg.to_json()) == cfg
        if name.endswith("-dense"):
            assert cfg.is_dense
            assert cfg == MoDConfig.preset(name.removesuffix("-dense")).dense_twin()
        elif cfg.has_experts:  # the MoE / MoDE family: same active parameters as its base
            base = MoDConfig.preset(name.split("-")[0])
            assert cfg.experts_per_token * cfg.d_ff_expert == base.d_ff
            assert (cfg.d_model, cfg.n_layers, cfg.n_heads) == (
                base.d_model,
                base.n_layers,
                base.n_heads,
            )
        elif cfg.recursive:  # Mixture-of-Recursions: the base's width, fewer unique layers
            base = MoDConfig.preset(name.split("-")[0])
            assert (cfg.d_model, cfg.n_heads) == (base.d_model, base.n_heads)
            assert cfg.n_layers < base.n_layers and cfg.recursions > 1
        else:
            assert not cfg.is_dense
            assert f"{name}-dense" in PRESETS
    assert MoDConfig.preset("tiny", capacity=0.5).capacity == 0.5


@pytest.mark.parametrize("name", ["tiny", "small", "base"])
@pytest.mark.parametrize("routing", ["joint", "staggered"])
@pytest.mark.parametrize("causal_router", ["aux_loss", "predictor"])
def test_dense_twin_has_the_parameters_minus_the_routers(name, routing, causal_router):
    cfg = MoDConfig.preset(name, routing=routing, causal_router=causal_router)
    dense = cfg.dense_twin()
    assert dense.is_dense and dense.layer_pattern == "D"
    assert dataclasses.replace(dense, layer_pattern=cfg.layer_pattern, routing=routing) == cfg
    n_routers = len(cfg.routed_layers) * (1 if routing == "joint" else 2)
    d, h = cfg.d_model, cfg.predictor_hidden
    per_router = d + ((d * h + h) + (h + 1) if causal_router == "predictor" else 0)
    assert _count_params(cfg) - _count_params(dense) == n_routers * per_router


def test_tiny_preset_builds_and_runs():
    cfg = MoDConfig.preset("tiny")
    model = MoDTransformer(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    out = model(idx, targets=idx)
    assert out.logits.shape == (2, 16, cfg.vocab_size)
    assert torch.isfinite(out.loss)


# -- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, needles",
    [
        (dict(capacity=0), ["capacity", "got 0"]),
        (dict(capacity=0.0), ["capacity", "0.0"]),
        (dict(capacity=-0.1), ["capacity", "-0.1"]),
        (dict(capacity=1.5), ["capacity", "1.5"]),
        (dict(capacity=float("nan")), ["capacity", "nan"]),
        (dict(layer_pattern="DX"), ["layer_pattern", "'DX'", "X"]),
        (dict(layer_pattern=""), ["layer_pattern", "''"]),
        (dict(d_model=64, n_heads=5), ["n_heads=5", "64"]),
        (dict(d_model=64, n_heads=4, n_kv_heads=3), ["n_kv_heads=3", "4"]),
        (dict(routing="jointt"), ["routing", "'jointt'"]),
        (dict(router_gate="relu"), ["router_gate", "'relu'"]),
        (dict(causal_router="topk"), ["causal_router", "'topk'"]),
        (dict(n_layers=0), ["n_layers", "0"]),
        (dict(vocab_size=2.5), ["vocab_size", "2.5"]),
        (dict(aux_loss_weight=-1.0), ["aux_loss_weight", "-1.0"]),
        # routing="mlp_kv" keys only its takers, and routes layers, not recursion steps
        (dict(routing="mlp_kv", skipped_kv="residual"), ["skipped_kv='residual'", "mlp_kv",
                                                           "skipped_kv='none'"]),
        (dict(routing="mlp_kv", layer_pattern="D", n_layers=4, recursions=2),
         ["routing='mlp_kv'", "recursions=2", "routing='joint'"]),
    ],
)  # fmt: skip
def test_invalid_config_raises_value_error_naming_the_value(overrides, needles):
    with pytest.raises(ValueError) as err:
        MoDConfig(**overrides)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_unknown_preset_and_unknown_field():
    with pytest.raises(ValueError, match="'huge'"):
        MoDConfig.preset("huge")
    with pytest.raises(ValueError, match="capcity"):
        MoDConfig.from_dict({"capcity": 0.5})
    with pytest.raises(ValueError, match="capacity"):
        MoDConfig.preset("tiny", capacity=2.0)  # overrides are validated too


def test_defaults_are_derived():
    cfg = MoDConfig(d_model=96, n_heads=4, ff_mult=3.0)
    assert cfg.n_kv_heads == 4 and cfg.head_dim == 24
    assert cfg.d_ff % 32 == 0 and cfg.d_ff >= 3.0 * 96 and cfg.d_ff - 32 < 3.0 * 96
    assert isinstance(MoDConfig(capacity=1).capacity, float)


# -- capacity rounding --------------------------------------------------------------------------


def test_capacity_tokens_matches_brute_force_on_the_written_decimal():
    """An oracle that shares nothing with the code: capacities written as num/den in integers (the
    decimal a user types, e.g. 29/100 = "0.29"), and k the largest j in [0, T] with j/T <= num/den,
    found by trying every j."""
    fractions_ = {(i, 200) for i in range(1, 201)}
    fractions_ |= {(29, 100), (57, 100), (58, 100), (7, 100), (14, 100), (123, 1000)}
    hazards = 0
    for num, den in sorted(fractions_):
        capacity = num / den
        for seq_len in range(0, 260):
            expected = max(j for j in range(seq_len + 1) if j * den <= num * seq_len)
            k = capacity_tokens(capacity, seq_len)
            assert k == expected, (num, den, seq_len, k)
            hazards += math.floor(capacity * seq_len) != expected
    assert hazards > 0  # the sweep holds products that fall just below an integer in float


def test_capacity_tokens_edges():
    assert capacity_tokens(0.125, 7) == 0  # capacity * T < 1: no token, never rounded up
    assert capacity_tokens(0.5, 1) == 0  # a one-token step in top-k mode is not dense
    assert capacity_tokens(1.0, 37) == 37
    assert capacity_tokens(0.3, 0) == 0
    with pytest.raises(ValueError, match="-1"):
        capacity_tokens(0.5, -1)
    cfg = MoDConfig(capacity=0.29)
    assert all(cfg.capacity_tokens(t) == capacity_tokens(0.29, t) for t in range(300))


# -- layer tiling -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pattern, n_layers",
    [("DR", 5), ("DR", 8), ("RRD", 7), ("DRRD", 2), ("R", 3), ("D", 4), ("DDDR", 4)],
)
def test_layer_kinds_tile_the_pattern(pattern, n_layers):
    cfg = MoDConfig(layer_pattern=pattern, n_layers=n_layers, d_model=16, n_heads=2)
    expected = "".join(pattern[i % len(pattern)] for i in range(n_layers))
    assert cfg.layer_kinds == expected
    assert cfg.routed_layers == [i for i, c in enumerate(expected) if c == "R"]
    assert cfg.is_dense == ("R" not in expected)
    assert [b.routed for b in MoDTransformer(cfg).blocks] == [c == "R" for c in expected]


def test_layer_kinds_example():
    assert MoDConfig(layer_pattern="DR", n_layers=5).layer_kinds == "DRDRD"


@pytest.mark.parametrize("capacity", [0.125, 0.29, 0.57, 1 / 3, 0.4999999, 0.9999999, 0.7, 1.0])
def test_config_capacity_tokens_equals_the_shared_function(capacity):
    """The model's integer-arithmetic path agrees with the documented rounding function."""
    cfg = MoDConfig(capacity=capacity)
    assert [cfg.capacity_tokens(t) for t in range(300)] == [
        capacity_tokens(capacity, t) for t in range(300)
    ]


def test_config_is_frozen():
    cfg = MoDConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.capacity = 0.5  # would desynchronise the model's capacity rounding
    assert dataclasses.replace(cfg, capacity=0.5).capacity_tokens(10) == 5


def test_routing_defaults_are_the_second_round_study_winners():
    """experiments/round2: the predictor, the sigmoid gate; the causal-router loss weight that
    suits the router (0.1 for the predictor, 0.01 for the aux loss), resolved at construction so
    that a saved config says the number; a weight given is kept."""
    cfg = MoDConfig()
    assert (cfg.causal_router, cfg.router_gate, cfg.aux_loss_weight) == (
        "predictor",
        "sigmoid",
        0.1,
    )
    assert cfg.has_predictor
    assert MoDConfig(causal_router="aux_loss").aux_loss_weight == 0.01
    assert MoDConfig(causal_router="aux_loss", aux_loss_weight=0.3).aux_loss_weight == 0.3
    assert MoDConfig(aux_loss_weight=0.0).aux_loss_weight == 0.0
    again = MoDConfig.from_dict(json.loads(MoDConfig(causal_router="aux_loss").to_json()))
    assert again.aux_loss_weight == 0.01
    assert not MoDConfig(router_scores="random").has_predictor  # the noise decides
