"""The routed block's top-k forward on the fused kernels: the rule of `RoutedBlock.run` on a
top-k selection (selection.py gives the rows, positions and gates; docs/semantics.md) with the
gather folded into the first projection and the gated scatter-add into the last one's
epilogue.

- attention ("attn", and the first half of "block"): ``qkv = gather_linear(x, rows, wqkv,
  attn_norm)``, rotary at the original positions, causal SDPA over the chosen tokens;
- the MLP ("mlp"): ``h = gather_linear(x, rows, w13, mlp_norm)``, SwiGLU;
- the end: ``scatter_linear(x, rows, g, ..., wo or w2)`` writes ``x + g * f`` for the chosen
  rows; a whole block passes the attention's output as the epilogue's extra term, since
  ``f = a + mlp(mlp_norm(x~ + a))``.

With ``routing="mlp_kv"`` the takers' MLP runs here as "mlp"; the attention before it, whose
queries are every token (no gather to fuse), stays in PyTorch (mlp_kv.attend).
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor

from ..layers import MLP, apply_rope
from . import ops


def applies(block: Any, kind: str, p: Any) -> bool:
    """Whether this call of the top-k path can take the fused kernels: training's forward (no
    cache), routing-isolated attention, the plain SwiGLU MLP (not an expert layer)."""
    residual = kind != "mlp" and block.residual_kv
    return p.cache is None and not residual and isinstance(block.mlp, MLP)


def _attention(block: Any, x_ND: Tensor, rows_N: Tensor, B: int, k: int, s: Any) -> Tensor:
    """SDPA's output (B*k, H*d) of the chosen tokens, queries and keys among themselves."""
    attn = block.attn
    H, Hkv, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
    qkv = ops.gather_linear(x_ND, rows_N, attn.wqkv.weight, block.attn_norm.weight,
                            block.attn_norm.eps)  # fmt: skip
    qkv = qkv.view(B, k, H + 2 * Hkv, d).transpose(1, 2)
    qk, v = qkv.split((H + Hkv, Hkv), dim=1)
    q, key = apply_rope(qk, s.cos, s.sin).split((H, Hkv), dim=1)
    y = F.scaled_dot_product_attention(q, key, v, is_causal=k > 1, enable_gqa=Hkv != H)
    return y.transpose(1, 2).reshape(B * k, H * d)


def _swiglu(h: Tensor) -> Tensor:
    a, b = h.chunk(2, dim=-1)
    return F.silu(a) * b


def run_topk(block: Any, kind: str, x_BTD: Tensor, g_BT: Tensor, s: Any) -> Tensor:
    """`RoutedBlock.run` on the kernels for a top-k selection `s` (selection.py: its rows and
    gates; ``applies`` holds; k > 0)."""
    B, T, D = x_BTD.shape
    k = s.idx.shape[1]
    rows_N, x_ND = s.rows, x_BTD.reshape(B * T, D)
    g_N = s.gather(g_BT).flatten()
    if kind == "mlp":
        h = ops.gather_linear(x_ND, rows_N, block.mlp.w13.weight, block.mlp_norm.weight,
                              block.mlp_norm.eps)  # fmt: skip
        out = ops.scatter_linear(x_ND, rows_N, g_N, _swiglu(h), block.mlp.w2.weight)
        return out.view(B, T, D)
    y = _attention(block, x_ND, rows_N, B, k, s)
    if kind == "attn":
        return ops.scatter_linear(x_ND, rows_N, g_N, y, block.attn.wo.weight).view(B, T, D)
    a_ND = block.attn.wo(y)
    h = block.mlp.w13(block.mlp_norm(x_ND.index_select(0, rows_N) + a_ND))
    out = ops.scatter_linear(x_ND, rows_N, g_N, _swiglu(h), block.mlp.w2.weight, a_ND)
    return out.view(B, T, D)
