"""The Mixture-of-Recursions test models' shape and the cases both MoR test modules run: expert
and token choice, both KV strategies, cycle sharing with the aux-loss router."""

from __future__ import annotations

from helpers import V

from mixture_of_depths import MoDConfig


def mor_config(**overrides) -> MoDConfig:
    base = dict(
        vocab_size=V, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=64,
        layer_pattern="D", recursions=3, recursion_capacities=(0.5, 0.3), predictor_hidden=16,
    )  # fmt: skip
    return MoDConfig(**{**base, **overrides})


CASES = [
    dict(),
    dict(recursion_kv="share"),
    dict(causal_router="aux_loss", recursion_sharing="cycle", n_layers=2),
    dict(recursion_router="token", recursion_capacities=None),
    dict(recursion_router="token", recursion_capacities=None, recursion_kv="share"),
]
IDS = ["expert", "expert-share", "cycle-aux", "token", "token-share"]
