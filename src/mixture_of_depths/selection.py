"""The one routing executor (docs/semantics.md, "The KV cache and generation"): which tokens take
a routed (sub-)block or a recursion step (`choose`), and how they run (`Selection`), in the five
modes of the paths: ``"topk"`` (training: each row's k chosen tokens gathered in position order,
run at their original positions, scattered back), ``"masked"`` (the causal forward without a
cache: every token computes, a taker attends only to earlier takers, `where` keeps the skippers),
``"packed"`` (a causal prefill into a cache: each row's takers gathered to the front in position
order and padded to the busiest row's count, run like top-k, only the real ones scattered back
and stored; equal to "masked", which stays its reference: `PACK_PREFILL`),
``"rows"`` (a decode step, decisions on the host: only the taking rows run, on a view of the
cache narrowed to them) and ``"device"`` (a static decode step, no host read: every row runs
under masks, a skipper's key and value go to the cache's trash).

`RoutedBlock` and `Recursion` choose, then call `Selection.run` with only their update (the
selected tokens' f) and their gate: each taker leaves as ``x + g * f``, every other token bit
for bit as it came. An update's attention asks the selection for its keys: `own` (the takers',
in a cache layer) or `given` (every token's: a residual layer's, the recursion's first pass's).
The fused kernels (kernels/fused.py) run a top-k selection's rows and gates.

Names with shape suffixes: B batch, T tokens, K chosen per row, N decode rows, D width.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from .cache import Cache, kv_hook
from .layers import KVHook, LayerKV
from .routing import causal_attention_mask, positions_mask, topk_indices, topk_mask

MODES = ("topk", "masked", "packed", "rows", "device")
GATHERED = ("topk", "packed")  # the modes that run (B, K) gathered takers at their positions
# A causal prefill into a cache gathers its takers ("packed"): it then costs per token what
# decoding does, the routed blocks' share of the prompt. False: the "masked" reference, which
# computes every token (tests prove the two equal; docs/semantics.md).
PACK_PREFILL = True
Update = Callable[[Tensor, "Selection"], Tensor]


def choose(
    p: Any,
    score_BT: Tensor | None,
    decide_BT: Tensor,
    threshold: float,
    k_of: Callable[[Any], Any],
    prior: Any = None,
    exact: bool = False,
) -> tuple[Selection, Tensor, Tensor | None]:
    """The selection of a routed (sub-)block or step on pass `p` (a `blocks.Pass`), its
    decisions (`Route.mask`) and its top-k target (None when decoding). Top-k picks the
    ``k_of(T)`` (or, for right-padded prompts, ``k_of(lengths)``) largest scores; causal
    routing takes ``decide > threshold``. `prior`: the route of the step before (a recursion's
    active tokens: top-k nests in its target, the causal decision in its mask). `exact`: the
    causal decision in every mode (token-choice recursion)."""
    take = decide_BT > threshold
    if p.decode:  # one token per row, causal
        if prior is not None:
            take = take & prior.mask.to(take.device)
        if p.static:
            return Selection(p, "device", take), take, None
        take = take.cpu()  # the one host read of a decode step's routed (sub-)block
        return Selection(p, "rows", take), take, None
    if exact:
        take = take if p.valid_BT is None else take & p.valid_BT
        return _causal(p, take), take, take
    T = decide_BT.shape[1]
    if prior is not None:  # nested: the top-k of the tokens still active in top-k routing
        score_BT = score_BT.masked_fill(~prior.target, float("-inf"))
    if p.valid_BT is None:
        idx_BK = topk_indices(score_BT, k_of(T))
        target = positions_mask(idx_BK, T)
        if p.routing == "topk":  # training: gather exactly k tokens per row
            return Selection(p, "topk", idx_BK=idx_BK), target, target
    else:  # right-padded prompts: top-k over each row's own tokens
        target = topk_mask(score_BT, k_of(p.lengths), p.valid_BT)
    if p.routing == "topk":
        take = target
    elif prior is not None:
        take = take & prior.mask
    if p.valid_BT is not None:
        take = take & p.valid_BT
    return _causal(p, take), take, target


def _causal(p: Any, take_BT: Tensor) -> Selection:
    """A forward's selection by a (B, T) decision: gathered in a prefill, else masked."""
    packed = PACK_PREFILL and p.cache is not None
    return Selection(p, "packed" if packed else "masked", take_BT)


class Selection:
    """The tokens of one pass that take a routed (sub-)block or step, in one of `MODES`:
    `take` (B, T) or (N, 1) bool (on the host in "rows"), or `idx_BK` (sorted) in "topk".
    In "packed", `idx` (B, K) holds each row's takers first, then (past `valid`) other tokens
    as padding: they come after every real taker, and the takers attend causally in that order,
    so no real query sees a pad's key; a pad's output is never scattered back."""

    def __init__(
        self, p: Any, mode: str, take: Tensor | None = None, idx_BK: Tensor | None = None
    ) -> None:
        self.p, self.mode, self.take, self.idx = p, mode, take, idx_BK
        self.cos, self.sin = p.cos, p.sin
        self.empty = False  # known on the host to select nothing: nothing runs
        self._mask: Tensor | None = None
        self.valid: Tensor | None = None  # "packed": (B, K) the real takers
        if mode == "packed":
            counts_B = take.sum(1)
            K = int(counts_B.max())  # the one host read of a packed prefill's routed block
            # A stable sort on "skipped" moves each row's takers to the front, in order.
            idx_BK = torch.sort((~take).to(torch.int8), dim=1, stable=True).indices[:, :K]
            self.valid = torch.arange(K, device=take.device) < counts_B[:, None]
        if mode in GATHERED:
            B, T = idx_BK.shape[0], p.cos.shape[0]
            self.empty = idx_BK.shape[1] == 0
            # Flat row indices into (B*T, D): index_select/index_copy move whole rows, several
            # times cheaper than gather/scatter with a D-expanded index.
            self.rows = (idx_BK + T * torch.arange(B, device=idx_BK.device)[:, None]).flatten()
            # Original positions; idx is sorted, so a plain causal mask over K is causal in T.
            self.cos, self.sin = p.cos[idx_BK].unsqueeze(1), p.sin[idx_BK].unsqueeze(1)
            self.idx, self.out = idx_BK, self.rows  # `out`: the rows scattered back
            if self.valid is not None:
                self.out = self.rows[self.valid.flatten()]
        elif mode == "rows":
            sel = take.view(-1).nonzero().view(-1)
            m, n = len(sel), len(take)
            self.sel, self.empty, self.whole = sel, m == 0, m == n
            self.pick: slice | Tensor = slice(None)  # every row: no gather, no scatter
            if 0 < m < n:  # one row, the common case at low capacity: a slice, not a gather
                self.sel_d = sel.to(p.cos.device)
                self.pick = slice(int(sel[0]), int(sel[0]) + 1) if m == 1 else self.sel_d
                self.cos, self.sin = p.cos[self.pick], p.sin[self.pick]
        elif mode == "device" and p.skip_idle:  # one host read buys skipping an idle block
            self.empty = not bool((take[:, 0] & p.cache.active).any())  # inactive slots too

    # -- the tokens -----------------------------------------------------------------------------
    def gather(self, x: Tensor) -> Tensor:
        """The selected tokens of `x` (B, T, D) or (B, T): (B, K, ...) in "topk", the taking
        rows in "rows", every token otherwise."""
        if self.mode in GATHERED:
            if x.dim() == 2:
                return x.gather(1, self.idx)
            B, K = self.idx.shape
            return x.reshape(-1, x.shape[-1]).index_select(0, self.rows).view(B, K, -1)
        return x[self.pick] if self.mode == "rows" else x

    def scatter(self, x: Tensor, y: Tensor) -> Tensor:
        """`x` with the selected tokens' new stream `y` put back; every other token as it was."""
        if self.mode in GATHERED:
            D = x.shape[-1]
            y = y.reshape(-1, D) if self.valid is None else y[self.valid]
            return x.reshape(-1, D).index_copy(0, self.out, y).view(x.shape)
        if self.mode == "rows":
            return y if self.whole else x.index_copy(0, self.sel_d, y)
        return torch.where(self.take.unsqueeze(-1), y, x)

    def run(
        self, x: Tensor, update: Update, g_BT: Tensor | None, g_sub: Tensor | None = None
    ) -> Tensor:
        """``x + g * update(x)`` for the selected tokens, every other token unchanged. The gate
        per token of `x` (`g_BT`), or already of the selected tokens (`g_sub`)."""
        if self.empty:
            return x
        x_sub = self.gather(x)
        f = update(x_sub, self)
        g = self.gather(g_BT) if g_sub is None else g_sub
        return self.scatter(x, x_sub + g.unsqueeze(-1) * f)

    # -- what the selected tokens' attention reads ----------------------------------------------
    @cached_property
    def view(self) -> Cache:
        """The cache seen through the taking rows ("rows"), made when an attention reads it."""
        return self.p.cache if self.whole else self.p.cache.subset(self.sel)

    def own(self, layer: int) -> tuple[KVHook | None, Tensor | None]:
        """The takers' own keys in cache layer `layer`: the hook that stores them (decoding:
        and reads all the layer holds for the selected rows), and the mask among them."""
        p = self.p
        if self.mode == "masked":
            if self._mask is None:
                self._mask = causal_attention_mask(self.take)
            kv = None if p.cache is None else kv_hook(p.cache, layer, self.take, False)
            return kv, self._mask
        if p.cache is None:
            return None, None
        if self.mode in GATHERED:  # the gathered takers, in order: what the layer stores
            return kv_hook(p.cache, layer, self.valid, False), None
        if self.mode == "rows":
            return kv_hook(self.view, layer, None, True), None
        # "device": a skipper's key and value go to the trash slot
        return kv_hook(p.cache, layer, self.take[:, 0], True), None

    def given(self, layer: int, kv: tuple[Tensor, Tensor] | None) -> LayerKV:
        """Keys every token has, read by the selected queries: `kv` (B, n_kv_heads, T, d) in a
        forward (a chosen token sees those at or before its position), or what cache layer
        `layer` holds when decoding."""
        if self.mode in GATHERED:  # (B, 1, K, T), made once for every layer that reads it
            if self._mask is None:
                T = self.p.cos.shape[0]
                seen = torch.arange(T, device=self.idx.device) <= self.idx[:, :, None]
                self._mask = seen.unsqueeze(1)
            return LayerKV(*kv, self._mask)
        if self.mode == "masked":  # every token is a query: plain causal
            return LayerKV(*kv, None)
        return LayerKV(*(self.view if self.mode == "rows" else self.p.cache).read(layer))
