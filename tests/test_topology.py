"""The topology is derived once (`MoDConfig.topology`, topology.py) and the model follows it: the
routes a forward returns come out in its order, each router reads the threshold its number gives,
and each application of a layer writes the KV-cache layer its schedule gives."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import make_model, random_tokens, tiny_config
from recursion_helpers import CASES, IDS, mor_config

from mixture_of_depths import MoDConfig, selection
from mixture_of_depths.cache import KVCache
from mixture_of_depths.generate import prefill
from mixture_of_depths.topology import RECURSION, Topology

SRC = Path(__file__).resolve().parents[1] / "src" / "mixture_of_depths"
MOD_CASES = [
    dict(routing=routing, skipped_kv=kv)
    for routing in ("joint", "staggered", "mlp", "mlp_kv")
    for kv in ("none", "residual")
    if not (routing in ("mlp", "mlp_kv") and kv == "residual")
] + [dict(causal_router="aux_loss", layer_pattern="DR"), dict(layer_pattern="D")]
CONFIGS = [tiny_config(**c) for c in MOD_CASES] + [mor_config(**c) for c in CASES]
NAMES = [f"mod-{i}" for i in range(len(MOD_CASES))] + [f"mor-{n}" for n in IDS]


def test_a_plain_models_topology():
    topo = tiny_config(routing="staggered").topology  # "RDR" on 4 layers: R D R R
    assert topo.layer_kinds == "RDRR" and topo.routed_layers == (0, 2, 3)
    assert topo.routes == ((0, "attn"), (0, "mlp"), (2, "attn"), (2, "mlp"), (3, "attn"),
                           (3, "mlp"))  # fmt: skip
    assert topo.n_routers == 6 and topo.router_index(2, "mlp") == 3
    assert topo.layer_schedule == ((0, None), (1, None), (2, None), (3, None))
    assert topo.full_kv_layers == (1,) and topo.kv_shares == (0.3, 1.0, 0.3, 0.3)
    assert tiny_config(routing="mlp").topology.kv_shares == (1.0,) * 4  # attention dense
    assert tiny_config(skipped_kv="residual").topology.full_kv_layers == (0, 1, 2, 3)


def test_a_recursive_models_topology():
    topo = mor_config().topology  # 4 layers, "middle_cycle", 3 steps at 1, 0.5, 0.3
    assert topo.recursion_layers == ((0,), (1, 2), (3,))
    assert topo.layer_schedule == ((0, None), (1, 0), (2, 0), (1, 1), (2, 1), (1, 2), (2, 2),
                                   (3, None))  # fmt: skip
    assert topo.step_shares == (1.0, 0.5, 0.3) and topo.recursion_routed_steps == (1, 2)
    assert topo.routes == ((1, RECURSION), (2, RECURSION)) and topo.n_routers == 2
    assert topo.kv_layer(2, 1) == 4 and topo.kv_layer(3, None) == 7
    assert topo.kv_shares == (1.0, 1.0, 1.0, 0.5, 0.5, 0.3, 0.3, 1.0)
    assert mor_config(recursion_kv="share").topology.kv_shares[3:7] == (0.0,) * 4
    token = mor_config(recursion_router="token", recursion_capacities=None).topology
    assert token.n_routers == 0 and len(token.routes) == 2  # routes, but no thresholds
    assert token.step_shares == (1.0, 2 / 3, 1 / 3)


@pytest.mark.parametrize("cfg", CONFIGS, ids=NAMES)
def test_routes_come_out_in_the_topologys_order(cfg):
    model = make_model(cfg)
    idx = random_tokens(2, 17, seed=3)
    want = list(cfg.topology.routes)
    for routing in ("topk", "causal"):
        out = model(idx, routing=routing)
        assert [(r.layer, r.kind) for r in out.routes] == want
        assert model.route_names() == [r.name for r in out.routes]


@pytest.mark.parametrize("cfg", CONFIGS, ids=NAMES)
def test_each_router_reads_the_threshold_its_number_gives(cfg):
    if not cfg.n_routers:
        pytest.skip("no router with a threshold")
    thresholds = tuple(0.125 * (i + 1) for i in range(cfg.n_routers))
    model = make_model(dataclasses.replace(cfg, causal_thresholds=thresholds))
    out = model(random_tokens(2, 17, seed=3), routing="causal")
    assert tuple(r.threshold for r in out.routes) == thresholds
    for block in model.blocks:
        for kind in getattr(block, "route_kinds", ()) if block.routed else ():
            assert block.router_index(kind) == cfg.topology.routes.index((block.layer, kind))


class RecordingCache(KVCache):
    """A KV cache that notes which layer each prefill write goes to."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.written: list[int] = []

    def write_prefill(self, layer, k, v, take_BT) -> None:  # noqa: ANN001
        self.written.append(layer)
        super().write_prefill(layer, k, v, take_BT)


def recorded_prefill(cfg: MoDConfig, pack: bool, monkeypatch: pytest.MonkeyPatch) -> RecordingCache:
    monkeypatch.setattr(selection, "PACK_PREFILL", pack)
    cache = RecordingCache(cfg, 2, 32, dtype=torch.float64)
    prefill(make_model(cfg), random_tokens(2, 13, seed=5), torch.tensor([13, 9]), cache)
    return cache


@pytest.mark.parametrize("cfg", CONFIGS, ids=NAMES)
def test_each_application_writes_the_cache_layer_its_schedule_gives(cfg, monkeypatch):
    topo = cfg.topology
    cache = recorded_prefill(cfg, False, monkeypatch)  # the masked reference writes every layer
    assert len(cache.k) == topo.n_kv_layers
    # in forward order, each cache layer once, but those that read the first pass's ("share")
    want = [i for i, share in enumerate(topo.kv_shares) if share > 0]
    assert cache.written == want
    lengths = cache.lengths
    for i in topo.full_kv_layers:  # every real token of each row
        assert lengths[i].tolist() == [13, 9], i
    # The packed prefill runs nothing where no token of any row takes: that layer stays empty.
    packed = recorded_prefill(cfg, True, monkeypatch)
    assert packed.written == [i for i in want if lengths[i].sum() > 0]
    assert packed.lengths.tolist() == lengths.tolist()


def test_topology_is_built_once_per_config_and_compared_by_value():
    cfg = tiny_config()
    assert cfg.topology is cfg.topology
    assert Topology.of(cfg) == cfg.topology
    assert MoDConfig.from_json(cfg.to_json()).topology == cfg.topology


def test_only_the_topology_reads_the_route_kinds():
    """The routers per routing mode are turned into routes in topology.py alone (config.py
    re-exports the table and names the modes)."""
    readers = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.Name) and n.id == "ROUTE_KINDS" for n in ast.walk(tree)):
            readers.append(str(path.relative_to(SRC)))
    assert readers == ["config.py", "topology.py"]
