"""The fused kernels' ops in plain PyTorch: what `ops` must compute (forward and gradients)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def gather_linear(
    x_ND: Tensor, rows_M: Tensor, weight_OD: Tensor, norm_D: Tensor | None, eps: float
) -> Tensor:
    """``rms_norm(x[rows]) @ W.T`` (M, O); no norm when `norm_D` is None."""
    x_MD = x_ND.index_select(0, rows_M)
    if norm_D is not None:
        x_MD = F.rms_norm(x_MD, (x_MD.shape[-1],), norm_D, eps)
    return F.linear(x_MD, weight_OD)


def scatter_linear(
    out_ND: Tensor,
    rows_M: Tensor,
    gate_M: Tensor,
    a_MK: Tensor,
    weight_DK: Tensor,
    extra_MD: Tensor | None = None,
) -> Tensor:
    """A copy of `out` with ``out[rows[i]] += gate[i] * (extra[i] + (a @ W.T)[i])``; `rows`
    distinct (the chosen tokens)."""
    f_MD = F.linear(a_MK, weight_DK)
    if extra_MD is not None:
        f_MD = f_MD + extra_MD
    return out_ND.index_add(0, rows_M, gate_M.unsqueeze(-1).to(f_MD.dtype) * f_MD)
