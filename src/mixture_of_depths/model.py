"""The Mixture-of-Depths transformer, whose one forward path serves training, evaluation, prefill
and decoding, and `BLOCKS`, the block class of each letter of `layer_pattern` (the dense kind in
blocks.py, the routed kind in routed.py).

docs/semantics.md states what is computed. A routed block's router reads the residual stream; in
top-k mode the ``k = capacity_tokens(capacity, T)`` highest-scoring tokens of each row, in position
order, are gathered, run through the block (attending only among themselves, or with
``skipped_kv="residual"`` to every earlier token's key from the layer input, at their original
rotary positions) and scattered back as ``x + g(r) * f``, where ``f`` is the block's update; every
other token leaves bit for bit unchanged. In causal mode each token decides for itself (its router
or predictor logit > 0), so no decision reads a later token. With ``routing="mlp"`` only the MLP
is routed: attention runs for every token, as in a dense block. With ``routing="mlp_kv"`` every
token queries a routed layer's attention, whose keys and values are the takers' alone, and only
the takers run its MLP (mlp_kv.py).

With a KV cache (`cache.py`) the same blocks run a prefill (the prompt, as the full causal forward
runs it, storing each layer's takers) or a decode step (a routed block runs only on the rows whose
token takes it). Each block kind prices its own work (`cost`) for flops.py and the benchmarks.

Names with shape suffixes: B batch, T tokens of the forward, D model width.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .blocks import Block, DenseBlock, Pass
from .cache import Cache
from .checks import IGNORE_INDEX, check_targets, token_tensor
from .config import MoDConfig
from .experts import ExpertMLP, ExpertRoute, balance_loss, z_loss
from .layers import Predictor, RMSNorm
from .precision import at_least_float32
from .recursion import KIND as RECURSION
from .recursion import Recursion
from .routed import RoutedBlock
from .routing import ROUTING_CHOICES, Route, route_name, router_aux_loss


@dataclass
class MoDOutput:
    logits: Tensor
    loss: Tensor | None = None
    lm_loss: Tensor | None = None
    aux_loss: Tensor | None = None
    routes: list[Route] = field(default_factory=list)
    # Expert layers (n_experts > 0): one record per expert-layer call, in layer order, and the
    # weighted load-balancing + z-loss (mean over those calls); None without experts or cache.
    expert_routes: list[ExpertRoute] = field(default_factory=list)
    moe_loss: Tensor | None = None
    distill_loss: Tensor | None = None  # router tuning with distillation (`tune.Distilled`)


# One class per letter of `layer_pattern` (config.LAYER_KINDS says what each letter means).
BLOCKS: dict[str, type[Block]] = {"D": DenseBlock, "R": RoutedBlock}


# -- the model ------------------------------------------------------------------------------------
class MoDTransformer(nn.Module):
    """Decoder-only MoD transformer (dense when `layer_pattern` has no 'R')."""

    def __init__(self, config: MoDConfig) -> None:
        super().__init__()
        self.config = cfg = config
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(BLOCKS[kind](cfg, i) for i, kind in enumerate(cfg.layer_kinds))
        # Mixture-of-Recursions (docs/mor.md): the blocks are the unique layers, applied by this
        self.recursion = Recursion(cfg) if cfg.recursive else None
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        resid_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        for block in self.blocks:
            nn.init.normal_(block.attn.wo.weight, std=resid_std)
            if isinstance(block.mlp, ExpertMLP):
                block.mlp.reset_parameters(cfg.init_std, resid_std)
            else:
                nn.init.normal_(block.mlp.w2.weight, std=resid_std)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=self.config.init_std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=self.config.init_std)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def route_names(self) -> list[str]:
        """The names of the routes a forward returns, in order (`Route.name`, `Topology.routes`)."""
        return [route_name(layer, kind) for layer, kind in self.config.topology.routes]

    def predictor_for(self, route: Route) -> Predictor:
        """The causal predictor that scored `route` (predictor mode)."""
        if route.kind == RECURSION:
            return self.recursion.predictor[str(route.layer)]
        return self.blocks[route.layer].predictor[route.kind]

    def check_input(self, idx: Tensor) -> Tensor:
        """Shape, length, dtype and id-range checks with clear messages (`checks.token_tensor`,
        shared with `generate`); returns the ids as int64."""
        if not isinstance(idx, Tensor) or idx.dim() != 2:
            shape = tuple(idx.shape) if isinstance(idx, Tensor) else type(idx).__name__
            raise ValueError(f"idx must be a tensor of shape (batch, seq_len), got {shape}")
        B, T = idx.shape
        if B < 1:
            raise ValueError(f"batch size must be >= 1, got idx of shape {tuple(idx.shape)}")
        if T < 1 or T > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {T} is outside [1, max_seq_len={self.config.max_seq_len}]"
            )
        return token_tensor(idx, self.config.vocab_size, "idx")

    def run_blocks(self, x_BTD: Tensor, p: Pass) -> tuple[Tensor, list[Route], Tensor | None]:
        """Every layer on the stream: the blocks in order, or the recursion over them
        (docs/mor.md). The one layer loop of every path (`forward`, and the static decode step,
        static_cache.py): the stream, the routes in forward order, the recursion's own aux loss
        (None without recursion)."""
        if self.recursion is not None:
            return self.recursion(self.blocks, x_BTD, p)
        routes: list[Route] = []
        for block in self.blocks:
            x_BTD, block_routes = block(x_BTD, p)
            routes.extend(block_routes)
        return x_BTD, routes, None

    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        routing: str | None = None,
        cache: Cache | None = None,
        lengths: Tensor | None = None,
        last_only: bool = False,
    ) -> MoDOutput:
        """Logits for `idx` (B, T); losses when `targets` (B, T, ignore index -100) is given.

        Not shifted: ``targets[:, t]`` is what position t predicts, so pass
        ``model(idx[:, :-1], targets=idx[:, 1:])`` (`hf.MoDForCausalLM` shifts ``labels`` itself).

        routing="topk": the paper's top-k per sequence (training; exactly k per row; reads later
        tokens). "causal": each token decides alone. None: top-k in training mode, causal in
        eval mode (`load_model`'s), as the Hugging Face model does (docs/semantics.md).

        `cache` (a `KVCache`, or some rows of one): an empty cache is filled by this forward, a
        prefill (`lengths`: (B,) real tokens of right-padded prompts); a filled one takes one
        token per row, a decode step (causal routing only). `last_only`: logits of each row's
        last real token only, (B, 1, vocab).
        """
        routing = routing or ("topk" if self.training else "causal")
        if routing not in ROUTING_CHOICES:
            raise ValueError(f"routing must be one of {ROUTING_CHOICES}, got {routing!r}")
        idx = self.check_input(idx)
        if targets is not None:
            if not isinstance(targets, Tensor) or targets.shape != idx.shape or last_only:
                shape = tuple(targets.shape) if isinstance(targets, Tensor) else type(targets)
                raise ValueError(
                    f"targets shape {shape} must equal idx shape {tuple(idx.shape)} "
                    "(and logits of every token: last_only=False)"
                )
            targets = check_targets(targets, self.config.vocab_size)
        x_BTD = self.embed(idx)
        p = Pass.start(self.config, idx, routing, cache, lengths, x_BTD.dtype)
        x_BTD, routes, rec_aux = self.run_blocks(x_BTD, p)
        B, T = idx.shape
        if last_only and p.lengths is not None:  # right-padded rows end at different positions
            x_BTD = x_BTD[torch.arange(B, device=idx.device), p.lengths - 1][:, None]
        elif last_only and T > 1:
            x_BTD = x_BTD[:, -1:]
        logits = self.lm_head(self.norm(x_BTD))
        if cache is not None:
            cache.advance(T if lengths is None else torch.as_tensor(lengths).cpu())
        # With a cache there is nothing to train: no aux loss (a prefill's would count padding).
        aux_loss = None if cache is not None else router_aux_loss(routes, logits)
        if self.recursion is not None:  # its own: the routers' BCE, or token choice's balance
            aux_loss = rec_aux
        out = MoDOutput(logits=logits, aux_loss=aux_loss, routes=routes)
        out.expert_routes = list(p.expert_routes)
        if out.expert_routes and cache is None:
            cfg = self.config
            out.moe_loss = torch.stack(
                [
                    cfg.moe_balance_loss_weight * balance_loss(r)
                    + cfg.moe_z_loss_weight * z_loss(r)
                    for r in out.expert_routes
                ]
            ).mean()
        if targets is not None:
            out.lm_loss = F.cross_entropy(
                logits.to(at_least_float32(logits.dtype)).flatten(0, 1),
                targets.flatten(),
                ignore_index=IGNORE_INDEX,
            )
            out.loss = out.lm_loss
            if out.aux_loss is not None:
                out.loss = out.loss + self.config.aux_loss_weight * out.aux_loss
            if out.moe_loss is not None:
                out.loss = out.loss + out.moe_loss
        return out
