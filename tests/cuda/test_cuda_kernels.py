"""The fused routed-block kernels (mixture_of_depths.kernels) against their PyTorch reference,
forward and backward: on a CPU under Triton's interpreter (float32 and float64; it mishandles
bf16), on CUDA for real (bf16 too). Skipped without Triton. A whole model's training step with
the kernels equals the PyTorch path's."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from devices import DTYPES, MODES, TOLERANCE, assert_close_rel, moved, on_cuda
from helpers import make_model, random_tokens, tiny_config

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (the [gpu] extra)", allow_module_level=True)
if not torch.cuda.is_available():  # read when triton is first imported: before it is
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mixture_of_depths import kernels  # noqa: E402
from mixture_of_depths.kernels import ops, reference  # noqa: E402


def _skip_unsupported(device: str, dtype: str) -> None:
    if dtype == "bf16" and not on_cuda(device):
        pytest.skip("Triton's interpreter mishandles bf16: real kernels only")


def _inputs(device, dt, shape, seed):  # noqa: ANN001, ANN202
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(device, dt).requires_grad_()
            for s in shape]  # fmt: skip


def _grads(y, inputs, dy):  # noqa: ANN001, ANN202
    return torch.autograd.grad(y, inputs, dy)


ROWS = [0, 3, 4, 9, 17, 30, 31, 38]  # distinct, sorted, with neighbours and the last row


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", ["f64", "f32", "bf16"])
def test_gather_linear_equals_index_select_norm_and_matmul(device, dtype, norm):
    _skip_unsupported(device, dtype)
    dt = DTYPES[dtype]
    x, w, nw = _inputs(device, dt, [(39, 40), (24, 40), (40,)], seed=0)
    rows = torch.tensor(ROWS, device=device)
    nw_ = nw if norm else None
    y = ops.gather_linear(x, rows, w, nw_, 1e-5)
    want = reference.gather_linear(x, rows, w, nw_, 1e-5)
    assert_close_rel(y, want, TOLERANCE[dt])
    dy = torch.randn_like(want)
    ins = [x, w, nw] if norm else [x, w]
    for got, exp in zip(_grads(y, ins, dy), _grads(want, ins, dy), strict=True):
        assert_close_rel(got, exp, TOLERANCE[dt])


@pytest.mark.parametrize("extra", [True, False])
@pytest.mark.parametrize("dtype", ["f64", "f32", "bf16"])
def test_scatter_linear_equals_matmul_gate_and_index_add(device, dtype, extra):
    """Only the chosen rows change; each by g * (extra + a @ W.T)."""
    _skip_unsupported(device, dtype)
    dt = DTYPES[dtype]
    out, gate, a, w, ex = _inputs(device, dt, [(39, 24), (8,), (8, 40), (24, 40), (8, 24)], 1)
    rows = torch.tensor(ROWS, device=device)
    ex_ = ex if extra else None
    y = ops.scatter_linear(out, rows, gate, a, w, ex_)
    want = reference.scatter_linear(out, rows, gate, a, w, ex_)
    assert_close_rel(y, want, TOLERANCE[dt])
    others = [r for r in range(39) if r not in ROWS]
    assert torch.equal(y[others], out[others])  # every other row bit for bit
    dy = torch.randn_like(want)
    ins = [out, gate, a, w, ex] if extra else [out, gate, a, w]
    for got, exp in zip(_grads(y, ins, dy), _grads(want, ins, dy), strict=True):
        assert_close_rel(got, exp, TOLERANCE[dt])


def test_no_chosen_row_is_no_work(device):
    x = torch.randn(5, 16, device=device)
    w = torch.randn(16, 16, device=device)
    none = torch.zeros(0, dtype=torch.long, device=device)
    assert ops.gather_linear(x, none, w, None, 1e-5).shape == (0, 16)
    assert torch.equal(ops.scatter_linear(x, none, none.float(), x[:0], w), x)


def _train_step(model, fused: bool, device: str):  # noqa: ANN001, ANN202
    idx, y = random_tokens(2, 32, 0).to(device), random_tokens(2, 32, 1).to(device)
    model.zero_grad()
    kernels.enable(fused)
    try:
        out = model(idx, y, routing="topk")
        out.loss.backward()
    finally:
        kernels.enable(False)
    return out.logits, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "mode",
    [
        "mlp-pred",
        "mlp-kv-pred",  # the MLP on the kernels, the attention over the takers' keys in PyTorch
        pytest.param("joint-pred", marks=pytest.mark.slow),  # ~8 s under the interpreter
        pytest.param("stag-aux", marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("dtype", ["f64", "f32"])
def test_a_training_step_on_the_kernels_equals_the_pytorch_path(device, dtype, mode):
    """Logits and every gradient of a top-k training step: fused kernels against PyTorch."""
    if not on_cuda(device) and dtype == "f32":
        pytest.skip("float64 is enough for the interpreter")
    dt = DTYPES[dtype]
    cfg = tiny_config(**MODES[mode])
    model = moved(make_model(cfg, dtype=torch.float64), device, dt).train()
    want_logits, want = _train_step(model, False, device)
    got_logits, got = _train_step(model, True, device)
    assert_close_rel(got_logits, want_logits, TOLERANCE[dt])
    assert got.keys() == want.keys()
    for name in want:
        assert_close_rel(got[name], want[name], TOLERANCE[dt] * 10)


def test_enabling_without_a_place_to_run_is_refused(monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.enable()
    assert not kernels.enabled()
