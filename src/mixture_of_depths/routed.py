"""The routed layer kind (`RoutedBlock`, letter ``R``): its routers and predictors, and the one
routing rule written for every path: top-k with gather and scatter (training), every token under
a mask (causal evaluation, prefill) and only the taking rows (decode). docs/semantics.md states
what is computed.

``routing`` says what the routers route (`topology.ROUTE_KINDS`): the whole block ("joint"),
attention and the MLP apart ("staggered"), only the MLP ("mlp"), attention then running for
every token as in a dense block, or the attention's keys and values and the MLP ("mlp_kv":
every token queries the takers' keys, mlp_kv.py). A chosen token leaves a routed sub-block as
``x + g(r) * f``; every other token leaves it bit for bit unchanged (with "mlp_kv", as the
attention every token runs left it).

Names with shape suffixes: B batch, T tokens of the forward, K routed subset, D model width;
N rows of a decode step, M those of them that take the sub-block.
"""

from __future__ import annotations

from statistics import NormalDist

import torch
from torch import Tensor, nn

from . import kernels, mlp_kv
from .blocks import Block, Count, Pass
from .cache import kv_hook
from .config import MoDConfig
from .kernels import fused
from .layers import KVHook, LayerCost, LayerKV, Predictor, price
from .routing import (
    Route,
    causal_attention_mask,
    gate,
    linear32,
    positions_mask,
    topk_indices,
    topk_mask,
)


class RoutedBlock(Block):
    """A router (joint routing), one for attention and one for the MLP (staggered routing), one
    for the MLP alone (``routing="mlp"``, attention dense), or one for the keys and the MLP
    (``routing="mlp_kv"``, every token querying) picks the tokens that take the (sub-)block;
    the others ride the residual stream unchanged."""

    kind = "R"

    def __init__(self, cfg: MoDConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.route_kinds = cfg.topology.route_kinds
        self.router = nn.ModuleDict(
            {kind: nn.Linear(cfg.d_model, 1, bias=False) for kind in self.route_kinds}
        )
        if cfg.has_predictor:
            self.predictor = nn.ModuleDict(
                {kind: Predictor(cfg.d_model, cfg.predictor_hidden) for kind in self.route_kinds}
            )

    def router_index(self, kind: str) -> int:
        """This router's number among the model's, in forward order (`Topology.routes`)."""
        return self.cfg.topology.router_index(self.layer, kind)

    def router_weight(self, kind: str, x_BTD: Tensor) -> Tensor:
        """Raw router weights r = x @ w (B, T), in at least float32."""
        if self.cfg.router_scores == "random":  # ablation: scores that know nothing
            # N(0, 1) noise less its (1 - p) quantile: the causal decision r > 0 takes a token
            # with probability p, the capacity or this router's rate; top-k ranks it as noise.
            p = min(max(self.cfg.random_take_rate(self.router_index(kind)), 1e-6), 1 - 1e-6)
            shift = NormalDist().inv_cdf(1.0 - p)  # plain Python: no tensor, no sync
            return torch.randn(x_BTD.shape[:-1], device=x_BTD.device) - shift
        return linear32(x_BTD, self.router[kind]).squeeze(-1)

    def predictor_logits(self, kind: str, x_BTD: Tensor) -> Tensor | None:
        """The causal predictor's logits (B, T) in predictor mode, else None."""
        if not self.cfg.has_predictor:
            return None
        # Stop-gradient: the predictor learns from its own BCE and never shapes the LM.
        return self.predictor[kind](x_BTD.detach() if torch.is_grad_enabled() else x_BTD)

    @property
    def residual_kv(self) -> bool:
        return self.cfg.skipped_kv == "residual"

    def layer_kv(self, x_BTD: Tensor, p: Pass, mask: Tensor) -> LayerKV:
        """``skipped_kv="residual"``: keys and values of every token from the layer's input (a
        prefill stores those of the real tokens), for the chosen queries to attend under
        `mask` (B, 1, K, T)."""
        k, v = self.attn.kv(self.attn_norm(x_BTD), p.cos, p.sin)
        if p.cache is not None:
            p.cache.write_prefill(self.layer, k, v, p.valid_BT)
        return LayerKV(k, v, mask)

    @property
    def dense_attention(self) -> bool:
        """``routing="mlp"``: every token runs the attention sub-block, unrouted."""
        return self.cfg.routing == "mlp"

    def forward(self, x_BTD: Tensor, p: Pass) -> tuple[Tensor, list[Route]]:
        if self.dense_attention:  # as in a dense block; a padded prompt caches its real tokens
            kv = p.kv(self.layer, p.valid_BT)
            x_BTD = x_BTD + self.update("attn", x_BTD, p.cos, p.sin, None, kv, p)
        routes = []
        for kind in self.route_kinds:  # the MLP's router reads the stream after attention
            x_BTD, route = self.route(kind, x_BTD, p)
            routes.append(route)
        return x_BTD, routes

    def route(self, kind: str, x_BTD: Tensor, p: Pass) -> tuple[Tensor, Route]:
        T = x_BTD.shape[1]
        pred_BT = self.predictor_logits(kind, x_BTD)
        thr = self.cfg.causal_threshold(self.router_index(kind))  # a Python float: no sync
        if p.decode and getattr(p.cache, "masked", False):  # static_cache.py: masks, no sync
            return p.cache.decode_rows(self, kind, x_BTD, pred_BT, thr, p)
        if p.decode:  # one new token per row: top-k over it means nothing
            # The predictor decides; the router's weight then only gates the rows that take.
            r_BT = self.router_weight(kind, x_BTD) if pred_BT is None else None
            take_BT = ((r_BT if pred_BT is None else pred_BT) > thr).cpu()  # the one host sync
            x_BTD = self.run_rows(kind, x_BTD, r_BT, take_BT, p)
            return x_BTD, Route(self.layer, kind, take_BT, r_BT, None, pred_BT, thr)
        r_BT = self.router_weight(kind, x_BTD)
        decide_BT = r_BT if pred_BT is None else pred_BT
        if p.valid_BT is None:
            idx_BK = topk_indices(r_BT, self.cfg.capacity_tokens(T))
            target_BT = positions_mask(idx_BK, T)
            if p.routing == "topk":  # training: gather exactly k tokens per row
                x_BTD = self.run_topk(kind, x_BTD, r_BT, idx_BK, p)
                return x_BTD, Route(self.layer, kind, target_BT, r_BT, target_BT, pred_BT, thr)
        else:  # right-padded prompts: top-k over each row's own tokens
            k_B = self.cfg.capacity_tokens(p.lengths)
            target_BT = topk_mask(r_BT, k_B, p.valid_BT)
        take_BT = target_BT if p.routing == "topk" else decide_BT > thr
        if p.valid_BT is not None:
            take_BT = take_BT & p.valid_BT
        x_BTD = self.run_masked(kind, x_BTD, r_BT, take_BT, p)
        return x_BTD, Route(self.layer, kind, take_BT, r_BT, target_BT, pred_BT, thr)

    def gated(
        self,
        kind: str,
        x: Tensor,
        r: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        kv: KVHook | LayerKV | None,
        p: Pass | None = None,
    ) -> Tensor:
        """``x + g(r) * f(x)``: the new stream of the tokens that take sub-block `kind`."""
        f = self.update(kind, x, cos, sin, mask, kv, p)
        return x + gate(self.cfg, r, x).unsqueeze(-1) * f

    def run_topk(self, kind: str, x_BTD: Tensor, r_BT: Tensor, idx_BK: Tensor, p: Pass) -> Tensor:
        """Gather the k chosen tokens of each row, run them, scatter them back."""
        if kind == "mlp_kv":  # every token queries the takers' keys; then the takers' MLP
            x_BTD = x_BTD + mlp_kv.attend_topk(self, x_BTD, idx_BK, p)
            kind = "mlp"
        B, T, D = x_BTD.shape
        k = idx_BK.shape[1]
        if k == 0:
            if kind != "mlp" and self.residual_kv and p.cache is not None:
                self.layer_kv(x_BTD, p, idx_BK)  # the cache still stores every token
            return x_BTD
        if kernels.enabled() and fused.applies(self, kind, p):  # opt-in Triton path (kernels/)
            return fused.run_topk(self, kind, x_BTD, r_BT, idx_BK, p)
        # Flat row indices into (B*T, D): index_select/index_copy move whole rows, several times
        # cheaper than gather/scatter with a D-expanded index.
        rows_N = (idx_BK + T * torch.arange(B, device=idx_BK.device)[:, None]).flatten()
        x_ND = x_BTD.reshape(B * T, D)
        x_BKD = x_ND.index_select(0, rows_N).view(B, k, D)
        # Original positions; idx is sorted, so a plain causal mask over K is causal in T.
        cos, sin = p.cos[idx_BK].unsqueeze(1), p.sin[idx_BK].unsqueeze(1)
        kv: KVHook | LayerKV | None = None
        if kind != "mlp" and self.residual_kv:
            # Keys of every token; chosen token i sees the keys at positions <= idx[i].
            at_or_before = torch.arange(T, device=idx_BK.device) <= idx_BK[:, :, None]
            kv = self.layer_kv(x_BTD, p, at_or_before.unsqueeze(1))
        elif kind != "mlp":
            kv = p.kv(self.layer, None)
        y_BKD = self.gated(kind, x_BKD, r_BT.gather(1, idx_BK), cos, sin, None, kv, p)
        return x_ND.index_copy(0, rows_N, y_BKD.reshape(B * k, D)).view(B, T, D)

    def run_masked(
        self, kind: str, x_BTD: Tensor, r_BT: Tensor, take_BT: Tensor, p: Pass
    ) -> Tensor:
        """Every token computes; a taker attends only to earlier takers (with
        ``skipped_kv="residual"``, to every earlier token); skippers keep x (with "mlp_kv",
        every token first attends to the takers at or before it)."""
        if kind == "mlp_kv":
            x_BTD = x_BTD + mlp_kv.attend_masked(self, x_BTD, take_BT, p)
            kind = "mlp"
        if kind == "mlp":
            mask, kv = None, None
        elif self.residual_kv:  # every token's key, from the layer's input: plain causal
            mask, kv = None, p.kv(self.layer, p.valid_BT)
        else:
            mask, kv = causal_attention_mask(take_BT), p.kv(self.layer, take_BT)
        y_BTD = self.gated(kind, x_BTD, r_BT, p.cos, p.sin, mask, kv, p)
        return torch.where(take_BT.unsqueeze(-1), y_BTD, x_BTD)

    def run_rows(
        self, kind: str, x_N1D: Tensor, r_N1: Tensor | None, take_N1: Tensor, p: Pass
    ) -> Tensor:
        """Decode step: run the block on the rows whose token takes it (`take_N1` on the host),
        and only they append to this layer's cache (with ``skipped_kv="residual"`` every row
        appends its key and value first; with "mlp_kv" every row reads the cache). `r_N1` None:
        the router weights are needed for the gate of the taking rows only (predictor mode),
        computed here from the stream the router reads, the block's input."""
        sel = take_N1.view(-1).nonzero().view(-1)
        m, n = len(sel), len(take_N1)
        x_in = x_N1D
        if kind == "mlp_kv":  # every row queries the takers' keys; then the takers' MLP
            x_N1D = x_N1D + mlp_kv.attend_rows(self, x_N1D, sel, p)
        sub = "mlp" if kind == "mlp_kv" else kind
        residual = sub != "mlp" and self.residual_kv
        if residual:  # every row stores its key and value, taking the layer or not
            k, v = self.attn.kv(self.attn_norm(x_N1D), p.cos, p.sin)
            p.cache.append(self.layer, k, v)
        if m == 0:
            return x_N1D
        cache, cos, sin, x_M1D, r_M1, sel_d = p.cache, p.cos, p.sin, x_N1D, r_N1, None
        pick: slice | Tensor = slice(None)
        if m < n:
            sel_d = sel.to(x_N1D.device)
            # One row, the common case at low capacity: slices, not gathers.
            pick = slice(int(sel[0]), int(sel[0]) + 1) if m == 1 else sel_d
            x_M1D, cos, sin = x_N1D[pick], cos[pick], sin[pick]
            r_M1 = None if r_N1 is None else r_N1[pick]
            cache = None if sub == "mlp" else cache.subset(sel)
        if r_M1 is None:
            r_M1 = self.router_weight(kind, x_in[pick])
        kv: KVHook | LayerKV | None = None
        if residual:
            kv = LayerKV(*cache.read(self.layer))
        elif cache is not None:
            kv = kv_hook(cache, self.layer, None, decode=True)
        y_M1D = self.gated(sub, x_M1D, r_M1, cos, sin, None, kv, p)
        return y_M1D if sel_d is None else x_N1D.index_copy(0, sel_d, y_M1D)

    @staticmethod
    def cost(
        cfg: MoDConfig,
        tokens: float,
        attn: Count = None,
        mlp: Count = None,
        keys: Count = None,
        expert_share: float = 1.0,
    ) -> LayerCost:
        routers = len(cfg.topology.route_kinds)  # staggered: attention's and the MLP's
        predicted = tokens * routers if cfg.has_predictor else 0.0
        if cfg.routing == "mlp_kv":  # `attn`: the queries (every token); `mlp`: the takers
            return mlp_kv.cost(cfg, tokens, attn, mlp, keys, predicted, expert_share)
        if cfg.routing == "mlp":  # attention dense: every token, over every key (`attn` unused)
            topk = mlp is None
            mlp = cfg.capacity_tokens(int(tokens)) if topk else mlp
            # causal, predictor mode: the router only gates the tokens that take the MLP
            routed = mlp if predicted and not topk else tokens
            keys = tokens if keys is None else keys
            return price(cfg, tokens, mlp, keys, routed, predicted, expert_share)
        topk = attn is None or mlp is None
        if topk:
            # Top-k: every token is weighed; each sub-block takes its own capacity_tokens.
            k = cfg.capacity_tokens(int(tokens))
            attn, mlp = (k if attn is None else attn), (k if mlp is None else mlp)
            routed = tokens * routers
        elif predicted:  # causal, predictor mode: the router only gates the tokens that take
            routed = attn if cfg.routing == "joint" else attn + mlp
        else:  # causal, aux_loss mode: the router's weight is every token's decision
            routed = tokens * routers
        if cfg.skipped_kv == "residual":  # the skippers' keys and values; queries see them all
            # (a top-k forward that chose no token has no query to read them: it skips them)
            skippers = 0.0 if topk and not attn else tokens - attn
            return price(
                cfg,
                attn,
                mlp,
                tokens if keys is None else keys,
                routed,
                predicted,
                expert_share,
                kv_only=skippers,
            )
        keys = attn if keys is None else keys
        return price(cfg, attn, mlp, keys, routed, predicted, expert_share)
