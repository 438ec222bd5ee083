"""`mod train`'s advice for long contexts (docs/semantics.md, 'What a routed layer can and
cannot see'): given where a routed layer leaves the tokens that skip it without attention to
the whole context, not elsewhere."""

from __future__ import annotations

import pytest

from mixture_of_depths import MoDConfig
from mixture_of_depths.cli.train import long_context_note


@pytest.mark.parametrize(
    "preset, over, seq_len, advised",
    [
        ("small", {}, 1024, True),  # joint routing: skippers compute no attention
        ("small", {"routing": "staggered"}, 2048, True),
        ("small", {}, 1023, False),  # shorter than where it was measured
        ("small-long", {}, 1024, False),  # attention already dense
        ("small", {"routing": "mlp_kv"}, 1024, True),  # skippers read only the takers' keys
        ("small-long-dense", {}, 1024, False),
        ("small-mor", {"max_seq_len": 1024}, 1024, False),  # no routed layers: recursion
    ],
)
def test_long_context_advice_wherever_skippers_lose_attention_to_the_context(
    preset, over, seq_len, advised
):
    cfg = MoDConfig.preset(preset, **{"max_seq_len": max(seq_len, 256), **over})
    note = long_context_note(cfg, seq_len)
    assert (note is not None) == advised
    if advised:
        assert f"routing={cfg.routing!r}" in note and "--routing mlp" in note


def test_the_long_context_presets_differ_from_small_only_where_they_say():
    small, long, dense = (MoDConfig.preset(n) for n in ("small", "small-long", "small-long-dense"))
    assert long.max_seq_len == dense.max_seq_len == 1024
    assert long.routing == "mlp" and long.routed_layers == small.routed_layers
    assert dense.is_dense and (dense.d_model, dense.n_layers) == (small.d_model, small.n_layers)
