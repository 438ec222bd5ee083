"""Probes of what a trained model has learned beyond its validation loss.

`copy_probe`: in-context copying, the standard score (Olsson et al. 2022, "In-context learning and
induction heads"). Each row is a sequence of uniformly random tokens followed by the same
sequence again. On the first copy nothing can be predicted (the loss is about ln V); on the second
a model that has learned to look back and copy (induction heads) predicts each token from the
token after the earlier occurrence of the current one. The score is the first copy's mean loss
minus the second's, in nats: 0 for a model that does not copy, up to about ln V for one that
copies perfectly. Per routed sub-block it reports the share of tokens that took it on each copy
(does the router send the copies through, where looking back pays?).

Everything is computed in one forward per routing mode, on a fixed generator, so the numbers of
two evaluations, or of two models with the same vocabulary and context, compare.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .model import MoDTransformer
from .precision import at_least_float32

COPY_ROWS = 8
COPY_SEED = 1234


def copy_tokens(
    vocab_size: int, rows: int, half: int, seed: int = COPY_SEED, device: Any = "cpu"
) -> Tensor:
    """(rows, 2 * half) ids: each row `half` uniformly random tokens, then the same again."""
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(0, vocab_size, (rows, half), generator=g)
    return torch.cat([first, first], dim=1).to(device)


@torch.no_grad()
def copy_probe(
    model: MoDTransformer,
    rows: int = COPY_ROWS,
    length: int | None = None,
    routing: str = "causal",
    seed: int = COPY_SEED,
) -> dict[str, Any]:
    """The copy score of `model` on `rows` repeated random sequences of `length` tokens (default:
    the model's context; two copies of half of it), in `routing` mode.

    Returns ``loss_first`` and ``loss_second`` (mean next-token loss, nats, over the predictions
    made inside each copy: the first copy's positions 1..L-1, the second's L+1..2L-1, so neither
    side predicts across the seam), ``score`` (their difference) and, for a MoD model,
    ``take_first`` / ``take_second``: per router, the share of each copy's tokens that took its
    sub-block."""
    cfg = model.config
    length = cfg.max_seq_len if length is None else length
    if not 4 <= length <= cfg.max_seq_len:
        raise ValueError(f"copy probe length must be in [4, {cfg.max_seq_len}], got {length}")
    half = length // 2
    device = next(model.parameters()).device
    idx = copy_tokens(cfg.vocab_size, rows, half, seed, device)
    was_training = model.training
    model.eval()
    try:
        out = model(idx, routing=routing)
    finally:
        model.train(was_training)
    logits = out.logits[:, :-1].to(at_least_float32(out.logits.dtype))
    loss = F.cross_entropy(logits.transpose(1, 2), idx[:, 1:], reduction="none")  # (rows, 2L-1)
    first, second = loss[:, : half - 1], loss[:, half:]
    result: dict[str, Any] = {
        "loss_first": float(first.mean()),
        "loss_second": float(second.mean()),
        "score": float(first.mean() - second.mean()),
    }
    if out.routes:
        result["take_first"] = {r.name: float(r.mask[:, :half].float().mean()) for r in out.routes}
        result["take_second"] = {r.name: float(r.mask[:, half:].float().mean()) for r in out.routes}
    return result


def format_copy_probe(probe: dict[str, Any]) -> str:
    """One line: the copy score and the two losses (and the routers' take-rates on each copy)."""
    line = (
        f"copy probe: score {probe['score']:+.3f} nats (loss on the first copy "
        f"{probe['loss_first']:.3f}, on the second {probe['loss_second']:.3f})"
    )
    if probe.get("take_first"):
        takes = ", ".join(
            f"L{k} {probe['take_first'][k]:.0%}->{probe['take_second'][k]:.0%}"
            for k in probe["take_first"]
        )
        line += f"; take-rate first->second copy {takes}"
    return line
