"""Mixture-of-Recursions (Bae et al. 2025, arXiv:2507.10524) on the model's own blocks: the
unique layers of `MoDTransformer.blocks` applied as a recursive stack, the routers of its steps,
and what each step costs. docs/mor.md states what is computed.

``recursion_sharing="middle_cycle"``: layer 0, then layers 1..n-2 applied `recursions` times,
then layer n-1; ``"cycle"``: all n layers applied `recursions` times. Every token takes the
first pass (step 0). A later step r runs the shared layers on the tokens still active, each
leaving the step as ``x + g * (stack(x) - x)``; every other token leaves it bit for bit.

- ``recursion_router="expert"``: step r's router (``r = x @ w``, read at the step's input)
  keeps the top ``capacity_tokens(recursion_capacities[r], T)`` of the tokens active at
  r - 1, so each step's tokens are a subset of the last's; the gate is MoD's `routing.gate`;
  causally a token continues iff it was active and its decision logit (router or predictor)
  beats the step's threshold, trained towards the nested top-k by the aux loss.
- ``"token"``: one router ``Linear(D, recursions)`` at the recursion's input gives each token
  its number of passes (the argmax, ties to fewer); its softmax probability gates every step it
  takes; a Switch-style balancing loss keeps the depths even. Exact and causal in every mode.

``recursion_kv="recursion"``: a step's attention runs among the tokens active at that step and
only their keys and values are cached (one cache layer per application, `layer_schedule`).
``"share"``: a later step's queries read the first pass's keys and values of every earlier
token (and its own) of the same layer; nothing more is cached.

Names with shape suffixes: B batch, T tokens, K routed subset, D width, N decode rows.
"""

from __future__ import annotations

from functools import partial

import torch.nn.functional as F
from torch import Tensor, nn

from .blocks import Block, Pass
from .cache import kv_hook
from .config import MoDConfig
from .layers import Attention, KVHook, LayerCost, LayerKV, Predictor, price
from .routing import Route, gate, linear32, router_aux_loss
from .selection import Selection, choose
from .topology import RECURSION

KIND = RECURSION  # Route.kind of a recursion step; Route.layer is the step number


def _capture(store: dict[int, tuple[Tensor, Tensor]], layer: int, inner: KVHook | None) -> KVHook:
    """A KV hook that keeps the first pass's keys and values of `layer` ("share")."""

    def hook(k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
        store[layer] = (k, v)
        return (k, v, mask) if inner is None else inner(k, v, mask)

    return hook


class Recursion(nn.Module):
    """The routers (and predictors) of the recursion steps and the recursive forward."""

    def __init__(self, cfg: MoDConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.token = cfg.recursion_router == "token"
        self.routed = cfg.recursion_routed_steps
        if self.token:
            self.router = nn.ModuleDict({"depth": nn.Linear(cfg.d_model, cfg.recursions, False)})
        else:
            self.router = nn.ModuleDict(
                {str(r): nn.Linear(cfg.d_model, 1, bias=False) for r in self.routed}
            )
        if cfg.has_predictor and self.routed:
            self.predictor = nn.ModuleDict(
                {str(r): Predictor(cfg.d_model, cfg.predictor_hidden) for r in self.routed}
            )

    # -- the forward ----------------------------------------------------------------------------
    def forward(
        self, blocks: nn.ModuleList, x_BTD: Tensor, p: Pass
    ) -> tuple[Tensor, list[Route], Tensor | None]:
        """The stack over `x_BTD`: the new stream, one route per routed step, the aux loss."""
        cfg = self.cfg
        pre, shared, post = cfg.topology.recursion_layers
        first: dict[int, tuple[Tensor, Tensor]] = {}  # "share": each layer's first-pass K/V
        for layer in pre:
            x_BTD = self.every_token(blocks[layer], None, x_BTD, p, None)
        depth = self.depths(x_BTD) if self.token else None
        routes: list[Route] = []  # the last one: the tokens still active (None: all)
        for r in range(cfg.recursions):
            if r == 0 or r not in self.routed:  # every token (the first pass, a step at 1.0)
                store = first if r == 0 and cfg.recursion_kv == "share" else None
                for layer in shared:
                    x_BTD = self.every_token(blocks[layer], r, x_BTD, p, store)
            else:
                prior = routes[-1] if routes else None
                x_BTD, route = self.step(r, blocks, x_BTD, p, prior, depth, first)
                routes.append(route)
        for layer in post:
            x_BTD = self.every_token(blocks[layer], None, x_BTD, p, None)
        aux = None
        if p.cache is None:
            aux = self.balance_loss(depth) if self.token else router_aux_loss(routes, x_BTD)
        return x_BTD, routes, aux

    def every_token(
        self, block: Block, step: int | None, x_BTD: Tensor, p: Pass, store: dict | None
    ) -> Tensor:
        """A dense application of `block` at recursion step `step` (None: a unique layer; a
        prefill caches the real tokens); with `store`, its keys and values kept for the later
        steps ("share")."""
        vl = self.cfg.topology.kv_layer(block.layer, step)
        kv = None if p.cache is None else kv_hook(p.cache, vl, p.valid_BT, p.decode)
        if store is not None and not p.decode:
            kv = _capture(store, block.layer, kv)
        return x_BTD + block.update("block", x_BTD, p.cos, p.sin, None, kv, p)

    def depths(self, x_BTD: Tensor) -> tuple[Tensor, Tensor]:
        """Token choice: the router's logits (B, T, N_r) and each token's gate (B, T), the
        probability of its depth (argmax: ties to fewer passes)."""
        z_BTR = linear32(x_BTD, self.router["depth"])
        probs = z_BTR.softmax(-1)
        return z_BTR, probs.gather(-1, probs.argmax(-1, keepdim=True)).squeeze(-1)

    def balance_loss(self, depth: tuple[Tensor, Tensor]) -> Tensor:
        """Switch's balancing loss over the depths: N_r * sum_d share_d * mean prob_d (1 when
        even)."""
        z_BTR = depth[0]
        probs = z_BTR.softmax(-1).flatten(0, 1)
        share = F.one_hot(probs.argmax(-1), z_BTR.shape[-1]).to(probs.dtype).mean(0)
        return z_BTR.shape[-1] * (share * probs.mean(0)).sum()

    def decide(
        self, r: int, x_BTD: Tensor, depth: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor, float]:
        """Step r's router logits, gate and predictor logits (B, T), the decision logits and
        threshold: a token continues causally iff decision > threshold (and it is active)."""
        if depth is not None:  # continue iff the best depth past r beats the best up to r
            z = depth[0]
            logits = z[..., r:].amax(-1) - z[..., :r].amax(-1)
            return logits, depth[1].to(x_BTD.dtype), None, logits, 0.0
        r_BT = linear32(x_BTD, self.router[str(r)]).squeeze(-1)
        pred_BT = self.predictor[str(r)](x_BTD) if self.cfg.has_predictor else None
        thr = self.cfg.causal_threshold(self.cfg.topology.router_index(r, KIND))
        g = gate(self.cfg, r_BT, x_BTD)
        return r_BT, g, pred_BT, r_BT if pred_BT is None else pred_BT, thr

    def step(
        self,
        r: int,
        blocks: nn.ModuleList,
        x_BTD: Tensor,
        p: Pass,
        prior: Route | None,
        depth: tuple[Tensor, Tensor] | None,
        first: dict[int, tuple[Tensor, Tensor]],
    ) -> tuple[Tensor, Route]:
        """Routed step r: pick its tokens among those active after `prior` (selection.choose:
        expert choice's nested top-k or causal decision, token choice's exact one) and run the
        shared layers on them, each leaving as ``x + g * (stack(x) - x)``."""
        logits, g_BT, pred_BT, decide_BT, thr = self.decide(r, x_BTD, depth)
        k_of = partial(self.cfg.recursion_tokens, r)
        s, take, target = choose(p, logits, decide_BT, thr, k_of, prior, depth is not None)
        topo, share = self.cfg.topology, self.cfg.recursion_kv == "share"

        def update(y: Tensor, s: Selection) -> Tensor:
            y0 = y
            for layer in topo.recursion_layers[1]:
                mask: Tensor | None = None
                if share:  # the first pass's keys and values of every earlier token
                    kv: KVHook | LayerKV | None = s.given(topo.kv_layer(layer, 0), first.get(layer))
                else:  # its own tokens', cached in the step's KV layer
                    kv, mask = s.own(topo.kv_layer(layer, r))
                y = y + blocks[layer].update("block", y, s.cos, s.sin, mask, kv, s.p)
            return y - y0

        x_BTD = s.run(x_BTD, update, g_BT)
        return x_BTD, Route(r, KIND, take, logits, target, pred_BT, thr)


# -- what the recursion costs ---------------------------------------------------------------------
def step_tokens(cfg: MoDConfig, step: int | None, seq_len: int) -> int:
    """Tokens per row that run an application at `step` in the top-k forward: every token in
    unique layers, the first pass, steps at capacity 1 and (masked) token-choice steps."""
    if step is None or step not in cfg.recursion_routed_steps or cfg.recursion_router == "token":
        return seq_len
    return cfg.recursion_tokens(step, seq_len)


def application_cost(
    cfg: MoDConfig, step: int | None, tokens: float, keys: float, routers: float = 0.0
) -> LayerCost:
    """One application of a layer on `tokens` queries against `keys` keys; a routed step
    with ``recursion_kv="share"`` projects only queries (its keys are the first pass's).
    `routers`: tokens its step's router (and predictor) weigh, put on the step's first layer."""
    share = cfg.recursion_kv == "share" and step is not None and step in cfg.recursion_routed_steps
    cost = price(cfg, tokens, tokens, keys)
    if share:
        kv = 2 * tokens * Attention.kv_params(cfg)
        cost = LayerCost(
            attn_tokens=tokens,
            kv_only=0.0,
            matmul=cost.matmul - kv,
            attention=cost.attention,
            router=0.0,
            predictor=0.0,
            params=cost.params - kv / 2,
            kv_entries=cost.kv_entries,
        )
    if not routers:
        return cost
    width = cfg.recursions if cfg.recursion_router == "token" else 1
    predicted = routers if cfg.has_predictor else 0.0
    return LayerCost(
        attn_tokens=cost.attn_tokens,
        kv_only=0.0,
        matmul=cost.matmul,
        attention=cost.attention,
        router=2 * cfg.d_model * width * routers,
        predictor=predicted * Predictor.flops_per_token(cfg),
        params=cost.params + routers * cfg.d_model * width + predicted * Predictor.params(cfg),
        kv_entries=cost.kv_entries,
    )


def router_tokens(cfg: MoDConfig, i: int, seq_len: float) -> float:
    """Tokens the router of application `i` weighs: every token, on the first layer of each
    routed step with expert choice, or of the first pass with token choice (its one router)."""
    layer, step = cfg.layer_schedule[i]
    shared = cfg.recursion_layers[1]
    if step is None or layer != shared[0]:
        return 0.0
    if cfg.recursion_router == "token":
        return seq_len if step == 0 and cfg.recursion_routed_steps else 0.0
    return seq_len if step in cfg.recursion_routed_steps else 0.0


def forward_costs(cfg: MoDConfig, seq_len: int) -> list[tuple[LayerCost, LayerCost]]:
    """Per application (`layer_schedule`): its top-k forward cost per row (full attention
    products, FlopCounterMode's count) and the same with the pairs a causal mask keeps."""
    out = []
    for i, (_, step) in enumerate(cfg.layer_schedule):
        n = step_tokens(cfg, step, seq_len)
        share = cfg.recursion_kv == "share" and step in cfg.recursion_routed_steps
        keys = seq_len if share else n  # "share": k queries against every token's key
        routers = router_tokens(cfg, i, seq_len)
        causal_keys = (keys + 1) / 2
        full = application_cost(cfg, step, n, keys, routers)
        out.append((full, application_cost(cfg, step, n, causal_keys, routers)))
    return out


def decode_flops(cfg: MoDConfig, takes: list[float], context: float) -> float:
    """Expected FLOPs of the recursive stack per decoded token at `context` (routers on every
    token; a step's queries over its cached share of the context, "share": the whole)."""
    total = 0.0
    for i, ((_, step), p) in enumerate(zip(cfg.layer_schedule, takes, strict=True)):
        share = cfg.recursion_kv == "share" and step in cfg.recursion_routed_steps
        keys = context * (1.0 if share else p)
        work = application_cost(cfg, step, p, keys)
        total += work.flops + application_cost(cfg, step, 0, 0, router_tokens(cfg, i, 1)).flops
    return total
