"""Every decode path through the one driver pair (`generate.prefill`, `generate.decode_step`)
on every configuration a model can take: routing (joint, staggered, MLP-only, takers' keys) x
skipped_kv (none, residual) x MoDE (none, staged, integrated) x MoR (expert and token choice,
recursion-wise and shared KV). The static cache's greedy tokens equal `generate`'s, and the
server's greedy completions equal `generate_reference`'s, token for token in float64 (docs/
semantics.md, "Numerics and tests"); a configuration the config cannot build is refused by name.
"""

from __future__ import annotations

import pytest
import torch
from generate_helpers import make_prompts, served_and_reference
from helpers import make_model, random_tokens, tiny_config

from mixture_of_depths import generate, selection
from mixture_of_depths.cache import KVCache
from mixture_of_depths.generate import decode_step, prefill, right_pad
from mixture_of_depths.static_cache import StaticKVCache, static_generate

F64 = torch.float64
STAGED = dict(n_experts=2, experts_per_token=1)  # expert MLPs in the MoD blocks
INTEGRATED = dict(layer_pattern="D", n_experts=2, n_noop_experts=1, experts_per_token=1)
MOR = dict(layer_pattern="D", recursions=3, causal_router="predictor")
CELLS: dict[str, dict] = {
    f"{routing}-{kv}-{mode}": dict(routing=routing, skipped_kv=kv, **experts)
    for routing in ("joint", "staggered", "mlp", "mlp_kv")
    for kv in ("none", "residual")
    for mode, experts in (("moe-none", {}), ("mode-staged", STAGED))
}
CELLS |= {
    "joint-aux_loss": dict(routing="joint", causal_router="aux_loss"),
    "mode-integrated": INTEGRATED,
    "mor-expert-recursion": dict(MOR, recursion_capacities=(0.5, 0.3)),
    "mor-expert-share": dict(MOR, recursion_capacities=(0.5, 0.3), recursion_kv="share"),
    "mor-expert-cycle-aux": dict(MOR, recursion_sharing="cycle", causal_router="aux_loss"),
    "mor-token-recursion": dict(MOR, recursion_router="token"),
    "mor-token-share": dict(MOR, recursion_router="token", recursion_kv="share"),
}
# The cells the config refuses, and the words its error names them by.
REFUSED = {
    f"{routing}-residual-{mode}": (f"routing='{routing}'", "skipped_kv='residual'")
    for routing in ("mlp", "mlp_kv")
    for mode in ("moe-none", "mode-staged")
}
SERVED = [name for name in CELLS if name not in REFUSED]


def cell_model(name: str, seed: int = 0):  # noqa: ANN201
    """The float64 test model of a cell, predictors calibrated to take about half the tokens."""
    cfg = tiny_config(**{"max_seq_len": 64, "capacity": 0.3, **CELLS[name]})
    return make_model(cfg, seed, F64, take=0.5, calib_idx=random_tokens(4, 32, seed + 100))


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_configuration_the_config_cannot_build_is_refused_by_name(name):
    with pytest.raises(ValueError) as err:
        tiny_config(**CELLS[name])
    for words in REFUSED[name]:
        assert words in str(err.value), (name, str(err.value))


@pytest.mark.parametrize("name", SERVED)
def test_static_decode_equals_generate_on_every_configuration(name):
    """The static cache's masked decode step (every row, masks, a trash slot: no host read)
    against the KV cache's rows, prompts of unequal lengths (slots ample: no overflow)."""
    model = cell_model(name)
    prompts = make_prompts()
    want = generate(model, prompts, 10, temperature=0).tokens
    assert static_generate(model, prompts, 10, headroom=4.0) == want


@pytest.mark.parametrize("name", ["joint-residual-mode-staged", "mlp_kv-none-moe-none",
                                  "mor-token-share", "mor-expert-recursion"])  # fmt: skip
def test_the_driver_pair_decodes_a_static_cache_as_a_kv_cache(name):
    """`prefill` and `decode_step`, the one driver pair, over a `KVCache` and over a
    `StaticKVCache` (eagerly: its decode step under masks): the same greedy tokens."""
    model = cell_model(name)
    idx, lens = right_pad(make_prompts(), "cpu")
    got = {}
    for kind, kw in ((KVCache, {}), (StaticKVCache, dict(headroom=4.0))):  # no overflow
        cache = kind(model.config, len(lens), int(lens.max()) + 8, dtype=F64, **kw)
        logits, _ = prefill(model, idx, lens, cache)
        tokens = [logits.argmax(-1)]
        for _ in range(7):
            tokens.append(decode_step(model, tokens[-1], cache)[0].argmax(-1))
        got[kind] = torch.stack(tokens, 1).tolist()
    assert got[KVCache] == got[StaticKVCache]


@pytest.mark.parametrize("static", [False, True], ids=["entries", "static-step"])
@pytest.mark.parametrize("name", SERVED)
def test_served_greedy_completions_equal_the_reference_on_every_configuration(name, static):
    """Prompts of several lengths served together (a chunked prefill, rows that join and
    leave): each completion equals the no-cache reference for its prompt alone, with decode
    steps run as the paged cache's entries or through the static step (CUDA's default)."""
    got, want = served_and_reference(cell_model(name), static_decode=static)
    assert got == want


@pytest.mark.parametrize("mode", ["causal", "topk"])
@pytest.mark.parametrize("name", SERVED)
def test_a_packed_prefill_equals_the_masked_reference(name, mode, monkeypatch):
    """A prefill into a cache gathers each row's takers ("packed", selection.py): its logits,
    decisions and stored keys and values equal the masked forward's, which computes every
    token and keeps the takers', on right-padded prompts (float64)."""
    model = cell_model(name)
    idx, lens = right_pad(make_prompts(), "cpu")
    got = {}
    for pack in (False, True):
        monkeypatch.setattr(selection, "PACK_PREFILL", pack)
        cache = KVCache(model.config, len(lens), int(lens.max()), dtype=F64)
        out = model(idx, routing=mode, cache=cache, lengths=lens)
        stored = [
            (kv[r, :, :n], vv[r, :, :n])
            for kv, vv, lengths in zip(cache.k, cache.v, cache.lengths, strict=True)
            for r, n in enumerate(lengths.tolist())
        ]
        got[pack] = out.logits, [route.mask for route in out.routes], cache.lengths, stored
    (want_logits, want_takes, want_lens, want_kv), (logits, takes, lengths, kv) = got.values()
    valid = torch.arange(idx.shape[1])[None, :] < lens[:, None]
    torch.testing.assert_close(logits[valid], want_logits[valid], rtol=1e-10, atol=1e-10)
    assert all(torch.equal(a, b) for a, b in zip(takes, want_takes, strict=True))
    assert torch.equal(lengths, want_lens) and int(lengths.sum()) < lengths.numel() * idx.shape[1]
    for (k, v), (want_k, want_v) in zip(kv, want_kv, strict=True):
        torch.testing.assert_close((k, v), (want_k, want_v), rtol=1e-10, atol=1e-10)
