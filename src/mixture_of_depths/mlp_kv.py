"""``routing="mlp_kv"``: in a routed layer every token queries the attention, but only the
router's takers are its keys and values (and take the MLP). docs/semantics.md ("Takers' keys")
states the rule. This module is its attention sub-block on every path, and its cost: top-k
(training), every token under a mask (causal evaluation, prefill), the rows of a decode step
(the decisions on the host) and the static cache's masked decode step. The MLP half is
`RoutedBlock`'s routed MLP, run on the takers and gated by the router's weight.

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


def attend_topk(block: Any, x_BTD: Tensor, idx_BK: Tensor, p: Any) -> Tensor:
    """Every token's attention update in the top-k forward: T queries over the keys and values
    of the k takers `idx_BK` (sorted), projected from their own stream at their original
    positions; a top-k prefill stores them in the cache. No taker: nothing is computed."""
    B, T, D = x_BTD.shape
    k = idx_BK.shape[1]
    if k == 0:
        return torch.zeros_like(x_BTD)
    h_BTD = block.attn_norm(x_BTD)
    # Flat row indices into (B*T, D), as `RoutedBlock.run_topk` gathers.
    rows_N = (idx_BK + T * torch.arange(B, device=idx_BK.device)[:, None]).flatten()
    h_BKD = h_BTD.reshape(B * T, D).index_select(0, rows_N).view(B, k, D)
    key, value = block.attn.kv(h_BKD, p.cos[idx_BK].unsqueeze(1), p.sin[idx_BK].unsqueeze(1))
    if p.cache is not None:
        p.cache.write_prefill(block.layer, key, value, None)
    see_BTK = idx_BK[:, None, :] <= torch.arange(T, device=idx_BK.device)[None, :, None]
    mask, has_BT = open_empty_rows(see_BTK)
    a_BTD = block.attn(h_BTD, p.cos, p.sin, None, LayerKV(key, value, mask.unsqueeze(1)))
    return keep(a_BTD, has_BT)


def attend_masked(block: Any, x_BTD: Tensor, take_BT: Tensor, p: Any) -> Tensor:
    """Every token's attention update with every token computed (the evaluation path, work of
    a dense layer): query i sees the takers `take_BT` at positions <= i. A prefill stores the
    takers (`take_BT` holds only a padded prompt's real tokens)."""
    T = x_BTD.shape[1]
    lower = torch.ones(T, T, dtype=torch.bool, device=x_BTD.device).tril()
    mask, has_BT = open_empty_rows(lower & take_BT[:, None, :])
    kv = p.kv(block.layer, take_BT)
    a_BTD = block.attn(block.attn_norm(x_BTD), p.cos, p.sin, mask.unsqueeze(1), kv)
    return keep(a_BTD, has_BT)


def attend_rows(block: Any, x_N1D: Tensor, sel: Tensor, p: Any) -> Tensor:
    """A decode step's attention update of every row: the taking rows `sel` (sorted host
    indices) append their key and value to the layer's cache, then every row's query reads
    all its row holds there. Where no row holds a key, nothing is computed."""
    m, n = len(sel), x_N1D.shape[0]
    h_N1D = block.attn_norm(x_N1D)
    if m:
        pick: slice | Tensor = slice(None)
        if m == 1 < n:  # one row, the common case at low capacity: a slice, not a gather
            pick = slice(int(sel[0]), int(sel[0]) + 1)
        elif m < n:
            pick = sel.to(x_N1D.device)
        key, value = block.attn.kv(h_N1D[pick], p.cos[pick], p.sin[pick])
        (p.cache if m == n else p.cache.subset(sel)).append(block.layer, key, value)
    keys, values, valid = p.cache.read(block.layer)
    if keys.shape[2] == 0:
        return torch.zeros_like(x_N1D)
    q = block.attn.q(h_N1D, p.cos, p.sin)
    if valid is None:  # every row sees every slot it was given
        return block.attn.attend(q, keys, values, None)
    mask, has = open_empty_rows(valid)
    return keep(block.attn.attend(q, keys, values, mask), has.view(n, 1))


def attend_static(cache: Any, block: Any, x_N1D: Tensor, take_N: Tensor, p: Any) -> Tensor:
    """`attend_rows` with masks, no host sync (static_cache.py): every row projects a query,
    key and value; a taking row's key and value go to its row's next slot, a skipping row's to
    the trash slot; every row reads its filled slots."""
    q, key, value = block.attn.qkv(block.attn_norm(x_N1D), p.cos, p.sin)
    cache.append(block.layer, key, value, take_N)
    keys, values, valid = cache.read(block.layer)
    mask, has = open_empty_rows(valid)
    return keep(block.attn.attend(q, keys, values, mask), has.view(-1, 1))


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
