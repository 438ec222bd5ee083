"""`MoDConfig`: one flat, validated configuration for MoD and dense transformers, with presets.

A model is a stack of blocks described by `layer_pattern`, a string of ``D`` (dense) and ``R``
(routed) tiled over the layers: ``"DR"`` on 8 layers is D R D R D R D R. ``"D"`` is the dense
baseline, built by the same code. The capacity rounding used everywhere (model, prefill, FLOP
counter, tests) is `capacity_tokens`. docs/semantics.md states the semantics these fields select.

A config keeps what you gave apart from what it resolved (docs/semantics.md, "The config"): a
field left unset (None) whose default follows from others (`n_kv_heads`, `d_ff`,
`aux_loss_weight`, `d_ff_expert`, `recursion_capacities`, the `DERIVED` five) stays unset, so
``dataclasses.replace`` is a fresh construction with the changed fields and re-derives it:
``replace(MoDConfig.preset("small"), d_model=384).d_ff`` is 1024, as for a config built at 384.
The dataclass field of each of the five is private (``_d_ff``: what was given, None where it was
not) and the public name is a property of the resolved value, because ``cfg.d_ff`` is read as the
MLP's width everywhere, users' code included; the constructor and `replace` take the public names
(and the private ones that `replace` and `dataclasses.asdict` carry; `from_dict` takes either
dict). Everything else reads resolved values: equality and hashing (two configs that build the
same model are equal), `repr`, `to_dict` and the JSON a checkpoint holds (explicit values: a
saved config loads to the same model whatever later versions derive; a value equal to its
derivation from the others loads as not given, so `replace` re-derives it there too). The layers'
kinds, the routes and their numbering, the recursion's steps and the KV cache's layout are
derived once, in `topology.Topology`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from .checks import POSITIVE, POSITIVE_INT, SHARE, Range, check_choice, check_fields
from .derived import (
    DERIVED,
    Resolved,
    as_given,
    aux_loss_weight,
    expert_width,
    kv_heads,
    mlp_width,
    stored_name,
    taking_public_names,
)
from .fileio import atomic_write_text
from .presets import PRESETS
from .recursion_fields import checked_recursion
from .topology import LAYER_KINDS, Topology
from .topology import ROUTE_KINDS as ROUTE_KINDS  # re-exported: the routing modes' routers
from .topology import LayerKind as LayerKind

ROUTING_MODES = tuple(ROUTE_KINDS)
ROUTER_GATES = ("raw", "sigmoid", "straight_through", "sigmoid_stopgrad")
CAUSAL_ROUTERS = ("aux_loss", "predictor")
# What a routed layer's attention keeps of the tokens that skip it (docs/semantics.md, "KV
# strategies"): nothing (routing-isolated attention), or keys and values from its input.
SKIPPED_KV = ("none", "residual")
ROUTER_SCORES = ("learned", "random")
# Mixture-of-Recursions (docs/mor.md): which layers the recursion shares, who picks the tokens
# of each step, and what a later step's attention reads.
RECURSION_SHARING = ("middle_cycle", "cycle")
RECURSION_ROUTERS = ("expert", "token")
RECURSION_KV = ("recursion", "share")
# The string fields and what each allows (the CLI offers them as choices).
FIELD_CHOICES: dict[str, tuple[str, ...]] = {
    "routing": ROUTING_MODES,
    "router_gate": ROUTER_GATES,
    "causal_router": CAUSAL_ROUTERS,
    "router_scores": ROUTER_SCORES,
    "skipped_kv": SKIPPED_KV,
    "recursion_sharing": RECURSION_SHARING,
    "recursion_router": RECURSION_ROUTERS,
    "recursion_kv": RECURSION_KV,
}


def capacity_ratio(capacity: float) -> tuple[int, int]:
    """The capacity as the exact fraction of the decimal it prints as: 0.29 -> (29, 100).

    The float 0.29 is 0.28999999999999998; reading its shortest decimal (``repr``) instead gives
    the capacity the user wrote, so 0.29 of 100 tokens is 29 tokens, not 28.
    """
    if isinstance(capacity, bool) or not (
        isinstance(capacity, int | float) and 0.0 < capacity <= 1.0
    ):
        raise ValueError(f"capacity must be in (0, 1], got {capacity!r}")
    frac = Fraction(repr(float(capacity)))
    return frac.numerator, frac.denominator


def capacity_tokens(capacity: float | tuple[int, int], seq_len: Any) -> Any:
    """Tokens a routed block processes per sequence of `seq_len` in top-k mode: the one rounding
    function of the project (model, prefill, FLOP counter and tests all call it).

    ``k = floor(capacity * seq_len)`` in exact integer arithmetic on `capacity_ratio` (or on a
    ratio ``(num, den)`` given directly). `seq_len` is an int, or an integer tensor of per-row
    lengths (prefill of prompts of different lengths). When ``capacity * seq_len < 1`` this is 0:
    the block processes no token and every token rides the residual stream unchanged. It is never
    rounded up to 1: that would make a one-token step dense.
    """
    num, den = capacity if isinstance(capacity, tuple) else capacity_ratio(capacity)
    if isinstance(seq_len, int) and seq_len < 0:
        raise ValueError(f"seq_len must be >= 0, got {seq_len}")
    return num * seq_len // den  # <= seq_len since num <= den


@taking_public_names
@dataclass(frozen=True, eq=False, repr=False)
class MoDConfig:
    """Hyper-parameters of a `MoDTransformer`; validated on construction, round-trips via JSON
    (`to_json`/`from_json`) and dicts (`from_dict` takes `to_dict`'s or ``dataclasses.asdict``'s).

    Frozen: a model reads its config throughout, so change one with `dataclasses.replace`, which
    builds the config afresh from what was given and the change (the module docstring says how
    the fields whose default is derived keep what was given).
    """

    vocab_size: int = 257
    d_model: int = 256
    n_layers: int = 8
    n_heads: int = 8
    _n_kv_heads: int | None = None  # n_kv_heads; None: same as n_heads (multi-head attention)
    _d_ff: int | None = None  # d_ff; None: ff_mult * d_model rounded up to a multiple of 32
    ff_mult: float = 8 / 3  # SwiGLU keeps parameters of a 4x GELU MLP at 8/3
    max_seq_len: int = 256
    layer_pattern: str = "DR"
    capacity: float = 0.125
    # ROUTE_KINDS: "joint", "staggered", "mlp" (attention dense) or "mlp_kv" (every token
    # queries, the takers alone are keys and values and take the MLP)
    routing: str = "joint"
    router_gate: str = "sigmoid"
    # "predictor": a small MLP on the block's detached input predicts each token's top-k
    # membership, so the router learns from the LM loss alone; "aux_loss": the router's own
    # logit decides, trained also by a BCE loss towards top-k membership. The predictor is the
    # default: it won the second round of the isoFLOP study (experiments/round2: causal loss
    # 3.832 against 3.859 for the aux loss at 0.01 and 4.051 at 0.1, means of two seeds).
    causal_router: str = "predictor"
    # "random": top-k on fresh N(0, 1) scores with a unit gate, the baseline for learned routing.
    # Its causal decision takes a token with probability `capacity`, or per router (in layer
    # order, comma-separated) `random_take_rates`, e.g. a learned model's measured causal rates:
    # either way compute-matched, not the 50% a threshold of 0 on N(0, 1) noise would give.
    router_scores: str = "learned"
    random_take_rates: str = ""
    # Per router in forward order, the threshold a causal decision's score must exceed (the
    # aux-loss router's logit, or the predictor's); () is 0 for every router. `mod calibrate`
    # fits them so that each causal take-rate on held-out text is the capacity.
    causal_thresholds: tuple[float, ...] = ()
    # aux_loss_weight: the weight of the causal-router loss (the router's BCE, or the
    # predictor's). None: the study's best for the causal router, 0.1 for the predictor (whose
    # BCE never reaches the LM) and 0.01 for the aux loss (0.1 and 1.0 make the router pick what
    # is easy to predict).
    _aux_loss_weight: float | None = None
    predictor_hidden: int = 64
    # "none": a routed token attends only to earlier tokens that took the layer, whose cache
    # holds only them. "residual": the layer computes keys and values of every token from its
    # input (attention pre-norm, K/V projections), so routed tokens attend to all earlier tokens
    # and its cache is as large as a dense layer's.
    skipped_kv: str = "none"
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # Experts (docs/semantics.md, "Experts"): with n_experts > 0 every block's MLP is an expert
    # layer. Pattern "DR": staged MoDE; "D" with no-op experts: integrated MoDE.
    n_experts: int = 0  # 0: the plain SwiGLU MLP
    experts_per_token: int = 1  # token-choice top-k over real and no-op experts
    _d_ff_expert: int | None = None  # d_ff_expert; None: d_ff // experts_per_token (same active)
    n_noop_experts: int = 0  # > 0: integrated MoDE (a no-op expert adds exactly zero)
    expert_capacity_factor: float | None = None  # None: no dropping (training top-k only)
    moe_balance_loss_weight: float = 1e-2  # Switch Transformer's load-balancing loss
    moe_z_loss_weight: float = 1e-3  # ST-MoE's router z-loss
    # Mixture-of-Recursions (docs/mor.md). `recursions` N_r > 1 applies the shared layers N_r
    # times: "middle_cycle" shares layers 1..n-2 (the first and last unique), "cycle" all n.
    # `n_layers` counts unique layers. `recursion_capacities`: one share of the sequence per
    # recursion step, non-increasing, the first 1.0 (every token takes the first pass), e.g.
    # (1.0, 0.5, 0.25); the N_r - 1 routed steps' alone are accepted too. "expert" keeps step r's
    # top share among the tokens still active (None: 1, 1/2, 1/4, ...; a step at 1.0 has no
    # router), "token" gives each token its number of passes up front (one router, a balancing
    # loss). "recursion": a step's attention runs among its tokens, caching theirs; "share":
    # later steps read the first pass's keys and values of every token and cache nothing.
    recursions: int = 1
    recursion_sharing: str = "middle_cycle"
    _recursion_capacities: tuple[float, ...] | None = None  # recursion_capacities
    recursion_router: str = "expert"
    recursion_kv: str = "recursion"

    def __post_init__(self) -> None:
        caps = self._recursion_capacities
        if isinstance(caps, list):  # from JSON: stored as a tuple, as given
            object.__setattr__(self, "_recursion_capacities", tuple(caps))
        # what was given, before anything computes with it (d_ff from ff_mult)
        check_fields(SimpleNamespace(**self._given()), MODEL_RANGES)
        # Derived, not fields (never written over what was given): the resolved values, the
        # topology (and in _check_kinds the capacity as integers).
        object.__setattr__(self, "_resolved", self._resolve())
        object.__setattr__(self, "_topology", Topology.of(self))
        self._check_random_take_rates()
        self._check_causal_thresholds()
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"tie_embeddings must be true or false, got {self.tie_embeddings!r}")

    def _given(self) -> dict[str, Any]:
        """Every field by its public name, as given (None: derived)."""
        return {name: getattr(self, stored_name(name)) for name in FIELD_NAMES}

    def _resolve(self) -> Resolved:
        """The `DERIVED` fields' values (derived.py), with the checks of what they combine
        with."""
        g = SimpleNamespace(**self._given())
        n_kv_heads = kv_heads(g)
        d_ff = mlp_width(g)
        d_ff_expert = expert_width(g, d_ff)
        self._check_kinds()
        caps = checked_recursion(g)  # docs/mor.md
        return Resolved(n_kv_heads, d_ff, aux_loss_weight(g), d_ff_expert, caps)

    def _check_kinds(self) -> None:
        """The layer pattern, the capacity and the string fields, alone and together."""
        if not isinstance(self.layer_pattern, str) or not self.layer_pattern:
            raise ValueError(
                f"layer_pattern must be a non-empty string of 'D'/'R', got {self.layer_pattern!r}"
            )
        bad = sorted(set(self.layer_pattern) - set(LAYER_KINDS))
        if bad:
            allowed = "; ".join(f"{k!r} ({v.description})" for k, v in LAYER_KINDS.items())
            raise ValueError(
                f"layer_pattern={self.layer_pattern!r} has unknown letters {bad}; allowed: "
                + allowed
            )
        object.__setattr__(self, "_capacity_ratio", capacity_ratio(self.capacity))
        object.__setattr__(self, "capacity", float(self.capacity))  # as given, as a float
        for name, allowed in FIELD_CHOICES.items():
            check_choice(name, getattr(self, name), allowed)
        if self.routing == "mlp" and self.skipped_kv == "residual":
            # Refused rather than ignored: it would name a strategy that changes nothing.
            raise ValueError(
                "skipped_kv='residual' has no effect with routing='mlp': attention is already "
                "dense in every layer (every token's key and value are computed and cached); "
                "use skipped_kv='none'"
            )
        if self.routing == "mlp_kv":
            self._check_takers_kv()

    def _check_takers_kv(self) -> None:
        """What ``routing="mlp_kv"`` refuses, by name (docs/semantics.md, "Takers' keys")."""
        if self.skipped_kv == "residual":
            raise ValueError(
                "skipped_kv='residual' with routing='mlp_kv': mlp_kv keys only the router's "
                "takers (every token queries them); residual would key every token, which is "
                "routing='mlp' (attention dense). Use skipped_kv='none' with routing='mlp_kv'"
            )
        if self.recursions > 1:
            raise ValueError(
                f"routing='mlp_kv' with recursions={self.recursions}: a recursive model routes "
                "whole recursion steps (recursion_router), it has no routed layer whose keys "
                "mlp_kv could choose; use routing='joint' (the default) with recursions > 1, "
                "or recursions=1 with routing='mlp_kv'"
            )

    def _check_random_take_rates(self) -> None:
        if isinstance(self.random_take_rates, list | tuple):  # from Python: store as the string
            text = ",".join(repr(float(v)) for v in self.random_take_rates)
            object.__setattr__(self, "random_take_rates", text)
        if not isinstance(self.random_take_rates, str):
            raise ValueError(
                "random_take_rates must be comma-separated rates, one per router, got "
                f"{self.random_take_rates!r}"
            )
        if not self.random_take_rates:
            return
        if self.router_scores != "random":
            raise ValueError(
                f"random_take_rates={self.random_take_rates!r} needs router_scores='random', "
                f"where the noise itself decides (got router_scores={self.router_scores!r})"
            )
        n = self.n_routers
        try:
            rates = [float(v) for v in self.random_take_rates.split(",")]
        except ValueError:
            rates = []
        if len(rates) != n or not all(0.0 < v < 1.0 for v in rates):
            raise ValueError(
                f"random_take_rates={self.random_take_rates!r}: give {n} rates strictly between 0 "
                f"and 1, one per router in layer order ({len(self.routed_layers)} routed layers, "
                f"{self.routing} routing)"
            )

    def _check_causal_thresholds(self) -> None:
        given = self.causal_thresholds
        try:  # from JSON a list, from Python any sequence: stored as a tuple of floats
            values = tuple(float(v) for v in given)
        except (TypeError, ValueError):
            values = None
        if isinstance(given, str) or values is None or not all(map(math.isfinite, values)):
            raise ValueError(
                f"causal_thresholds must be finite numbers, one per router, got {given!r}"
            )
        if values and len(values) != self.n_routers:
            where = (
                f"{len(self.recursion_routed_steps)} routed recursion steps, "
                f"{self.recursion_router} choice"
                if self.recursive
                else f"{len(self.routed_layers)} routed layers, {self.routing} routing"
            )
            raise ValueError(
                f"causal_thresholds={values!r}: give {self.n_routers} thresholds, one per router "
                f"in forward order ({where}), or none"
            )
        if values and self.router_scores == "random":
            raise ValueError("causal_thresholds need learned router scores (random ones decide "
                             "by their own noise)")  # fmt: skip
        object.__setattr__(self, "causal_thresholds", values)

    # -- the resolved values of the DERIVED fields -------------------------------------------------
    @property
    def n_kv_heads(self) -> int:
        """Key/value heads (grouped-query attention): as given, else n_heads."""
        return self._resolved.n_kv_heads

    @property
    def d_ff(self) -> int:
        """The MLP's hidden width: as given, else ff_mult * d_model rounded up to 32s."""
        return self._resolved.d_ff

    @property
    def aux_loss_weight(self) -> float:
        """The causal-router loss's weight: as given, else by the causal router (the fields)."""
        return self._resolved.aux_loss_weight

    @property
    def d_ff_expert(self) -> int | None:
        """An expert's hidden width: as given, else d_ff // experts_per_token (None: none)."""
        return self._resolved.d_ff_expert

    @property
    def recursion_capacities(self) -> tuple[float, ...] | None:
        """Expert choice: one share of the sequence per recursion step, the first 1.0 (halving
        at each step where none was given); None without recursion or with token choice."""
        return self._resolved.recursion_capacities

    # -- the topology (topology.py) ---------------------------------------------------------------
    @property
    def topology(self) -> Topology:
        """The layers' kinds, the routes and their numbering, the recursion's steps and the KV
        cache's layout: derived once, read by the model, the caches and the FLOP count."""
        return self._topology

    @property
    def recursive(self) -> bool:
        return self.recursions > 1

    @property
    def recursion_routed_steps(self) -> list[int]:
        """The recursion steps (1 .. recursions - 1) with a router: all with token choice;
        with expert choice those below capacity 1 (a step at 1.0 is every token's)."""
        return list(self._topology.recursion_routed_steps)

    def recursion_capacity(self, step: int) -> float:
        """The share of the sequence that takes recursion step `step` (0: every token): expert
        choice's `recursion_capacities` entry; token choice's when its depths are balanced,
        (N_r - step) / N_r."""
        if not self.recursive or not 0 <= step < self.recursions:
            raise ValueError(
                f"recursion step {step!r}: this model's steps are 0 .. {self.recursions - 1} "
                f"(recursions={self.recursions})"
            )
        return self._topology.step_shares[step]

    def recursion_tokens(self, step: int, seq_len: Any) -> Any:
        """Expert choice: the tokens per row of `seq_len` that take recursion step `step`."""
        return capacity_tokens(self.recursion_capacity(step), seq_len)

    @property
    def recursion_layers(self) -> tuple[list[int], list[int], list[int]]:
        """The unique layers before the recursion, the shared ones, and those after it."""
        pre, shared, post = self._topology.recursion_layers
        return list(pre), list(shared), list(post)

    @property
    def layer_schedule(self) -> list[tuple[int, int | None]]:
        """Every application of a layer in forward order: (layer, recursion step), step None for
        a unique layer of "middle_cycle". Its index is the application's KV-cache layer."""
        return list(self._topology.layer_schedule)

    @property
    def n_kv_layers(self) -> int:
        """Layers of a KV cache: one per application of a layer (`layer_schedule`)."""
        return self._topology.n_kv_layers

    def kv_share(self, layer: int) -> float:
        """The share of tokens KV-cache layer `layer` holds when routing takes the capacity: 1
        for every-token layers, the capacity for routed ones, a recursion step's share (0 for a
        later step with ``recursion_kv="share"``: it reads the first pass's)."""
        return self._topology.kv_shares[layer]

    @property
    def n_routers(self) -> int:
        """Routers in the model: one per routed layer and route kind (`ROUTE_KINDS`); in a
        recursive model one per routed step with expert choice (token choice decides exactly:
        no causal threshold)."""
        return self._topology.n_routers

    def causal_threshold(self, router: int) -> float:
        """The threshold of router number `router` (forward order) on its causal score."""
        return self.causal_thresholds[router] if self.causal_thresholds else 0.0

    def random_take_rate(self, router: int) -> float:
        """The causal take-probability of random router number `router` (in layer order)."""
        if not self.random_take_rates:
            return self.capacity
        return float(self.random_take_rates.split(",")[router])

    @property
    def has_experts(self) -> bool:
        return self.n_experts > 0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def layer_kinds(self) -> str:
        """The pattern tiled over the layers, one letter per layer: e.g. ``"DRDRDRDR"``."""
        return self._topology.layer_kinds

    @property
    def routed_layers(self) -> list[int]:
        """The layers whose kind lets a router pick the tokens (LAYER_KINDS[...].routed)."""
        return list(self._topology.routed_layers)

    @property
    def has_predictor(self) -> bool:
        """Whether the routed blocks carry predictors: in predictor mode, except under random
        scores, whose causal decision is their own noise (a predictor would have nothing to
        learn)."""
        token = self.recursive and self.recursion_router == "token"  # decides exactly
        return self.causal_router == "predictor" and self.router_scores == "learned" and not token

    @property
    def is_dense(self) -> bool:
        """No router anywhere (a recursive model whose steps every token takes is dense too)."""
        return not self.routed_layers and not self.recursion_routed_steps

    @property
    def full_kv_layers(self) -> list[int]:
        """The layers whose KV cache holds every token: dense ones, and routed ones too with
        ``skipped_kv="residual"`` or ``routing="mlp"`` (attention dense); with
        ``routing="mlp_kv"`` a routed layer holds its takers alone, as joint routing's does."""
        return list(self._topology.full_kv_layers)

    @property
    def capacity_ratio(self) -> tuple[int, int]:
        """The capacity as an exact fraction (numerator, denominator) of its decimal value."""
        return self._capacity_ratio

    def capacity_tokens(self, seq_len: Any) -> Any:
        """`capacity_tokens` at this capacity, on the precomputed ratio: plain integer arithmetic
        that torch.compile traces (building a `Fraction` would break the graph)."""
        return capacity_tokens(self._capacity_ratio, seq_len)

    def dense_twin(self) -> MoDConfig:
        """The same model with every block dense: the baseline of the same size. With experts,
        each MLP becomes the plain SwiGLU of the same active size (``d_ff = experts_per_token *
        d_ff_expert``): the dense model a token's FLOPs are compared with. A recursive model's
        twin is the same unique layers without recursion."""
        if self.recursive:
            return dataclasses.replace(
                self, recursions=1, recursion_sharing="middle_cycle", recursion_capacities=None,
                recursion_router="expert", recursion_kv="recursion", causal_thresholds=(),
            )  # fmt: skip
        # no routers: nothing to route, no thresholds (a calibrated model's twin is still dense)
        unrouted = dict(
            layer_pattern="D",
            skipped_kv="none",
            routing="joint",
            causal_thresholds=(),
            router_scores="learned",
            random_take_rates="",
        )
        if not self.has_experts:
            return dataclasses.replace(self, **unrouted)
        return dataclasses.replace(
            self,
            **unrouted,
            d_ff=self.experts_per_token * self.d_ff_expert,
            n_experts=0,
            experts_per_token=1,
            d_ff_expert=None,
            n_noop_experts=0,
            expert_capacity_factor=None,
        )

    # -- equality and serialisation: by the resolved values ------------------------------------
    def resolved(self) -> dict[str, Any]:
        """Every field's resolved value by its public name (what `to_dict` writes)."""
        return {name: getattr(self, name) for name in FIELD_NAMES}

    def __eq__(self, other: object) -> bool:
        """Equal when they build the same model: the same resolved value of every field, whether
        given or derived (``MoDConfig() == MoDConfig(d_ff=704)``)."""
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self.resolved() == other.resolved()

    def __hash__(self) -> int:
        return hash(tuple(self.resolved().values()))

    def __repr__(self) -> str:
        return f"MoDConfig({', '.join(f'{k}={v!r}' for k, v in self.resolved().items())})"

    def to_dict(self) -> dict[str, Any]:
        """The resolved values as JSON has them (tuples as lists): what `to_json` writes,
        explicit, so that it loads to this very model whatever later versions derive."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.resolved().items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MoDConfig:
        """The config of `to_dict`'s resolved values (a checkpoint's JSON), where a `DERIVED`
        value equal to its derivation from the others counts as not given (`derived.as_given`:
        the same model, and under ``replace`` as the fresh config saved); or of
        ``dataclasses.asdict``'s fields (``_d_ff``, ...), taken as given, exactly."""
        private = {stored_name(name): name for name in DERIVED}
        unknown = sorted(set(d) - set(FIELD_NAMES) - set(private))
        if unknown:
            raise ValueError(f"unknown MoDConfig fields {unknown}; known: {sorted(FIELD_NAMES)}")
        both = [f"{name} and {p}" for p, name in private.items() if p in d and name in d]
        if both:
            raise ValueError(f"both {', '.join(both)} given: give one of each")
        given = {private[k]: v for k, v in d.items() if k in private}
        resolved = {k: v for k, v in d.items() if k not in private}
        return as_given(lambda fields: cls(**fields, **given), resolved)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if path is not None:
            atomic_write_text(Path(path), text + "\n")
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> MoDConfig:
        p = Path(text_or_path)
        text = (
            p.read_text() if not str(text_or_path).lstrip().startswith("{") else str(text_or_path)
        )
        return cls.from_dict(json.loads(text))

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> MoDConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
        base = PRESETS[name]
        caps = base.get("recursion_capacities")
        other = overrides.get("recursions", base.get("recursions")) != base.get("recursions")
        if caps and other and "recursion_capacities" not in overrides:
            # its capacities are one per step of its own recursions: read for another number of
            # steps they would mean other steps (or be refused)
            raise ValueError(
                f"preset {name!r} sets recursion_capacities={caps} for its "
                f"recursions={base.get('recursions')}; with recursions="
                f"{overrides['recursions']!r} give recursion_capacities too (None: halve "
                "at each step)"
            )
        return cls(**{**base, **overrides})


# The allowed range of every numeric field, checked in one place (`checks.check_fields`).
MODEL_RANGES: dict[str, Range] = {
    **dict.fromkeys(("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"), POSITIVE_INT),
    "n_kv_heads": Range(lo=1, integer=True, optional=True),
    "d_ff": Range(lo=1, integer=True, optional=True),
    "predictor_hidden": POSITIVE_INT,
    "ff_mult": Range(lo=0, hi=1024, lo_open=True),
    "capacity": SHARE,
    "aux_loss_weight": Range(lo=0, optional=True),
    "rope_theta": POSITIVE,
    "norm_eps": Range(lo=0, hi=1, lo_open=True),
    "init_std": POSITIVE,
    "n_experts": Range(lo=0, hi=4096, integer=True),
    "experts_per_token": Range(lo=1, hi=64, integer=True),
    "d_ff_expert": Range(lo=1, integer=True, optional=True),
    "n_noop_experts": Range(lo=0, hi=4096, integer=True),
    "expert_capacity_factor": Range(lo=0, lo_open=True, optional=True),
    "moe_balance_loss_weight": Range(lo=0),
    "moe_z_loss_weight": Range(lo=0),
    "recursions": Range(lo=1, hi=16, integer=True),
}

# Every field by the name the constructor, `to_dict` and the CLI give it, in field order.
FIELD_NAMES = tuple(f.name.removeprefix("_") for f in dataclasses.fields(MoDConfig))
