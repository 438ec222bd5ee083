"""Look-back, measured directly (round 4, item 4). Round 3's copy probe (uniformly random tokens,
repeated) reads ~0 for every model here: text that unlike anything in training is not where a
model this size shows what it learned. Two probes it can show, on the run's own validation text
(BPE), in causal routing, on fixed windows so that every model reads the same tokens:

- `repeat`: a natural window with a span of it copied later in the same window, at several
  distances back; the score is the loss on the copy in a control row whose first occurrence
  was replaced by other text, less its loss where the first occurrence is there (nats): what
  the model gains from having seen those tokens before, in text it knows. (A first version
  scored the first occurrence against the copy: the copy is spliced into other text and sits
  later in the window, so a model that does not look back scored away from 0 by those
  alone; the control row has both.)
- `recall`: associative recall at several distances: a random key token followed by a random
  value token is written into natural text, and the key again `distance` places later; the
  score is the loss on the value at the recall against the same place in a control row whose
  earlier pair had another value (nats): what the model retrieves from that far back, and
  nothing else.

Both are differences of losses on the same model and the same target tokens in the same local
context, so a model that does not look back as far as `distance` scores ~0 at any length of
training, and one that does scores above it.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

SEED = 4242
ROWS = 32  # windows per distance
SPAN = 32  # tokens repeated by `repeat`
DISTANCES = (64, 256, 768)  # places between the two occurrences


def windows(val: Tensor, rows: int, length: int, seed: int) -> Tensor:
    """(rows, length) windows of the validation tokens at fixed random offsets."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(val) - length - 1, (rows,), generator=g)
    return torch.stack([val[s : s + length] for s in starts.tolist()])


@torch.no_grad()
def token_losses(model: Any, idx: Tensor) -> Tensor:
    """(rows, T-1) next-token losses of `idx` under causal routing, in float32 or wider."""
    logits = model(idx, routing="causal").logits[:, :-1].float()
    return F.cross_entropy(logits.transpose(1, 2), idx[:, 1:], reduction="none")


def repeat_probe(model: Any, val: Tensor, distance: int, seed: int = SEED) -> dict[str, float]:
    """A span of the window (`span_for` the context, at place `span`) copied `distance` places
    later: the loss on the copy, against the same row whose first occurrence was replaced by
    other text (same targets, same splice and same context up to `distance` back; only the
    earlier sight of the span differs)."""
    length = model.config.max_seq_len
    span = span_for(length)
    a = span
    b = a + distance
    if b + span > length or distance < span:
        raise ValueError(f"distance {distance} must be at least the span ({span}) and leave room "
                         f"for it in {length} places")  # fmt: skip
    idx = windows(val, ROWS, length, seed + distance).clone()
    idx[:, b : b + span] = idx[:, a : a + span]
    control = idx.clone()
    control[:, a : a + span] = windows(val, ROWS, span, seed + distance + 1)
    # predictions inside the copy: of its tokens 1..span-1 (the first is not predictable)
    repeat = token_losses(model, idx)[:, b : b + span - 1].mean()
    base = token_losses(model, control)[:, b : b + span - 1].mean()
    return {"loss_repeat": float(repeat), "loss_control": float(base),
            "score": float(base - repeat)}  # fmt: skip


def recall_probe(model: Any, val: Tensor, distance: int, seed: int = SEED) -> dict[str, float]:
    """A key-value pair at place 16 and the key again `distance` places later: the loss on the
    value after it, against a control row whose first pair had another value."""
    cfg = model.config
    length = cfg.max_seq_len
    k_at, q_at = 16, 16 + distance
    if q_at + 2 > length:
        raise ValueError(f"distance {distance} leaves no room for the recall in {length} places")
    g = torch.Generator().manual_seed(seed + 7 * distance)
    idx = windows(val, ROWS, length, seed + 7 * distance + 1).clone()
    # keys and values drawn from the text's own tokens (never a token it never holds, such as
    # a special one), the control's value another such token
    pick = torch.randint(0, len(val), (3, ROWS), generator=g)
    key, value, other = val[pick[0]], val[pick[1]], val[pick[2]]
    other = torch.where(other == value, val[(pick[2] + 1) % len(val)], other)
    idx[:, k_at], idx[:, k_at + 1] = key, value
    idx[:, q_at], idx[:, q_at + 1] = key, value
    control = idx.clone()
    control[:, k_at + 1] = other
    at = q_at  # the loss of predicting place q_at + 1 (the value) from place q_at (the key)
    recall = token_losses(model, idx)[:, at]
    base = token_losses(model, control)[:, at]
    return {"loss_recall": float(recall.mean()), "loss_control": float(base.mean()),
            "score": float((base - recall).mean())}  # fmt: skip


def span_for(length: int) -> int:
    """The repeated span: `SPAN` tokens, or an eighth of a shorter context."""
    return max(2, min(SPAN, length // 8))


def lookback(model: Any, val: Tensor, distances: tuple[int, ...] = DISTANCES) -> dict[str, Any]:
    """Both probes at every distance that fits the model's context, and their means."""
    model.eval()
    val = val.long()  # stored token ids are narrow (uint16): embeddings and targets take int64
    length = model.config.max_seq_len
    span = span_for(length)
    fits = [d for d in distances if span <= d and d + 2 * span <= length]
    if not fits:
        raise ValueError(f"no distance of {distances} fits a context of {length}")
    rep = {str(d): repeat_probe(model, val, d) for d in fits}
    rec = {str(d): recall_probe(model, val, d) for d in fits}
    return {
        "repeat": rep,
        "recall": rec,
        "repeat_score": statistics.fmean(r["score"] for r in rep.values()),
        "recall_score": statistics.fmean(r["score"] for r in rec.values()),
    }
