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


# -- attention reach ------------------------------------------------------------------------------
REACH_FAR = 32  # "far": at least this many places back (round 3: MoD's loss is flat from 32 on)


def attention_weights(q_HTd: Tensor, k_HTd: Tensor, mask_TT: Tensor | None) -> Tensor:
    """(H, T, T) float64: the attention weights SDPA computes for one row (queries and keys in
    their places, causal, under a boolean mask that says which keys a query may see; grouped
    key heads shared as SDPA's `enable_gqa` shares them: query head h reads key head
    h // (H / H_kv))."""
    H, T, d = q_HTd.shape
    keys = k_HTd.repeat_interleave(H // k_HTd.shape[0], dim=0)
    scores = (q_HTd.double() @ keys.double().transpose(-1, -2)) / d**0.5
    allowed = torch.ones(T, T, dtype=torch.bool, device=q_HTd.device).tril()
    if mask_TT is not None:
        allowed = allowed & mask_TT.bool()
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)


def _reach_of_call(
    q: Tensor, k: Tensor, attn_mask: Tensor | None, active: Tensor | None, far: int, T: int
) -> dict[str, Any] | None:
    """One attention call's reach, row by row: the mean distance back of the attention weight
    and its share on keys `far` or more places back, averaged over the active queries at places
    >= far (where far keys exist)."""
    B, H, n_q, _ = q.shape
    if n_q != T or k.shape[-2] != T:  # a gathered subset (top-k) or a decode step: no places
        return None
    pos = torch.arange(T, device=q.device)
    back = (pos[:, None] - pos[None, :]).clamp(min=0).to(torch.float64)  # (T, T)
    dist_sum = torch.zeros(H, dtype=torch.float64)
    far_sum = torch.zeros(H, dtype=torch.float64)
    n = 0
    for b in range(B):
        rows = pos >= far
        if active is not None:
            rows = rows & active[b].to(q.device)
        if not rows.any():
            continue
        p = attention_weights(q[b], k[b], None if attn_mask is None else attn_mask[b, 0])
        p = p[:, rows]  # (H, n_b, T)
        dist_sum += (p * back[rows]).sum(-1).sum(-1).cpu()
        far_sum += (p * (back[rows] >= far)).sum(-1).sum(-1).cpu()
        n += int(rows.sum())
    if n == 0:
        return {"queries": 0, "mean_distance": None, "far_share": None, "far_share_heads": []}
    heads = (far_sum / n).tolist()
    return {
        "queries": n,
        "mean_distance": float(dist_sum.sum() / (n * H)),
        "far_share": float(sum(heads) / H),
        "far_share_heads": heads,
    }


def _takers(model: MoDTransformer, routes: list, layer: int, call: int) -> Tensor | None:
    """(B, T) bool: the queries of this call whose output the layer keeps (its takers), or None
    for every query: a MoD routed layer's route (joint or attention); with ``routing="mlp_kv"``
    the queries that see a taker (at or before them); a recursive model's shared layer, at
    application `call` (the recursion step), that step's route."""
    cfg = model.config
    if cfg.recursive:
        if layer not in cfg.recursion_layers[1]:
            return None
        step = {r.layer: r.mask for r in routes if r.kind == "recursion"}
        return step.get(call)  # step 0 and steps at capacity 1: every token
    found = [r.mask for r in routes if r.layer == layer and r.kind in ("block", "attn")]
    keyed = [r.mask for r in routes if r.layer == layer and r.kind == "mlp_kv"]
    if keyed:  # every token queries; one with no taker up to it gets no update (mlp_kv.py)
        return keyed[0].cumsum(1) > 0
    return found[0] if found else None


@torch.no_grad()
def attention_reach(
    model: MoDTransformer, idx: Tensor, far: int = REACH_FAR, routing: str = "causal"
) -> list[dict[str, Any]]:
    """How far back each attention call of one forward over `idx` (B, T) looks: per call, in
    the order the forward makes them, its layer and application (`call`: a recursive model's
    shared layers once per step), whether its queries are routed, the queries it was averaged
    over (a routed layer's or step's takers; only places >= `far`), the mean distance back
    of the attention weight (places), and the share of that weight on keys `far` or more
    places back (per head too). A model that has learned to look back puts weight far back;
    one that has not keeps it near. In causal routing every call sees the whole sequence in
    its places (top-k routing gathers the takers, whose places the call cannot see: those
    calls are left out)."""
    calls: list[tuple[int, Tensor, Tensor, Tensor | None]] = []
    saved = [block.attn.__dict__.get("attend") for block in model.blocks]
    was_training = model.training
    try:
        for i, block in enumerate(model.blocks):

            def record(q, k, v, attn_mask, _i=i, _attend=block.attn.attend):  # noqa: ANN001
                calls.append((_i, q, k, attn_mask))
                return _attend(q, k, v, attn_mask)

            block.attn.attend = record  # an instance attribute, shadowing the method
        model.eval()
        out = model(idx, routing=routing)
    finally:
        model.train(was_training)
        for block, before in zip(model.blocks, saved, strict=True):
            block.attn.__dict__.pop("attend", None)
            if before is not None:
                block.attn.attend = before
    result, seen = [], {}
    for layer, q, k, attn_mask in calls:
        seen[layer] = seen.get(layer, -1) + 1
        active = _takers(model, out.routes, layer, seen[layer])
        reach = _reach_of_call(q, k, attn_mask, active, far, idx.shape[1])
        if reach is not None:
            result.append({"layer": layer, "call": seen[layer], "routed": active is not None,
                           **reach})  # fmt: skip
    return result


def format_reach(reach: list[dict[str, Any]], far: int = REACH_FAR) -> str:
    """One line: per attention call, its layer and the share of attention >= `far` back."""
    parts = [
        f"L{r['layer']}{'r' if r['routed'] else ''}"
        + (f".{r['call']}" if r["call"] else "")
        + (f" {r['far_share']:.0%}" if r["far_share"] is not None else " -")
        for r in reach
    ]
    return f"attention at least {far} places back: " + ", ".join(parts)
