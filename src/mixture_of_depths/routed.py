"""The routed layer kind (`RoutedBlock`, letter ``R``): its routers and predictors, its update
and gate, run on every path by the one routing executor (selection.py: top-k with gather and
scatter in training, every token under a mask in causal evaluation, each row's takers gathered
in a prefill into a cache, the taking rows of a decode step, every row under masks in a static
one). docs/semantics.md states what is computed.

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
from .config import MoDConfig
from .kernels import fused
from .layers import KVHook, LayerCost, LayerKV, Predictor, price
from .routing import Route, gate, linear32
from .selection import Selection, choose


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
        return self.predictor[kind](x_BTD) if self.cfg.has_predictor else None

    @property
    def residual_kv(self) -> bool:
        return self.cfg.skipped_kv == "residual"

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
        """Decide (selection.choose) and run sub-block `kind` on its takers."""
        pred_BT = self.predictor_logits(kind, x_BTD)
        thr = self.cfg.causal_threshold(self.router_index(kind))  # a Python float: no sync
        # A decode step choosing rows on the host in predictor mode: the predictor decides, and
        # the router's weight then only gates the rows that take (computed in `run`).
        lazy = p.decode and not p.static and pred_BT is not None
        r_BT = None if lazy else self.router_weight(kind, x_BTD)
        decide_BT = r_BT if pred_BT is None else pred_BT
        s, take, target = choose(p, r_BT, decide_BT, thr, self.cfg.capacity_tokens)
        x_BTD = self.run(kind, x_BTD, s, r_BT)
        return x_BTD, Route(self.layer, kind, take, r_BT, target, pred_BT, thr)

    def run(self, kind: str, x_BTD: Tensor, s: Selection, r_BT: Tensor | None) -> Tensor:
        """Sub-block `kind` on the tokens of `s`, each leaving as ``x + g(r) * f``. With
        ``skipped_kv="residual"`` every token's key and value come first, from the layer's
        input (stored even when no token takes); with "mlp_kv" every token first attends to
        the takers' keys (mlp_kv.py), then the takers run the MLP."""
        x_in, route_kind = x_BTD, kind
        if kind == "mlp_kv":
            x_BTD = x_BTD + mlp_kv.attend(self, x_BTD, s)
            kind = "mlp"
        kv_all = None
        if kind != "mlp" and self.residual_kv and (not s.empty or s.p.cache is not None):
            kv_all = self.residual_keys(x_BTD, s.p)
        if s.empty:
            return x_BTD
        g_BT = g_sub = None
        if r_BT is None:  # the router weighs the taking rows alone, at the block's input
            g_sub = gate(self.cfg, self.router_weight(route_kind, s.gather(x_in)), x_BTD)
        else:
            g_BT = gate(self.cfg, r_BT, x_BTD)
        if s.mode == "topk" and kernels.enabled() and fused.applies(self, kind, s.p):
            return fused.run_topk(self, kind, x_BTD, g_BT, s)  # opt-in Triton path (kernels/)

        def update(x_sub: Tensor, s: Selection) -> Tensor:
            mask: Tensor | None = None
            kv: KVHook | LayerKV | None = None
            if kv_all is not None:
                kv = s.given(self.layer, kv_all)
            elif kind != "mlp":
                kv, mask = s.own(self.layer)
            return self.update(kind, x_sub, s.cos, s.sin, mask, kv, s.p)

        return s.run(x_BTD, update, g_BT, g_sub)

    def residual_keys(self, x_BTD: Tensor, p: Pass) -> tuple[Tensor, Tensor]:
        """``skipped_kv="residual"``: every token's key and value from the layer's input (a
        prefill stores the real tokens', a decode step appends every row's)."""
        k, v = self.attn.kv(self.attn_norm(x_BTD), p.cos, p.sin)
        if p.cache is not None and p.decode:
            p.cache.append(self.layer, k, v)
        elif p.cache is not None:
            p.cache.write_prefill(self.layer, k, v, p.valid_BT)
        return k, v

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
