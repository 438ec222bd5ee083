"""``routing="mlp_kv"``: in a routed layer every token queries the attention, but only the
router's takers are its keys and values (and take the MLP). docs/semantics.md ("Takers' keys")
states the rule. This module is its attention sub-block on every path (`attend`, in each mode of
the routing executor, selection.py), and its cost. The MLP half is `RoutedBlock`'s routed MLP,
run on the takers and gated by the router's weight.

Token i attends to the takers at positions <= i (a taker sees itself, a skipper the earlier
takers), keys rotated at their original positions; its update ``attn(attn_norm(x))`` is not
gated. A token with no such taker gets a zero update. Its softmax row would be empty (NaN), so
SDPA is given its first key (`open_empty_rows`) and the result is dropped (`keep`; `torch.where`
gives the dropped value no gradient).

Names with shape suffixes: B batch, T tokens, K takers (top-k), S cached slots, N decode rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .config import MoDConfig
from .layers import LayerCost, LayerKV, price
from .selection import GATHERED


def open_empty_rows(see: Tensor) -> tuple[Tensor, Tensor]:
    """`see` (..., queries, keys) bool with each query row that sees no key given its first
    (SDPA never softmaxes over nothing; `keep` drops what that row computes), and whether each
    query sees a key (..., queries)."""
    has = see.any(-1)
    first = torch.arange(see.shape[-1], device=see.device) == 0
    return see | (first & ~has.unsqueeze(-1)), has


def keep(a: Tensor, has: Tensor) -> Tensor:
    """The attention update `a` (..., D) where `has` (...) says a query saw a key, else 0."""
    return torch.where(has.unsqueeze(-1), a, a.new_zeros(()))


def attend(block: Any, x_BTD: Tensor, s: Any) -> Tensor:
    """Every token's attention update over the takers of `s` (a `selection.Selection`), in its
    mode: "topk", the k takers' keys and values projected from their own stream at their
    original positions (none: nothing is computed; "packed" likewise, its padding no key);
    "masked", every token computed, query i seeing the takers at positions <= i; decoding,
    the taking rows append their key and value ("device": every row, a skipper's to the trash
    slot), then every row reads all its row holds (nothing held anywhere: nothing is
    computed). A prefill stores the takers."""
    p, layer, attn = s.p, block.layer, block.attn
    if s.mode in GATHERED and s.empty:
        return torch.zeros_like(x_BTD)
    h_BTD = block.attn_norm(x_BTD)
    T = h_BTD.shape[1]
    if s.mode in GATHERED:  # "packed": its padding is no key
        key, value = attn.kv(s.gather(h_BTD), s.cos, s.sin)
        if p.cache is not None:
            p.cache.write_prefill(layer, key, value, s.valid)
        see = s.idx[:, None, :] <= torch.arange(T, device=h_BTD.device)[None, :, None]
        if s.valid is not None:
            see = see & s.valid[:, None, :]
        mask, has = open_empty_rows(see)
        return keep(attn(h_BTD, p.cos, p.sin, None, LayerKV(key, value, mask.unsqueeze(1))), has)
    if s.mode == "masked":
        lower = torch.ones(T, T, dtype=torch.bool, device=h_BTD.device).tril()
        mask, has = open_empty_rows(lower & s.take[:, None, :])
        kv = p.kv(layer, s.take)
        return keep(attn(h_BTD, p.cos, p.sin, mask.unsqueeze(1), kv), has)
    if s.mode == "device":
        q, key, value = attn.qkv(h_BTD, p.cos, p.sin)
        p.cache.append(layer, key, value, s.take[:, 0])
    elif not s.empty:
        s.view.append(layer, *attn.kv(s.gather(h_BTD), s.cos, s.sin))
    keys, values, valid = p.cache.read(layer)
    if keys.shape[2] == 0:
        return torch.zeros_like(x_BTD)
    if s.mode == "rows":
        q = attn.q(h_BTD, p.cos, p.sin)
    if valid is None:  # every row sees every slot it was given
        return attn.attend(q, keys, values, None)
    mask, has = open_empty_rows(valid)
    return keep(attn.attend(q, keys, values, mask), has.view(-1, 1))


def cost(
    cfg: MoDConfig,
    tokens: float,
    queries: float | None,
    takers: float | None,
    keys: float | None,
    predicted: float,
    expert_share: float,
) -> LayerCost:
    """A routed layer's work (`RoutedBlock.cost`): `takers` (default: top-k's k) project a
    query, key and value and run the MLP, the other `queries` (default: every token) a query;
    each query reads `keys` keys (default: the takers). Top-k without a taker, or a step whose
    layer holds no key (`keys` given as 0), computes no attention at all. The router weighs
    every token, except on a causal step in predictor mode: there it gates the takers alone."""
    topk = takers is None
    takers = cfg.capacity_tokens(int(tokens)) if topk else takers
    queries = tokens if queries is None else queries
    if (topk and not takers) or keys == 0:  # nothing to attend to: no query is projected
        queries = takers
    keys = takers if keys is None else keys
    routed = takers if predicted and not topk else tokens
    q_only = queries - takers
    return price(cfg, takers, takers, keys, routed, predicted, expert_share, q_only=q_only)
