"""The Mixture-of-Depths transformer: one block class per letter of `layer_pattern` (`BLOCKS`), and
the model, whose one forward path serves training, evaluation, prefill and decoding.

docs/semantics.md states what is computed. A routed block's router reads the residual stream; in
top-k mode the ``k = capacity_tokens(capacity, T)`` highest-scoring tokens of each row, in position
order, are gathered, run through the block (attending only among themselves, or with
``skipped_kv="residual"`` to every earlier token's key from the layer input, at their original
rotary positions) and scattered back as ``x + g(r) * f``, where ``f`` is the block's update; every
other token leaves bit for bit unchanged. In causal mode each token decides for itself (its router
or predictor logit > 0), so no decision reads a later token.

With a KV cache (`cache.py`) the same blocks run a prefill (the prompt, as the full causal forward
runs it, storing each layer's takers) or a decode step (a routed block runs only on the rows whose
token takes it). Each block kind prices its own work (`cost`) for flops.py and the benchmarks.

Names with shape suffixes: B batch, T tokens of the forward, K routed subset, D model width.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import NormalDist

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import Cache, kv_hook
from .checks import IGNORE_INDEX, check_targets, token_tensor
from .config import LAYER_KINDS, MoDConfig
from .experts import ExpertMLP, ExpertRoute, balance_loss, z_loss
from .layers import (
    MLP,
    Attention,
    KVHook,
    LayerCost,
    LayerKV,
    Predictor,
    RMSNorm,
    price,
    rope_tables,
)
from .precision import at_least_float32
from .routing import (
    ROUTING_CHOICES,
    Route,
    causal_attention_mask,
    gate,
    linear32,
    positions_mask,
    router_aux_loss,
    topk_indices,
    topk_mask,
)


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


@dataclass
class Pass:
    """What the blocks of one forward pass share: the routing mode, the rotary tables of the new
    tokens' positions ((T, d), or (B, 1, 1, d) on a decode step) and, with a KV cache, the cache,
    whether this is a decode step, and the real tokens of right-padded prompts."""

    routing: str
    cos: Tensor
    sin: Tensor
    cache: Cache | None = None
    decode: bool = False
    valid_BT: Tensor | None = None
    lengths: Tensor | None = None  # (B,) on the device: real tokens per row
    # Filled by expert layers. A deque, not a list: wrappers that rebuild a block's arguments
    # (FSDP2 maps over lists and dataclasses to hook its backward) pass a deque through as it
    # is, so every block appends to this pass's one record.
    expert_routes: deque[ExpertRoute] = field(default_factory=deque)

    def kv(self, layer: int, take_BT: Tensor | None) -> KVHook | None:
        return None if self.cache is None else kv_hook(self.cache, layer, take_BT, self.decode)

    @classmethod
    def start(
        cls,
        cfg: MoDConfig,
        idx: Tensor,
        routing: str,
        cache: Cache | None,
        lengths: Tensor | None,
        dtype: torch.dtype,
    ) -> Pass:
        """The pass over `idx`: the rotary tables of the new tokens' positions, and the cache's
        mode (none, a prefill or a decode step), with the checks each mode needs."""
        B, T = idx.shape
        if cache is None:
            if lengths is not None:
                raise ValueError("lengths (right-padded prompts) are for a prefill: pass a cache")
            cos, sin = rope_tables(
                cfg.head_dim, T, cfg.rope_theta, idx.device, at_least_float32(dtype)
            )
            return cls(routing, cos, sin)
        if cache.dtype != dtype:
            raise ValueError(
                f"the KV cache holds {cache.dtype} but the model computes in {dtype}: build the "
                "cache with the model's dtype"
            )
        pos = cache.positions()
        if len(pos) != B:
            raise ValueError(f"idx has {B} rows but the cache has {len(pos)}")
        start = int(pos.max())
        if start + T > cache.max_len:
            raise RuntimeError(
                f"the KV cache holds max_len={cache.max_len} positions; row at {start} cannot take "
                f"{T} more"
            )
        cos_S, sin_S = cache.rope()
        if start > 0:  # the prompt is in: a decode step
            if T != 1 or routing != "causal" or lengths is not None:
                raise ValueError(
                    "after its prefill a cache takes one token per row with routing='causal' "
                    "and no lengths (top-k reads the whole sequence and cannot decode); got "
                    f"{T} tokens, routing={routing!r}, lengths={lengths!r}"
                )
            pos_d = pos.to(cache.device)  # each row's own position: tables (n, 1, 1, d)
            return cls(routing, cos_S[pos_d, None, None], sin_S[pos_d, None, None], cache, True)
        if lengths is None:
            return cls(routing, cos_S[:T], sin_S[:T], cache)
        lens = torch.as_tensor(lengths).cpu()
        if lens.dtype.is_floating_point or lens.dtype == torch.bool or lens.is_complex():
            raise ValueError(f"lengths must hold integers, got dtype {lens.dtype}")
        if lens.shape != (B,) or int(lens.min()) < 1 or int(lens.max()) > T:
            raise ValueError(f"lengths must be (batch,) = ({B},) in [1, {T}], got {lens.tolist()}")
        lens_d = lens.to(idx.device)
        valid_BT = torch.arange(T, device=idx.device)[None, :] < lens_d[:, None]
        return cls(routing, cos_S[:T], sin_S[:T], cache, valid_BT=valid_BT, lengths=lens_d)


# -- blocks ---------------------------------------------------------------------------------------
Count = float | None  # tokens (or a share of them) in a cost function; None: the kind's default


class Block(nn.Module):
    """A pre-norm transformer block. Subclasses (one per layer kind) say which tokens take it."""

    kind = ""  # its letter in `layer_pattern`

    @property
    def routed(self) -> bool:
        return LAYER_KINDS[self.kind].routed

    def __init__(self, cfg: MoDConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = ExpertMLP(cfg, layer) if cfg.has_experts else MLP(cfg)

    def update(
        self,
        kind: str,
        x_BKD: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        kv: KVHook | LayerKV | None = None,
        p: Pass | None = None,
    ) -> Tensor:
        """The update f(x~) of sub-block `kind` ("block", "attn" or "mlp"); the outer residual is
        added by the caller. For the whole block, f = a + mlp(mlp_norm(x~ + a))."""
        if kind == "mlp":
            return self.mlp_update(self.mlp_norm(x_BKD), p)
        a_BKD = self.attn(self.attn_norm(x_BKD), cos, sin, mask, kv)
        if kind == "attn":
            return a_BKD
        return a_BKD + self.mlp_update(self.mlp_norm(x_BKD + a_BKD), p)

    def mlp_update(self, h: Tensor, p: Pass | None) -> Tensor:
        """The MLP, or the expert layer, which records its route on the pass; capacity
        dropping only in training's top-k forward (never causal, never with a cache)."""
        if not isinstance(self.mlp, ExpertMLP):
            return self.mlp(h)
        drop = self.training and p is not None and p.routing == "topk" and p.cache is None
        y, route = self.mlp(h, drop=drop)
        if p is not None:
            p.expert_routes.append(route)
        return y

    def forward(self, x_BTD: Tensor, p: Pass) -> tuple[Tensor, list[Route]]:
        raise NotImplementedError

    @staticmethod
    def cost(
        cfg: MoDConfig,
        tokens: float,
        attn: Count = None,
        mlp: Count = None,
        keys: Count = None,
        expert_share: float = 1.0,
    ) -> LayerCost:
        """The layer's work when `tokens` tokens reach it: `attn` / `mlp` of them run each
        sub-block where the kind lets tokens choose (default: top-k's choice; given: causal
        routing, as in decoding), and each attention query sees `keys` keys (default: all the
        tokens that run attention, or with ``skipped_kv="residual"`` all the tokens, whose keys
        the skippers project too). With experts, `expert_share` of the MLP's slots run a real
        expert (`layers.price`)."""
        raise NotImplementedError


class DenseBlock(Block):
    """Every token takes the block."""

    kind = "D"

    def forward(self, x_BTD: Tensor, p: Pass) -> tuple[Tensor, list[Route]]:
        # A padded prompt stores only its real tokens (p.valid_BT) in the cache.
        kv = p.kv(self.layer, p.valid_BT)
        return x_BTD + self.update("block", x_BTD, p.cos, p.sin, None, kv, p), []

    @staticmethod
    def cost(
        cfg: MoDConfig,
        tokens: float,
        attn: Count = None,
        mlp: Count = None,
        keys: Count = None,
        expert_share: float = 1.0,
    ) -> LayerCost:
        return price(
            cfg, tokens, tokens, tokens if keys is None else keys, expert_share=expert_share
        )


class RoutedBlock(Block):
    """A router (joint routing), or one for attention and one for the MLP (staggered routing),
    picks the tokens that take the block; the others ride the residual stream unchanged."""

    kind = "R"

    def __init__(self, cfg: MoDConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.route_kinds = ("block",) if cfg.routing == "joint" else ("attn", "mlp")
        self.router = nn.ModuleDict(
            {kind: nn.Linear(cfg.d_model, 1, bias=False) for kind in self.route_kinds}
        )
        if cfg.has_predictor:
            self.predictor = nn.ModuleDict(
                {kind: Predictor(cfg.d_model, cfg.predictor_hidden) for kind in self.route_kinds}
            )

    def router_weight(self, kind: str, x_BTD: Tensor) -> Tensor:
        """Raw router weights r = x @ w (B, T), in at least float32."""
        if self.cfg.router_scores == "random":  # ablation: scores that know nothing
            # N(0, 1) noise less its (1 - p) quantile: the causal decision r > 0 takes a token
            # with probability p, the capacity or this router's rate; top-k ranks it as noise.
            j = self.cfg.routed_layers.index(self.layer) * len(self.route_kinds)
            p = min(
                max(self.cfg.random_take_rate(j + self.route_kinds.index(kind)), 1e-6), 1 - 1e-6
            )
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

    def forward(self, x_BTD: Tensor, p: Pass) -> tuple[Tensor, list[Route]]:
        routes = []
        for kind in self.route_kinds:  # staggered: the MLP's router reads the attention's output
            x_BTD, route = self.route(kind, x_BTD, p)
            routes.append(route)
        return x_BTD, routes

    def route(self, kind: str, x_BTD: Tensor, p: Pass) -> tuple[Tensor, Route]:
        T = x_BTD.shape[1]
        pred_BT = self.predictor_logits(kind, x_BTD)
        if p.decode:  # one new token per row: top-k over it means nothing
            # The predictor decides; the router's weight then only gates the rows that take.
            r_BT = self.router_weight(kind, x_BTD) if pred_BT is None else None
            take_BT = ((r_BT if pred_BT is None else pred_BT) > 0).cpu()  # the one host sync
            x_BTD = self.run_rows(kind, x_BTD, r_BT, take_BT, p)
            return x_BTD, Route(self.layer, kind, take_BT, r_BT, None, pred_BT)
        r_BT = self.router_weight(kind, x_BTD)
        decide_BT = r_BT if pred_BT is None else pred_BT
        if p.valid_BT is None:
            idx_BK = topk_indices(r_BT, self.cfg.capacity_tokens(T))
            target_BT = positions_mask(idx_BK, T)
            if p.routing == "topk":  # training: gather exactly k tokens per row
                x_BTD = self.run_topk(kind, x_BTD, r_BT, idx_BK, p)
                return x_BTD, Route(self.layer, kind, target_BT, r_BT, target_BT, pred_BT)
        else:  # right-padded prompts: top-k over each row's own tokens
            k_B = self.cfg.capacity_tokens(p.lengths)
            target_BT = topk_mask(r_BT, k_B, p.valid_BT)
        take_BT = target_BT if p.routing == "topk" else decide_BT > 0
        if p.valid_BT is not None:
            take_BT = take_BT & p.valid_BT
        x_BTD = self.run_masked(kind, x_BTD, r_BT, take_BT, p)
        return x_BTD, Route(self.layer, kind, take_BT, r_BT, target_BT, pred_BT)

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
        B, T, D = x_BTD.shape
        k = idx_BK.shape[1]
        if k == 0:
            if kind != "mlp" and self.residual_kv and p.cache is not None:
                self.layer_kv(x_BTD, p, idx_BK)  # the cache still stores every token
            return x_BTD
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
        ``skipped_kv="residual"``, to every earlier token); skippers keep x."""
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
        appends its key and value first). `r_N1` None: the router weights are needed for the gate
        of the taking rows only (predictor mode), computed here."""
        sel = take_N1.view(-1).nonzero().view(-1)
        m, n = len(sel), len(take_N1)
        residual = kind != "mlp" and self.residual_kv
        if residual:  # every row stores its key and value, taking the layer or not
            k, v = self.attn.kv(self.attn_norm(x_N1D), p.cos, p.sin)
            p.cache.append(self.layer, k, v)
        if m == 0:
            return x_N1D
        cache, cos, sin, x_M1D, r_M1, sel_d = p.cache, p.cos, p.sin, x_N1D, r_N1, None
        if m < n:
            sel_d = sel.to(x_N1D.device)
            # One row, the common case at low capacity: slices, not gathers.
            pick = slice(int(sel[0]), int(sel[0]) + 1) if m == 1 else sel_d
            x_M1D, cos, sin = x_N1D[pick], cos[pick], sin[pick]
            r_M1 = None if r_N1 is None else r_N1[pick]
            cache = None if kind == "mlp" else cache.subset(sel)
        if r_M1 is None:
            r_M1 = self.router_weight(kind, x_M1D)
        kv: KVHook | LayerKV | None = None
        if residual:
            kv = LayerKV(*cache.read(self.layer))
        elif cache is not None:
            kv = kv_hook(cache, self.layer, None, decode=True)
        y_M1D = self.gated(kind, x_M1D, r_M1, cos, sin, None, kv, p)
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
        routers = 1 if cfg.routing == "joint" else 2  # staggered: attention's and the MLP's
        predicted = tokens * routers if cfg.has_predictor else 0.0
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

    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        routing: str = "topk",
        cache: Cache | None = None,
        lengths: Tensor | None = None,
        last_only: bool = False,
    ) -> MoDOutput:
        """Logits for `idx` (B, T); losses when `targets` (B, T, ignore index -100) is given.

        routing="topk": the paper's expert-choice top-k per sequence (training; exactly k per row).
        routing="causal": each token decides for itself; no decision reads a later token.

        `cache` (a `KVCache`, or some rows of one): an empty cache is filled by this forward, a
        prefill (`lengths`: (B,) real tokens of right-padded prompts); a filled one takes one
        token per row, a decode step (causal routing only). `last_only`: logits of each row's
        last real token only, (B, 1, vocab).
        """
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
        routes: list[Route] = []
        for block in self.blocks:
            x_BTD, block_routes = block(x_BTD, p)
            routes.extend(block_routes)
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
