"""The models, tokens and the loop-oracle comparison shared by the model tests."""

from __future__ import annotations

import torch
from helpers import make_model as _make_model
from helpers import random_tokens, tiny_config
from reference import reference_forward

from mixture_of_depths import MoDConfig, MoDTransformer

T = 23  # an awkward sequence length
B = 3

# float64 end to end (RoPE included), so the vectorised model must match the loop oracle to
# round-off.
TOL = STRICT = dict(rtol=0.0, atol=1e-10)


def make_config(**overrides) -> MoDConfig:
    return tiny_config(**overrides)


def tokens(batch: int = B, length: int = T, seed: int = 0) -> torch.Tensor:
    return random_tokens(batch, length, seed)


def make_model(seed: int = 0, dtype: torch.dtype = torch.float64, **overrides) -> MoDTransformer:
    return _make_model(make_config(**overrides), seed, dtype, calib_idx=tokens(seed=seed + 100))


def assert_matches_reference(model, idx, routing, tol=TOL):  # noqa: ANN001, ANN201
    out = model(idx, routing=routing)
    ref = reference_forward(model, idx, routing)
    torch.testing.assert_close(out.logits, ref.logits, **tol)
    assert [(r.layer, r.kind) for r in out.routes] == [(r.layer, r.kind) for r in ref.routes]
    for got, exp in zip(out.routes, ref.routes, strict=True):
        assert torch.equal(got.mask, exp.mask), (got.layer, got.kind)
        assert torch.equal(got.target, exp.target), (got.layer, got.kind)
        torch.testing.assert_close(got.logits, exp.logits, **tol)
        if exp.predictor_logits is None:
            assert got.predictor_logits is None
        else:
            torch.testing.assert_close(got.predictor_logits, exp.predictor_logits, **tol)
    return out, ref
