"""A model's topology, derived once from its `MoDConfig` (`MoDConfig.topology`): the kind of each
layer, the routes a forward returns and the router numbering, the recursion's steps and the KV
cache's layout. The model, the caches, the FLOP count and calibration read it here rather than
each working it out again (docs/semantics.md says what the routes and the caches hold,
docs/mor.md the recursion).

Routes come out of a forward in this order: a plain model's routed layers in layer order, each
layer's route kinds in `ROUTE_KINDS` order; a recursive model's routed steps in step order. The
cache has one layer per application of a layer (`layer_schedule`, forward order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

# The sub-blocks each routing mode routes, one router each (docs/semantics.md, "Joint, staggered
# and MLP-only routing"): the whole block; attention and the MLP apart; only the MLP, with
# attention dense in every layer; the attention's keys and values and the MLP, every token
# querying ("Takers' keys"). That router is named for both ("1.mlp_kv" in logs), not "block":
# its skippers still run the block's attention, so joint routing's bare "1" would misread it.
ROUTE_KINDS: dict[str, tuple[str, ...]] = {
    "joint": ("block",),
    "staggered": ("attn", "mlp"),
    "mlp": ("mlp",),
    "mlp_kv": ("mlp_kv",),
}
RECURSION = "recursion"  # the route kind of a recursion step (its "layer" is the step number)


class LayerKind(NamedTuple):
    description: str
    routed: bool  # a router picks its tokens (the block has routes, take-rates, a smaller cache)


# The letters of `layer_pattern`. Each maps to one block class in model.BLOCKS (and its cost).
LAYER_KINDS = {
    "D": LayerKind("dense block: every token takes it", routed=False),
    "R": LayerKind("routed block: a router picks the tokens that take it", routed=True),
}

Application = tuple[int, int | None]  # (layer, recursion step; None: a unique layer)


@dataclass(frozen=True)
class Topology:
    """What a config's fields make of the model's layers, routers and cache (see the module)."""

    layer_kinds: str  # the pattern tiled over the layers, one letter per layer: "DRDRDRDR"
    routed_layers: tuple[int, ...]  # the layers whose kind is routed
    route_kinds: tuple[str, ...]  # a routed layer's routers (ROUTE_KINDS[routing])
    routes: tuple[tuple[int, str], ...]  # (layer or step, kind) per route, in forward order
    # the routers with a causal threshold: every route's, none with token-choice recursion
    # (which decides exactly)
    n_routers: int
    # the unique layers before the recursion, the shared ones, those after it
    recursion_layers: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    step_shares: tuple[float, ...]  # the share of the sequence that takes each recursion step
    recursion_routed_steps: tuple[int, ...]  # the steps with a router
    # every application of a layer in forward order; its index is its KV-cache layer
    layer_schedule: tuple[Application, ...]
    full_kv_layers: tuple[int, ...]  # the KV-cache layers that hold every token
    kv_shares: tuple[float, ...]  # per KV-cache layer: the share of tokens it holds at capacity

    @property
    def n_kv_layers(self) -> int:
        return len(self.layer_schedule)

    def router_index(self, layer: int, kind: str) -> int:
        """The number of the route of `layer` (a recursion step for RECURSION) and `kind`, in
        forward order: its index into `causal_thresholds` and `random_take_rates`."""
        return self.routes.index((layer, kind))

    def kv_layer(self, layer: int, step: int | None) -> int:
        """The KV-cache layer that `layer` writes at recursion step `step` (None: unique)."""
        return self.layer_schedule.index((layer, step))

    @classmethod
    def of(cls, cfg: Any) -> Topology:
        """The topology of `cfg`, a `MoDConfig` whose fields are checked and whose
        `recursion_capacities` are resolved (typed loosely: config.py imports this module)."""
        n, p = cfg.n_layers, cfg.layer_pattern
        kinds = (p * math.ceil(n / len(p)))[:n]
        routed = tuple(i for i, kind in enumerate(kinds) if LAYER_KINDS[kind].routed)
        route_kinds = ROUTE_KINDS[cfg.routing]
        if cfg.recursions > 1:
            return cls._recursive(cfg, kinds, routed, route_kinds)
        routes = tuple((layer, kind) for layer in routed for kind in route_kinds)
        # Every token's keys are cached in a dense layer, and in a routed one whose attention
        # keys every token ("residual") or is dense ("mlp"); "mlp_kv" caches its takers alone.
        every = cfg.skipped_kv == "residual" or cfg.routing == "mlp"
        full = tuple(i for i in range(n) if every or i not in routed)
        return cls(
            layer_kinds=kinds,
            routed_layers=routed,
            route_kinds=route_kinds,
            routes=routes,
            n_routers=len(routes),
            recursion_layers=((), tuple(range(n)), ()),
            step_shares=(),
            recursion_routed_steps=(),
            layer_schedule=tuple((layer, None) for layer in range(n)),
            full_kv_layers=full,
            kv_shares=tuple(1.0 if i in full else cfg.capacity for i in range(n)),
        )

    @classmethod
    def _recursive(
        cls, cfg: Any, kinds: str, routed: tuple[int, ...], route_kinds: tuple[str, ...]
    ) -> Topology:
        """Mixture-of-Recursions (docs/mor.md): "middle_cycle" applies layers 1..n-2
        `recursions` times between the unique first and last, "cycle" all of them."""
        n, steps = cfg.n_layers, cfg.recursions
        if cfg.recursion_sharing == "cycle":
            pre, shared, post = (), tuple(range(n)), ()
        else:
            pre, shared, post = (0,), tuple(range(1, n - 1)), (n - 1,)
        schedule = (
            *((layer, None) for layer in pre),
            *((layer, r) for r in range(steps) for layer in shared),
            *((layer, None) for layer in post),
        )
        token = cfg.recursion_router == "token"
        if token:  # every later step is routed; balanced depths share the sequence evenly
            shares = tuple((steps - r) / steps for r in range(steps))
            routed_steps = tuple(range(1, steps))
        else:  # expert choice: a step at 1.0 is every token's and has no router
            shares = tuple(cfg.recursion_capacities)
            routed_steps = tuple(r for r, c in enumerate(shares) if c < 1)
        # the unique layers, the first pass and every token's steps cache every token; a
        # routed step its own tokens, or nothing where it reads the first pass's ("share")
        full = tuple(i for i, (_, r) in enumerate(schedule) if r not in routed_steps)
        share_kv = cfg.recursion_kv == "share"
        kv = tuple(
            1.0 if i in full else 0.0 if share_kv else shares[r]
            for i, (_, r) in enumerate(schedule)
        )
        return cls(
            layer_kinds=kinds,
            routed_layers=routed,
            route_kinds=route_kinds,
            routes=tuple((r, RECURSION) for r in routed_steps),
            n_routers=0 if token else len(routed_steps),
            recursion_layers=(pre, shared, post),
            step_shares=shares,
            recursion_routed_steps=routed_steps,
            layer_schedule=schedule,
            full_kv_layers=full,
            kv_shares=kv,
        )
