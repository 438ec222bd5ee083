"""What the recursion fields of `MoDConfig` may hold (docs/mor.md): `recursions`,
`recursion_sharing`, `recursion_capacities`, `recursion_router`, `recursion_kv`, checked against
each other and the rest of the config, the capacities in their one resolved form."""

from __future__ import annotations

from typing import Any


def checked_recursion(cfg: Any) -> tuple[float, ...] | None:
    """Refuse recursion fields of `cfg` (the fields of a `MoDConfig` being built, as given, by
    their public names; typed loosely, as config.py imports this module) that do not fit
    together, with a ValueError naming the value and what is allowed, and return
    `recursion_capacities` resolved: one share per recursion step, the first 1.0 (expert choice;
    None without recursion or with token choice; halving at each step where none was given).
    The routed steps' shares alone (N_r - 1 of them) are read as the steps after the first."""
    defaults = {"recursion_sharing": "middle_cycle", "recursion_router": "expert",
                "recursion_kv": "recursion", "recursion_capacities": None}  # fmt: skip
    if cfg.recursions == 1:
        odd = {k: getattr(cfg, k) for k, v in defaults.items() if getattr(cfg, k) != v}
        if odd:
            raise ValueError(f"{odd} need recursions > 1 (got recursions=1, no recursion)")
        return None
    why = {
        "layer_pattern": (cfg.layer_pattern == "D", "'D' (the recursion routers route)"),
        "n_experts": (cfg.n_experts == 0, "0 (expert layers in a recursion: unsupported)"),
        "skipped_kv": (cfg.skipped_kv == "none", "'none' (recursion_kv says what a "
                       "step's attention reads)"),
        "router_scores": (cfg.router_scores == "learned", "'learned'"),
    }  # fmt: skip
    for name, (ok, allowed) in why.items():
        if not ok:
            raise ValueError(
                f"{name}={getattr(cfg, name)!r} with recursions={cfg.recursions}: a "
                f"recursive model needs {name}={allowed}"
            )
    least = 3 if cfg.recursion_sharing == "middle_cycle" else 1
    if cfg.n_layers < least:
        raise ValueError(
            f"recursion_sharing={cfg.recursion_sharing!r} needs n_layers >= {least} (the "
            f"first and last layers unique, at least one shared), got {cfg.n_layers}"
        )
    caps = cfg.recursion_capacities
    n = cfg.recursions - 1  # the steps after the first, which can be routed
    if cfg.recursion_router == "token":
        if caps is not None:
            raise ValueError(
                f"recursion_capacities={caps!r} is for recursion_router='expert': the token-"
                "choice router gives each token its number of passes itself"
            )
        return None
    if caps is None:
        caps = tuple(0.5**r for r in range(n + 1))
    try:
        caps = tuple(float(c) for c in caps)
    except (TypeError, ValueError):
        caps = ()
    given = len(caps)
    if given == n:  # the routed steps' shares alone: the first pass is every token's
        caps = (1.0, *caps)
    why = (
        f"{given} share{'s' if given != 1 else ''} for {n + 1} recursion steps"
        if len(caps) != n + 1
        else "a share outside (0, 1]"
        if not all(0 < c <= 1 for c in caps)
        else f"the first is {caps[0]:g}, not 1.0"
        if caps[0] != 1.0
        else "the shares increase"
        if list(caps) != sorted(caps)[::-1]
        else ""
    )
    if why:
        example = ", ".join(f"{0.5**r:g}" for r in range(n + 1))
        routed = "routed step's" if n == 1 else f"{n} routed steps'"
        raise ValueError(
            f"recursion_capacities={cfg.recursion_capacities!r}: {why}; give {n + 1} shares "
            f"in (0, 1], non-increasing, one per recursion step, the first 1.0 (every token "
            f"takes the first pass), e.g. ({example}), or the {routed} alone "
            f"(recursions={cfg.recursions})"
        )
    return caps
