"""The parts a block is built from: RMSNorm, rotary embeddings, attention, the SwiGLU MLP and the
causal routing predictor; and `price`, which turns the token counts of a layer's work into FLOPs
and weights read.

Each module says what one token costs it, so a block kind's `cost` (model.py) prices its work from
the same place the work is defined.

Names with shape suffixes: B batch, H heads, K tokens of this call, d head dim, D model width.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import MoDConfig
from .experts import ExpertMLP
from .routing import linear32

# A KV cache's hook into attention: (new k, new v, mask) -> (keys, values, mask) to attend to.
KVHook = Callable[[Tensor, Tensor, Tensor | None], tuple[Tensor, Tensor, Tensor | None]]


@dataclass(frozen=True)
class LayerKV:
    """Keys and values computed beforehand from the layer's whole input (``skipped_kv=
    "residual"``), with the mask of which key each query sees (None: every key given). The
    attention then projects only its queries."""

    k: Tensor  # (B, n_kv_heads, S, head_dim), rotated
    v: Tensor
    mask: Tensor | None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(
    head_dim: int,
    seq_len: int,
    theta: float,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """Rotary tables (seq_len, head_dim): ``cat(cos, cos)`` and ``cat(-sin, sin)`` of the angles.

    Computed in float64 and rounded once to `dtype`, then kept (per head_dim, length, theta,
    device and dtype: the one owner of the tables, read-only) rather than held as buffers, so
    `model.to(torch.bfloat16)` cannot round the angles of far positions and a float64 model gets
    float64 rotations. Every path indexes them by its tokens' positions (`blocks.Pass`). The
    signed, doubled layout makes `apply_rope` four ops.
    """
    build = _rope_tables.__wrapped__ if torch.compiler.is_compiling() else _rope_tables
    return build(head_dim, seq_len, theta, torch.device(device or "cpu"), dtype)  # traced: no cache


@functools.lru_cache(maxsize=32)
def _rope_tables(
    head_dim: int, seq_len: int, theta: float, device: torch.device, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    # Plain tensors even under inference_mode: a later training forward may save them.
    with torch.inference_mode(False), torch.no_grad():
        i = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device)
        pos = torch.arange(seq_len, dtype=torch.float64, device=device)
        angles = torch.outer(pos, 1.0 / theta ** (i / head_dim))
        cos, sin = angles.cos(), angles.sin()
        return torch.cat((cos, cos), -1).to(dtype), torch.cat((-sin, sin), -1).to(dtype)


def apply_rope(x_BHKd: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each pair (x[i], x[i + d/2]) by its angle: ``x1 cos - x2 sin, x2 cos + x1 sin``.

    cos/sin from `rope_tables`, (K, d) or broadcast as (B, 1, K, d). Computed in at least float32.
    """
    x = x_BHKd.to(cos.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((x2, x1), -1) * sin).type_as(x_BHKd)


class Attention(nn.Module):
    def __init__(self, cfg: MoDConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        # One projection for q, k and v (rows in that order): one matmul instead of three.
        self.wqkv = nn.Linear(
            cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=False
        )
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def q(self, x_BKD: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotated queries (B, n_heads, K, head_dim) alone: the rows of wqkv that make them."""
        B, K, _ = x_BKD.shape
        nq = self.n_heads * self.head_dim
        q = F.linear(x_BKD, self.wqkv.weight[:nq]).view(B, K, self.n_heads, self.head_dim)
        return apply_rope(q.transpose(1, 2), cos, sin)

    def kv(self, x_BTD: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Rotated keys and values (B, n_kv_heads, T, head_dim) alone: what a token that skips
        a ``skipped_kv="residual"`` layer computes."""
        B, T, _ = x_BTD.shape
        nq, Hkv = self.n_heads * self.head_dim, self.n_kv_heads
        kv = F.linear(x_BTD, self.wqkv.weight[nq:]).view(B, T, 2 * Hkv, self.head_dim)
        k, v = kv.transpose(1, 2).split((Hkv, Hkv), dim=1)
        return apply_rope(k, cos, sin), v

    def qkv(self, x_BKD: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys (both rotated) and values, shaped (B, heads, K, head_dim)."""
        B, K, _ = x_BKD.shape
        H, Hkv = self.n_heads, self.n_kv_heads
        qkv = self.wqkv(x_BKD).view(B, K, H + 2 * Hkv, self.head_dim).transpose(1, 2)
        qk, v = qkv.split((H + Hkv, Hkv), dim=1)
        q, k = apply_rope(qk, cos, sin).split((H, Hkv), dim=1)  # rotate q and k in one go
        return q, k, v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None) -> Tensor:
        """SDPA then the output projection.

        `attn_mask` None means causal: query i sees keys <= i when queries and keys are the same
        tokens, and a single query (a decode step) sees every key it is given.
        """
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            is_causal=attn_mask is None and q.shape[-2] > 1,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        B, _, K, _ = q.shape
        return self.wo(y.transpose(1, 2).reshape(B, K, self.n_heads * self.head_dim))

    def forward(
        self,
        x_BKD: Tensor,
        cos: Tensor,
        sin: Tensor,
        attn_mask: Tensor | None,
        kv: KVHook | LayerKV | None = None,
    ) -> Tensor:
        if isinstance(kv, LayerKV):  # keys and values of the whole input, made by the caller
            return self.attend(self.q(x_BKD, cos, sin), kv.k, kv.v, kv.mask)
        q, k, v = self.qkv(x_BKD, cos, sin)
        if kv is not None:  # a KV cache: store the new keys/values, attend to what it holds
            k, v, attn_mask = kv(k, v, attn_mask)
        return self.attend(q, k, v, attn_mask)

    # -- what a token costs -------------------------------------------------------------------
    @staticmethod
    def params(cfg: MoDConfig) -> float:
        """Weights of wqkv and wo."""
        hd = cfg.head_dim
        return (
            cfg.d_model * (cfg.n_heads + 2 * cfg.n_kv_heads) * hd + cfg.n_heads * hd * cfg.d_model
        )

    @staticmethod
    def kv_params(cfg: MoDConfig) -> float:
        """Weights of the key and value rows of wqkv: all a token that skips a
        ``skipped_kv="residual"`` layer runs."""
        return cfg.d_model * 2 * cfg.n_kv_heads * cfg.head_dim

    @staticmethod
    def flops_per_key(cfg: MoDConfig) -> float:
        """QK^T and AV for one query against one key, all heads."""
        return 4.0 * cfg.n_heads * cfg.head_dim

    @staticmethod
    def kv_entry(cfg: MoDConfig) -> float:
        """Key and value elements one token stores in one layer's cache."""
        return 2.0 * cfg.n_kv_heads * cfg.head_dim


class MLP(nn.Module):
    """SwiGLU: w2(silu(x W1) * x W3), with W1 and W3 in one projection `w13` (rows: W1, then W3)."""

    def __init__(self, cfg: MoDConfig) -> None:
        super().__init__()
        self.w13 = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        a, b = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(a) * b)

    @staticmethod
    def params(cfg: MoDConfig) -> float:
        return 3.0 * cfg.d_model * cfg.d_ff


class Predictor(nn.Module):
    """Small MLP that predicts top-k membership causally from the router's (detached) input."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, x: Tensor) -> Tensor:
        # Stop-gradient: it learns from its own BCE and never shapes the LM (docs/semantics.md).
        h = F.silu(linear32(x.detach() if torch.is_grad_enabled() else x, self.fc1))
        return linear32(h, self.fc2).squeeze(-1)

    @staticmethod
    def flops_per_token(cfg: MoDConfig) -> float:
        return 2.0 * (cfg.d_model * cfg.predictor_hidden + cfg.predictor_hidden)

    @staticmethod
    def params(cfg: MoDConfig) -> float:
        return cfg.d_model * cfg.predictor_hidden + 2 * cfg.predictor_hidden + 1


# -- what a layer costs ----------------------------------------------------------------------
@dataclass(frozen=True)
class LayerCost:
    """One layer's work on some tokens, priced by the modules that do it (FLOPs as
    `FlopCounterMode` counts them: a multiply-add is 2, only matrix products count)."""

    attn_tokens: float  # queries; all but `q_only` of them also store a key and value
    kv_only: float  # tokens that only project (and store) a key and value ("residual" skippers)
    matmul: float  # q/k/v/o projections and the MLP
    attention: float  # QK^T and AV
    router: float
    predictor: float
    params: float  # weights read, each module once per token that runs it
    kv_entries: float  # cached (key, value) pairs the attention reads
    q_only: float = 0.0  # queries with no key or value of their own ("mlp_kv" skippers)

    @property
    def flops(self) -> float:
        return self.matmul + self.attention + self.router + self.predictor


def price(
    cfg: MoDConfig,
    attn: float,
    mlp: float,
    keys: float,
    routed: float = 0.0,
    predicted: float = 0.0,
    expert_share: float = 1.0,
    kv_only: float = 0.0,
    q_only: float = 0.0,
) -> LayerCost:
    """`attn` tokens run attention (each query against `keys` keys), `mlp` tokens run the MLP,
    a router weighs `routed` tokens and a predictor scores `predicted` (summed over routers);
    `kv_only` more tokens project a key and a value and nothing else; `q_only` more tokens are
    queries (their query and output projections, against `keys` keys) with no key or value.

    With experts (`cfg.has_experts`), each of the `mlp` tokens is weighed by the expert router and
    fills `experts_per_token` slots, of which the share `expert_share` runs a real expert (the
    rest chose a no-op expert or were dropped by the capacity: they cost nothing)."""
    if cfg.has_experts:
        slots = mlp * cfg.experts_per_token * expert_share
        mlp_work, mlp_router = slots * ExpertMLP.params(cfg), mlp * ExpertMLP.router_params(cfg)
    else:
        mlp_work, mlp_router = mlp * MLP.params(cfg), 0.0
    kv_work = kv_only * Attention.kv_params(cfg)
    q_work = q_only * (Attention.params(cfg) - Attention.kv_params(cfg))
    queries = attn + q_only
    return LayerCost(
        attn_tokens=queries,
        kv_only=kv_only,
        matmul=2 * (attn * Attention.params(cfg) + kv_work + q_work + mlp_work),
        attention=queries * keys * Attention.flops_per_key(cfg),
        router=routed * 2 * cfg.d_model + 2 * mlp_router,
        predictor=predicted * Predictor.flops_per_token(cfg),
        params=attn * Attention.params(cfg)
        + kv_work
        + q_work
        + mlp_work
        + mlp_router
        + routed * cfg.d_model
        + predicted * Predictor.params(cfg),
        kv_entries=queries * keys,
        q_only=q_only,
    )
