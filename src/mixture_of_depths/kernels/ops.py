"""The Triton kernels and their autograd functions (`kernels.reference` is the oracle).

`gather_linear`: ``rms_norm(x[rows]) @ W.T`` in one pass: each program reads its rows of x
through the index vector, accumulates the dot product with the norm's weight folded in and the
rows' sums of squares beside it, and scales by ``rsqrt(mean(x^2) + eps)`` at the end (the norm
is a per-row scale, so it commutes with the matmul). `scatter_linear`: ``out[rows] += g *
(extra + a @ W.T)`` with the scatter and the gate in the matmul's epilogue (the rows are
distinct: plain stores, no atomics). Backward recomputes in PyTorch (the weight gradients are
ordinary matmuls); the forward saves nothing larger than its inputs.

Kernels are built on first use, so that ``TRITON_INTERPRET=1`` set by then is honoured.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import reference


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def gather_mm(x, rows, w, nw, y, M, N, K, eps, HAS_NORM: tl.constexpr, PREC: tl.constexpr,
                  ACC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr):  # fmt: skip
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        src = tl.load(rows + rm, mask=rm < M, other=0).to(tl.int64)
        acc = tl.zeros((BM, BN), dtype=ACC)
        ss = tl.zeros((BM,), dtype=ACC)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            a = tl.load(x + src[:, None] * K + rk[None, :],
                        mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)  # fmt: skip
            b = tl.load(w + rn[None, :] * K + rk[:, None],
                        mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0)  # fmt: skip
            if HAS_NORM:
                af = a.to(ACC)
                ss += tl.sum(af * af, axis=1)
                g = tl.load(nw + rk, mask=rk < K, other=0.0).to(ACC)
                a = (af * g[None, :]).to(b.dtype)
            acc += tl.dot(a, b, input_precision=PREC)
        if HAS_NORM:
            acc = acc * tl.rsqrt(ss / K + eps)[:, None]
        tl.store(y + rm[:, None] * N + rn[None, :], acc.to(y.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))  # fmt: skip

    @triton.jit
    def scatter_mm(out, rows, gate, a, w, extra, M, N, K, HAS_EXTRA: tl.constexpr,
                   PREC: tl.constexpr, ACC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr):  # fmt: skip
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=ACC)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            x = tl.load(a + rm[:, None] * K + rk[None, :],
                        mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)  # fmt: skip
            b = tl.load(w + rn[None, :] * K + rk[:, None],
                        mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0)  # fmt: skip
            acc += tl.dot(x, b, input_precision=PREC)
        ok = (rm[:, None] < M) & (rn[None, :] < N)
        f = acc.to(out.dtype.element_ty)  # the projection's output, rounded as F.linear's
        if HAS_EXTRA:
            f = f + tl.load(extra + rm[:, None] * N + rn[None, :], mask=ok, other=0.0)
        dst = tl.load(rows + rm, mask=rm < M, other=0).to(tl.int64)
        g = tl.load(gate + rm, mask=rm < M, other=0.0).to(out.dtype.element_ty)
        ptr = out + dst[:, None] * N + rn[None, :]
        tl.store(ptr, tl.load(ptr, mask=ok, other=0.0) + g[:, None] * f, mask=ok)

    return gather_mm, scatter_mm


def _blocks(x: Tensor) -> dict[str, Any]:
    """Tile sizes (small ones under the interpreter, where a tile is a numpy loop), the dot's
    precision (IEEE: float32 without TF32, as PyTorch's default matmul) and the accumulator
    (float32; float64 for float64)."""
    import triton.language as tl

    big = x.is_cuda
    acc = tl.float64 if x.dtype == torch.float64 else tl.float32
    return dict(BM=64 if big else 16, BN=64 if big else 16, BK=32 if big else 16, PREC="ieee",
                ACC=acc)  # fmt: skip


class _GatherLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, rows_M, weight_OD, norm_D, eps):  # noqa: ANN001, ANN205
        x_ND, weight_OD = x_ND.contiguous(), weight_OD.contiguous()
        M, (n_out, D) = rows_M.numel(), weight_OD.shape
        y = torch.empty(M, n_out, device=x_ND.device, dtype=x_ND.dtype)
        if M:
            gather_mm, _ = _kernels()
            kw = _blocks(x_ND)
            grid = (-(-M // kw["BM"]), -(-n_out // kw["BN"]))
            nw = norm_D if norm_D is not None else weight_OD  # unread without a norm
            gather_mm[grid](x_ND, rows_M, weight_OD, nw, y, M, n_out, D, eps,
                            HAS_NORM=norm_D is not None, **kw)  # fmt: skip
        ctx.save_for_backward(x_ND, rows_M, weight_OD, norm_D)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        x, rows, w, nw = ctx.saved_tensors
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in (x, w, nw)
                  if t is not None]  # fmt: skip
        with torch.enable_grad():
            y = reference.gather_linear(leaves[0], rows, leaves[1],
                                        leaves[2] if nw is not None else None, ctx.eps)  # fmt: skip
            want = [t for t in leaves if t.requires_grad]
            got = iter(torch.autograd.grad(y, want, dy) if want else ())
        grads = [next(got) if t.requires_grad else None for t in leaves]
        return grads[0], None, grads[1], grads[2] if nw is not None else None, None


class _ScatterLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out_ND, rows_M, gate_M, a_MK, weight_DK, extra_MD):  # noqa: ANN001, ANN205
        new = out_ND.contiguous().clone()
        a_MK, weight_DK = a_MK.contiguous(), weight_DK.contiguous()
        M, (D, K) = rows_M.numel(), weight_DK.shape
        if M:
            _, scatter_mm = _kernels()
            kw = _blocks(a_MK)
            grid = (-(-M // kw["BM"]), -(-D // kw["BN"]))
            extra = extra_MD.contiguous() if extra_MD is not None else a_MK  # unread if None
            scatter_mm[grid](new, rows_M, gate_M.contiguous(), a_MK, weight_DK, extra, M, D, K,
                             HAS_EXTRA=extra_MD is not None, **kw)  # fmt: skip
        ctx.save_for_backward(rows_M, gate_M, a_MK, weight_DK, extra_MD)
        return new

    @staticmethod
    def backward(ctx, dnew):  # noqa: ANN001, ANN205
        rows, gate, a, w, extra = ctx.saved_tensors
        d_rows = dnew.index_select(0, rows)
        ins = [gate, a, w, extra]
        leaves = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in ins]
        with torch.enable_grad():
            f = F.linear(leaves[1], leaves[2])
            if extra is not None:
                f = f + leaves[3]
            contrib = leaves[0].unsqueeze(-1).to(f.dtype) * f
            want = [t for t in leaves if t is not None and t.requires_grad]
            got = iter(torch.autograd.grad(contrib, want, d_rows) if want else ())
        grads = [next(got) if t is not None and t.requires_grad else None for t in leaves]
        return dnew, None, *grads


def gather_linear(
    x_ND: Tensor, rows_M: Tensor, weight_OD: Tensor, norm_D: Tensor | None, eps: float
) -> Tensor:
    """`reference.gather_linear` in one Triton kernel."""
    return _GatherLinear.apply(x_ND, rows_M, weight_OD, norm_D, eps)


def scatter_linear(
    out_ND: Tensor,
    rows_M: Tensor,
    gate_M: Tensor,
    a_MK: Tensor,
    weight_DK: Tensor,
    extra_MD: Tensor | None = None,
) -> Tensor:
    """`reference.scatter_linear` in one Triton kernel."""
    return _ScatterLinear.apply(out_ND, rows_M, gate_M, a_MK, weight_DK, extra_MD)
