"""The look-back probes against two oracles: a model that cannot look back scores exactly 0,
and an ideal copier (it predicts the token that followed the last earlier occurrence of the
current one) scores far above 0 on both."""

from __future__ import annotations

import types

import pytest
import torch

from experiments.round4 import lookback
from mixture_of_depths import MoDConfig, MoDTransformer

V, T = 2000, 256  # a vocabulary wide enough that few tokens recur by chance


class Copier(torch.nn.Module):
    """Logits that put all their weight on the token after the last earlier occurrence of the
    current one (uniform where there is none): induction, perfectly."""

    def __init__(self) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(max_seq_len=T, vocab_size=V)

    def forward(self, idx: torch.Tensor, routing: str) -> types.SimpleNamespace:
        B, n = idx.shape
        logits = torch.zeros(B, n, V)
        for b in range(B):
            last: dict[int, int] = {}
            for t in range(n):
                cur = int(idx[b, t])
                if cur in last:
                    logits[b, t, int(idx[b, last[cur] + 1])] = 30.0
                if t + 1 < n:
                    last[cur] = t
        return types.SimpleNamespace(logits=logits)


class PlaceBigram(torch.nn.Module):
    """Logits from the current token alone (a fixed random table), sharper later in the window:
    no look-back at all, but a loss that depends on where a token sits."""

    def __init__(self) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(max_seq_len=T, vocab_size=V)
        self.table = torch.randn(V, V, generator=torch.Generator().manual_seed(3))

    def forward(self, idx: torch.Tensor, routing: str) -> types.SimpleNamespace:
        place = torch.arange(idx.shape[1], dtype=torch.float32) / T
        return types.SimpleNamespace(logits=self.table[idx] * (1 + 3 * place)[None, :, None])


def val_tokens() -> torch.Tensor:
    return torch.randint(0, V, (20_000,), generator=torch.Generator().manual_seed(0))


def blind_model() -> MoDTransformer:
    """A model whose attention adds nothing: each logit reads its own token only."""
    cfg = MoDConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=2, max_seq_len=T,
                    layer_pattern="D")  # fmt: skip
    model = MoDTransformer(cfg).double()
    with torch.no_grad():
        for block in model.blocks:
            for p in block.attn.parameters():
                p.zero_()
    return model.eval()


def test_a_model_that_cannot_look_back_scores_zero():
    got = lookback.lookback(blind_model(), val_tokens(), distances=(32, 64, 128))
    for probe in ("repeat", "recall"):
        for d, r in got[probe].items():
            assert r["score"] == pytest.approx(0.0, abs=1e-9), (probe, d)


def test_a_model_whose_loss_depends_on_the_place_but_not_on_the_past_scores_zero():
    """The control row holds the copy at the same place, after the same splice: only the earlier
    sight of the span differs (a probe that scored the first occurrence against the copy gave
    this model the difference of two places)."""
    got = lookback.lookback(PlaceBigram().eval(), val_tokens(), distances=(32, 64, 128))
    for probe in ("repeat", "recall"):
        for d, r in got[probe].items():
            assert r["score"] == 0.0, (probe, d)
    first_vs_copy = [r["loss_control"] for r in got["repeat"].values()]
    assert max(first_vs_copy) - min(first_vs_copy) > 0.1  # the place does move its loss


def test_an_ideal_copier_scores_far_above_zero_at_every_distance():
    got = lookback.lookback(Copier(), val_tokens(), distances=(32, 64, 128))
    assert set(got["repeat"]) == {"32", "64", "128"}
    for d in got["repeat"]:
        assert got["repeat"][d]["score"] > 1.0 and got["recall"][d]["score"] > 1.0
    assert got["repeat_score"] > 1.0 and got["recall_score"] > 1.0


def test_distances_that_do_not_fit_the_context_are_refused():
    with pytest.raises(ValueError, match="no distance"):
        lookback.lookback(Copier(), val_tokens(), distances=(1000,))


def test_token_ids_stored_narrow_are_read_as_the_same_ids():
    """Validation tokens come as uint16 (how the data stores them): the scores are those of the
    same ids in int64."""
    val, model = val_tokens(), blind_model()
    wide = lookback.lookback(model, val, distances=(32, 64))
    narrow = lookback.lookback(model, val.to(torch.uint16), distances=(32, 64))
    assert narrow == wide
