"""The fields of `MoDConfig` whose default follows from other fields, the `DERIVED` five: how
each resolves from what was given, and the constructor that takes them by their public names.

A config stores what was given of them, None where nothing was (a private dataclass field,
``_d_ff``), and reads the resolved value by the public name (``cfg.d_ff``, a property), so that
``dataclasses.replace`` builds the config afresh from what was given and re-derives them
(config.py's docstring says why; docs/semantics.md, "The config"). The functions here read `g`,
every field of a config as given, by its public name.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any, NamedTuple

MAX_D_FF = 1 << 20  # a sanity bound on the MLP width derived from ff_mult
DERIVED = ("n_kv_heads", "d_ff", "aux_loss_weight", "d_ff_expert", "recursion_capacities")


class Resolved(NamedTuple):
    """The `DERIVED` fields' values as the model uses them."""

    n_kv_heads: int
    d_ff: int
    aux_loss_weight: float
    d_ff_expert: int | None  # None without experts
    recursion_capacities: tuple[float, ...] | None  # None without expert-choice recursion


def stored_name(name: str) -> str:
    """The dataclass field that stores what was given for field `name` (a public name)."""
    return "_" + name if name in DERIVED else name


def taking_public_names(cls: type) -> type:
    """Make a dataclass's constructor (and so `dataclasses.replace`) take the `DERIVED` fields
    by their public names. `replace` passes the private fields too, with the old config's given
    values: a public name given beside one overrides it. The class's `__dataclass_fields__` is
    keyed by the public names (each still the private field), so that code looking a field up
    by name (``__dataclass_fields__["aux_loss_weight"].default``) finds it."""
    init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        for name in DERIVED:
            if name in kwargs:
                kwargs[stored_name(name)] = kwargs.pop(name)
        init(self, *args, **kwargs)

    sig = inspect.signature(init)
    params = [p.replace(name=p.name.removeprefix("_")) for p in sig.parameters.values()]
    __init__.__signature__ = sig.replace(parameters=params)  # what help() and IDEs show
    __init__.__qualname__ = init.__qualname__
    cls.__init__ = __init__
    fields = cls.__dataclass_fields__
    cls.__dataclass_fields__ = {f.name.removeprefix("_"): f for f in fields.values()}
    return cls


def as_given(build: Callable[[dict[str, Any]], Any], fields: dict[str, Any]) -> Any:
    """The config `build(fields)` builds from resolved values (a checkpoint's JSON), with each
    `DERIVED` value that equals its derivation from the other fields taken as not given: the
    same model, re-derived under ``replace`` as a config that left it unset (the saved one,
    where it did) would be. In `DERIVED` order: a later field may derive from an earlier one."""
    cfg = build(fields)
    resolved = cfg.resolved()
    for name in DERIVED:
        if fields.get(name) is None:
            continue
        trial = {**fields, name: None}
        try:
            unset = build(trial)
        except ValueError:  # its derivation is refused here: it stays given
            continue
        if unset.resolved() == resolved:
            fields, cfg = trial, unset
    return cfg


def kv_heads(g: Any) -> int:
    """`n_kv_heads` (as given, else `n_heads`), checked with the heads and the width."""
    n_kv = g.n_heads if g.n_kv_heads is None else g.n_kv_heads
    if g.d_model % g.n_heads:
        raise ValueError(
            f"n_heads={g.n_heads} must divide d_model={g.d_model} "
            f"(d_model % n_heads = {g.d_model % g.n_heads})"
        )
    if (g.d_model // g.n_heads) % 2:
        raise ValueError(
            f"head dim d_model/n_heads = {g.d_model // g.n_heads} must be even for RoPE"
        )
    if g.n_heads % n_kv:
        raise ValueError(
            f"n_kv_heads={n_kv} must divide n_heads={g.n_heads} (grouped-query "
            "attention shares each key/value head among a whole number of query heads)"
        )
    return n_kv


def mlp_width(g: Any) -> int:
    """`d_ff`: as given, else ``ff_mult * d_model`` rounded up to a multiple of 32."""
    if g.d_ff is not None:
        return g.d_ff
    d_ff = 32 * math.ceil(g.ff_mult * g.d_model / 32)
    if d_ff > MAX_D_FF:
        raise ValueError(
            f"ff_mult={g.ff_mult} gives d_ff={d_ff}, more than {MAX_D_FF}: "
            "give a smaller ff_mult (8/3 is the usual SwiGLU size)"
        )
    return d_ff


def expert_width(g: Any, d_ff: int) -> int | None:
    """`d_ff_expert`: as given, else ``d_ff // experts_per_token`` (the MLP's active
    parameters); None without experts, where the expert fields are refused."""
    if g.n_experts == 0:
        given = {
            "n_noop_experts": g.n_noop_experts or None,
            "expert_capacity_factor": g.expert_capacity_factor,
            "experts_per_token": None if g.experts_per_token == 1 else 1,
            "d_ff_expert": g.d_ff_expert,
        }
        if any(v is not None for v in given.values()):
            got = ", ".join(f"{k}={getattr(g, k)}" for k, v in given.items() if v is not None)
            raise ValueError(
                "n_noop_experts, expert_capacity_factor, experts_per_token and d_ff_expert "
                f"need an expert layer: set n_experts > 0 (got n_experts=0, {got})"
            )
        return None
    choices = g.n_experts + g.n_noop_experts
    if g.experts_per_token > choices:
        raise ValueError(
            f"experts_per_token={g.experts_per_token} is more than the "
            f"{choices} experts (n_experts + n_noop_experts) a token can choose from"
        )
    return max(1, d_ff // g.experts_per_token) if g.d_ff_expert is None else g.d_ff_expert


def aux_loss_weight(g: Any) -> float:
    """As given, else the study's best for the causal router: 0.1 for the predictor, 0.01 for
    the aux loss, and Switch's balancing weight 0.01 for token-choice recursion."""
    if g.aux_loss_weight is not None:
        return g.aux_loss_weight
    token = g.recursions != 1 and g.recursion_router == "token"
    return 0.01 if g.causal_router == "aux_loss" or token else 0.1
