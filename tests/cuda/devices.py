"""What the device-parametrised oracle tests share: the device lists, moving a model, and the rows
whose routing decisions lie beyond a precision's margin (docs/semantics.md, "Numerics and
tests": a comparison that ends in a hard decision asserts only beyond the margin)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from mixture_of_depths import MoDTransformer, capacity_tokens

# MOD_TEST_CUDA_ON_CPU=1: the CUDA variants run on "cpu:0" (tests/conftest.py), to check their
# own logic without a GPU; code that must know the real device asks `on_cuda`.
CUDA_ON_CPU = os.environ.get("MOD_TEST_CUDA_ON_CPU") == "1"
CUDA = torch.cuda.is_available() or CUDA_ON_CPU
CUDA_PARAM = pytest.param(
    "cpu:0" if CUDA_ON_CPU else "cuda",
    marks=[pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="no CUDA device here")],
    id="cuda",
)
# Variants whose CPU run would only repeat a default test elsewhere: CUDA alone.
CUDA_ONLY = [CUDA_PARAM]

# Routing modes by name: the model overrides of each.
MODES = {
    "joint-aux": dict(routing="joint", causal_router="aux_loss"),
    "joint-pred": dict(routing="joint", causal_router="predictor"),
    "stag-aux": dict(routing="staggered", causal_router="aux_loss"),
    "stag-pred": dict(routing="staggered", causal_router="predictor"),
    "mlp-pred": dict(routing="mlp", causal_router="predictor"),
    "mlp-kv-pred": dict(routing="mlp_kv", causal_router="predictor"),
    "residual": dict(routing="joint", causal_router="predictor", skipped_kv="residual"),
    "stag-residual": dict(routing="staggered", causal_router="aux_loss", skipped_kv="residual"),
}
# Relative tolerances of logits against float64, and the margin a decision must clear.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 5e-2}
MARGIN = {torch.float64: 0.0, torch.float32: 1e-3, torch.bfloat16: 0.1}
DTYPES = {"f64": torch.float64, "f32": torch.float32, "bf16": torch.bfloat16}


def on_cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


def moved(model: MoDTransformer, device: str, dtype: torch.dtype) -> MoDTransformer:
    """A copy of `model` on `device` in `dtype` (the original is kept as the reference)."""
    return copy.deepcopy(model).to(device=device, dtype=dtype)


def rows_beyond_margin(model: MoDTransformer, routes: list, routing: str, margin: float) -> list:
    """Per row of the reference's routes: whether every decision clears `margin` (a top-k
    boundary gap, or a causal logit's distance from its threshold)."""
    cfg = model.config
    B, T = routes[0].mask.shape if routes else (0, 0)
    ok = torch.ones(B, dtype=torch.bool)
    for i, r in enumerate(routes):
        scores = r.logits.double().cpu()
        if routing == "topk":
            k = capacity_tokens(cfg.capacity, T)
            if 0 < k < T:
                top = scores.sort(dim=1, descending=True).values
                ok &= (top[:, k - 1] - top[:, k]) > margin
        else:
            decide = scores if r.predictor_logits is None else r.predictor_logits.double().cpu()
            ok &= ((decide - cfg.causal_threshold(i)).abs() > margin).all(1)
    return ok.tolist()


def assert_close_rel(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    """||got - want|| <= rel * ||want|| (float64, on the host)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    err = float((got - want).norm())
    assert err <= rel * float(want.norm()) + 1e-300, (err, float(want.norm()), rel)
