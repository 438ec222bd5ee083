"""What a block of the model is: `Pass`, what the blocks of one forward share (routing mode,
rotary tables, the KV cache and the prompt's real tokens); `Block`, the pre-norm transformer
block every layer kind builds on (its sub-blocks' update and its cost); and `DenseBlock`, the
kind every token takes. The routed kind is `routed.RoutedBlock`; `model.BLOCKS` maps the letters
of `layer_pattern` to the kinds.

Names with shape suffixes: B batch, T tokens of the forward, K routed subset, D model width.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .cache import Cache, kv_hook
from .config import LAYER_KINDS, MoDConfig
from .experts import ExpertMLP, ExpertRoute
from .layers import MLP, Attention, KVHook, LayerCost, LayerKV, RMSNorm, price, rope_tables
from .precision import at_least_float32
from .routing import Route


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
    static: bool = False  # decoding every row under masks, no host read (static_cache.py)
    skip_idle: bool = False  # static, run eagerly: a routed block no row takes is skipped
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
        # The model's rotary tables, indexed by each new token's position (layers.rope_tables).
        cos_S, sin_S = rope_tables(
            cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, idx.device, at_least_float32(dtype)
        )
        if cache is None:
            if lengths is not None:
                raise ValueError("lengths (right-padded prompts) are for a prefill: pass a cache")
            return cls(routing, cos_S[:T], sin_S[:T])
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
        if start > 0:  # the prompt is in: a decode step
            if T != 1 or routing != "causal" or lengths is not None:
                raise ValueError(
                    "after its prefill a cache takes one token per row with routing='causal' "
                    "and no lengths (top-k reads the whole sequence and cannot decode); got "
                    f"{T} tokens, routing={routing!r}, lengths={lengths!r}"
                )
            pos_d = pos.to(cache.device)  # each row's own position: tables (n, 1, 1, d)
            cos, sin = cos_S[pos_d, None, None], sin_S[pos_d, None, None]
            return cls(routing, cos, sin, cache, True, getattr(cache, "static", False))
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
        routing, as in decoding; with ``routing="mlp"`` every token runs attention and `attn`
        is unused; with ``routing="mlp_kv"`` `attn` counts the queries and `mlp` the takers,
        which alone project keys), and each attention query sees `keys` keys (default: all the
        tokens that run attention, or with ``skipped_kv="residual"`` all the tokens, whose keys
        the skippers project too; with "mlp_kv", the takers). With experts, `expert_share` of
        the MLP's slots run a real expert (`layers.price`)."""
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
