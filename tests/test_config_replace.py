"""A config keeps what was given apart from what it resolved: `dataclasses.replace` is a fresh
construction with the changed fields (the oracle: build from the base's given fields plus the
change), for every field, from every preset; equality, hashing, `asdict`, pickling and JSON
behave as docs/semantics.md ("The config") says."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle

import pytest
import torch

from mixture_of_depths import PRESETS, MoDConfig, MoDTransformer
from mixture_of_depths.config import FIELD_NAMES
from mixture_of_depths.derived import DERIVED

# The bases: every preset, and configs that give what presets leave derived (or derive it
# otherwise): the oracle builds from exactly these keywords.
BASES: dict[str, dict] = {
    **{name: dict(PRESETS[name]) for name in PRESETS},
    "given": dict(d_model=96, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=160, aux_loss_weight=0.3),
    "aux": dict(d_model=64, n_layers=4, n_heads=4, causal_router="aux_loss", routing="staggered"),
    "experts": dict(d_model=64, n_layers=4, n_heads=4, n_experts=4, experts_per_token=2,
                    d_ff_expert=48, n_noop_experts=1),
    "mor-routed-only": dict(d_model=64, n_layers=4, n_heads=4, layer_pattern="D", recursions=3,
                            recursion_capacities=(0.5, 0.25)),
    "mor-halving": dict(d_model=64, n_layers=3, n_heads=4, layer_pattern="D", recursions=3,
                        recursion_kv="share"),
    "mor-token": dict(d_model=64, n_layers=3, n_heads=4, layer_pattern="D", recursions=2,
                      recursion_router="token"),
    "calibrated": dict(d_model=64, n_layers=4, n_heads=4, layer_pattern="DR",
                       causal_thresholds=(0.5, -0.25)),
}  # fmt: skip

# Values for every field (valid or not: a refusal must be the same refusal), None resetting a
# derived field to its derivation.
VALUES: dict[str, list] = {
    "vocab_size": [300],
    "d_model": [96, 384],
    "n_layers": [3, 5],
    "n_heads": [2, 6],
    "n_kv_heads": [None, 1, 2],
    "d_ff": [None, 160],
    "ff_mult": [2.0, 4.0],
    "max_seq_len": [64],
    "layer_pattern": ["D", "RD", "DDR"],
    "capacity": [0.25, 1],
    "routing": ["joint", "staggered", "mlp", "mlp_kv"],
    "router_gate": ["raw"],
    "causal_router": ["aux_loss", "predictor"],
    "router_scores": ["random", "learned"],
    "random_take_rates": ["", "0.25,0.5"],
    "causal_thresholds": [(), (0.5,), [0.5, -0.25]],
    "aux_loss_weight": [None, 0.0, 0.5],
    "predictor_hidden": [16],
    "skipped_kv": ["residual", "none"],
    "tie_embeddings": [False],
    "rope_theta": [500.0],
    "norm_eps": [1e-6],
    "init_std": [0.01],
    "n_experts": [0, 4],
    "experts_per_token": [1, 2],
    "d_ff_expert": [None, 64],
    "n_noop_experts": [0, 2],
    "expert_capacity_factor": [None, 1.5],
    "moe_balance_loss_weight": [0.0],
    "moe_z_loss_weight": [0.0],
    "recursions": [1, 2, 3, 4],
    "recursion_sharing": ["cycle", "middle_cycle"],
    "recursion_capacities": [None, (0.5,), (1.0, 0.5, 0.25), [0.5, 0.25]],
    "recursion_router": ["token", "expert"],
    "recursion_kv": ["share", "recursion"],
}
# Changes of several fields at once (a replace that changes what another field derives from).
PAIRS = [
    dict(d_model=384, n_heads=6),
    dict(d_model=128, d_ff=None),
    dict(causal_router="aux_loss", aux_loss_weight=None),
    dict(recursions=3, recursion_capacities=None),
    dict(layer_pattern="D", recursions=3),
    dict(n_experts=4, d_ff_expert=None, d_ff=96),
    dict(n_experts=0, experts_per_token=1, d_ff_expert=None, n_noop_experts=0),
]


def _build(kwargs: dict) -> MoDConfig | str:
    try:
        return MoDConfig(**kwargs)
    except ValueError as err:
        return f"ValueError: {err}"


def _replaced(base: MoDConfig, change: dict) -> MoDConfig | str:
    try:
        return dataclasses.replace(base, **change)
    except ValueError as err:
        return f"ValueError: {err}"


def _assert_same(got: MoDConfig | str, want: MoDConfig | str, what: object) -> None:
    if isinstance(want, str) or isinstance(got, str):
        assert got == want, what  # the same refusal, word for word
        return
    assert got == want, what  # the same model: every resolved value
    assert got.to_dict() == want.to_dict(), what
    # ... and the same given fields, so that a later replace re-derives alike
    assert dataclasses.asdict(got) == dataclasses.asdict(want), what
    assert got.topology == want.topology, what


def test_every_field_has_values_to_change_to():
    assert set(VALUES) == set(FIELD_NAMES)


@pytest.mark.parametrize("base_name", list(BASES))
def test_replace_is_a_fresh_construction_with_the_change(base_name):
    given = BASES[base_name]
    base = MoDConfig(**given)
    for field, values in VALUES.items():
        for value in values:
            change = {field: value}
            _assert_same(_replaced(base, change), _build({**given, **change}), change)
    for change in PAIRS:
        _assert_same(_replaced(base, change), _build({**given, **change}), change)


@pytest.mark.parametrize("base_name", list(BASES))
def test_a_replaced_config_replaces_as_a_fresh_one_does(base_name):
    """Two replaces in a row: the first one's result keeps what was given."""
    given = BASES[base_name]
    base = MoDConfig(**given)
    for first, then in [(dict(d_model=128), dict(n_heads=2)), (dict(n_heads=2), dict(d_model=96)),
                        (dict(causal_router="aux_loss"), dict(causal_router="predictor")),
                        (dict(recursions=2), dict(recursions=4))]:  # fmt: skip
        once = _replaced(base, first)
        if isinstance(once, str):
            continue
        _assert_same(_replaced(once, then), _build({**given, **first, **then}), (first, then))


def test_the_issues_examples():
    small = MoDConfig.preset("small")
    assert small.d_ff == 512
    assert dataclasses.replace(small, d_model=384).d_ff == MoDConfig(d_model=384, n_heads=6).d_ff
    assert dataclasses.replace(small, d_model=384).d_ff == 1024
    # n_kv_heads follows n_heads unless given (it was frozen at 8, and 8 does not divide 6)
    assert dataclasses.replace(MoDConfig(d_model=384), n_heads=6).n_kv_heads == 6
    assert dataclasses.replace(MoDConfig(), n_heads=4).n_kv_heads == 4
    assert dataclasses.replace(MoDConfig(n_kv_heads=2), n_heads=4).n_kv_heads == 2
    # the aux-loss weight follows the causal router unless given
    assert dataclasses.replace(MoDConfig(), causal_router="aux_loss").aux_loss_weight == 0.01
    given = MoDConfig(aux_loss_weight=0.1)
    assert dataclasses.replace(given, causal_router="aux_loss").aux_loss_weight == 0.1


def test_a_preset_with_overrides_derives_as_a_fresh_construction():
    for name, fields in PRESETS.items():
        for over in (dict(d_model=384, n_heads=6), dict(ff_mult=2.0), dict(n_heads=2)):
            assert _build({**fields, **over}) == _build_preset(name, over), (name, over)


def _build_preset(name: str, over: dict) -> MoDConfig | str:
    try:
        return MoDConfig.preset(name, **over)
    except ValueError as err:
        return f"ValueError: {err}"


@pytest.mark.parametrize("name", ["small", "small-mode-staged", "small-mor", "base"])
def test_replace_builds_the_model_a_fresh_construction_builds(name):
    over = dict(d_model=384)
    replaced = dataclasses.replace(MoDConfig.preset(name), **over)
    with torch.device("meta"):  # shapes only
        got = MoDTransformer(replaced).state_dict()
        want = MoDTransformer(MoDConfig(**{**PRESETS[name], **over})).state_dict()
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}


def test_equal_when_they_build_the_same_model():
    derived, given = MoDConfig(), MoDConfig(d_ff=704, n_kv_heads=8, aux_loss_weight=0.1)
    assert derived.d_ff == 704
    assert derived == given and hash(derived) == hash(given) and repr(derived) == repr(given)
    assert len({derived, given}) == 1
    assert derived != MoDConfig(d_ff=736)
    # what was given differs, so a replace may not derive alike: the config keeps it
    assert dataclasses.replace(derived, d_model=384).d_ff == 1024
    assert dataclasses.replace(given, d_model=384).d_ff == 704
    assert "d_ff=704" in repr(derived) and "_d_ff" not in repr(derived)


def test_asdict_is_what_was_given_and_builds_the_same_config():
    cfg = MoDConfig.preset("small-mor", n_kv_heads=2)
    fields = dataclasses.asdict(cfg)
    assert fields["_n_kv_heads"] == 2 and fields["_d_ff"] is None
    assert fields["_recursion_capacities"] == (1.0, 0.25, 0.125)
    again = MoDConfig(**fields)
    assert again == cfg and dataclasses.asdict(again) == fields
    assert [f.name.removeprefix("_") for f in dataclasses.fields(MoDConfig)] == list(FIELD_NAMES)
    assert {f"_{name}" for name in DERIVED} <= {f.name for f in dataclasses.fields(MoDConfig)}
    # looked up by the public name, as experiments/round4/plan.py does
    assert MoDConfig.__dataclass_fields__["aux_loss_weight"].default is None


def test_pickle_and_copy_keep_what_was_given():
    cfg = MoDConfig.preset("small")
    for again in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg), copy.copy(cfg)):
        assert again == cfg and again.topology == cfg.topology
        assert dataclasses.replace(again, d_model=384).d_ff == 1024


def test_json_holds_resolved_values_and_old_files_load_unchanged():
    cfg = MoDConfig.preset("small")
    data = json.loads(cfg.to_json())
    assert (data["d_ff"], data["n_kv_heads"], data["aux_loss_weight"]) == (512, 6, 0.1)
    assert set(data) == set(FIELD_NAMES)
    # a config.json written before configs kept what was given: resolved values throughout
    old = {**data, "d_model": 192, "d_ff": 512, "recursion_capacities": None}
    loaded = MoDConfig.from_dict(old)
    assert loaded == cfg and loaded.to_dict() == data
    # a value it holds that equals its derivation is not given: a later change re-derives it
    # (as for the preset saved), one that differs stays
    assert dataclasses.replace(loaded, d_model=384).d_ff == 1024
    assert dataclasses.replace(MoDConfig.from_dict({**old, "d_ff": 256}), d_model=384).d_ff == 256
    assert MoDConfig.from_json(MoDConfig.preset("small-mor").to_json()).recursion_capacities == (
        1.0,
        0.25,
        0.125,
    )


@pytest.mark.parametrize("base_name", list(BASES))
def test_a_loaded_config_replaces_as_a_fresh_one_does(base_name):
    """The JSON holds every field's resolved value; a `DERIVED` one that equals its derivation
    from the other fields loads as not given, so the loaded config re-derives under `replace` as
    the saved one did (the oracle: a fresh construction from the given fields, less those equal
    to their derivation, which the JSON cannot tell from unset ones), and saves the same JSON."""
    given = BASES[base_name]
    saved = MoDConfig(**given)
    told = {
        k: v
        for k, v in given.items()
        if k not in DERIVED or _build({n: w for n, w in given.items() if n != k}) != saved
    }
    loaded = MoDConfig.from_json(saved.to_json())
    assert loaded.to_json() == saved.to_json()
    for field, values in VALUES.items():
        for value in values:
            change = {field: value}
            _assert_same(_replaced(loaded, change), _build({**told, **change}), change)
    for change in PAIRS:
        _assert_same(_replaced(loaded, change), _build({**told, **change}), change)


@pytest.mark.parametrize("base_name", list(BASES))
def test_from_dict_takes_what_asdict_gives(base_name):
    """`asdict` gives what was given (``_d_ff``: None where derived): `from_dict` takes it as
    given, so the round trip keeps it exactly, beside `to_dict`'s resolved values."""
    cfg = MoDConfig(**BASES[base_name])
    again = MoDConfig.from_dict(dataclasses.asdict(cfg))
    assert again == cfg and dataclasses.asdict(again) == dataclasses.asdict(cfg)
    with pytest.raises(ValueError, match="both d_ff and _d_ff"):
        MoDConfig.from_dict({**cfg.to_dict(), "_d_ff": 96})
