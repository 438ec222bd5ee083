"""Routing: the router projection, top-k selection, causal decisions, masks, gates and aux losses.

The semantics are stated in docs/semantics.md. In short: a router scores each token with
``r = x @ w`` (in at least float32); top-k routing sends the ``k = capacity_tokens(capacity, T)``
highest-scoring tokens of each row through the block, in position order, ties to the earlier
position; causal routing sends a token iff its decision logit (the router's, or the predictor's) is
above 0, so no decision reads a later token. A chosen token's update is scaled by ``g(r)``.

Names with shape suffixes: B batch, T tokens of the forward, K routed subset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import MoDConfig
from .precision import at_least_float32

ROUTING_CHOICES = ("topk", "causal")


def route_name(layer: int, kind: str) -> str:
    """``"<layer>"`` for joint routing, ``"<layer>.<kind>"`` for a routed sub-block (staggered
    routing; ``"<layer>.mlp"`` with MLP-only routing)."""
    return str(layer) if kind == "block" else f"{layer}.{kind}"


@dataclass
class Route:
    """What one router did on one forward pass (returned, never stored on the module).

    `mask` (B, T) bool: the tokens this router sent through its sub-block (on the host on a
    cached decode step, where the decision had to reach the host to pick the rows). `logits`
    (B, T): raw router weights r; None on a decode step in predictor mode, where the router runs
    only for the rows that take the block (its weight is their gate). `target` (B, T) bool: top-k
    membership over each row's tokens, the aux-loss target (equal to `mask` in top-k mode); None
    on a decode step, where a row brings one token and top-k over it means nothing.
    `predictor_logits` (B, T): the causal predictor's logits, predictor mode only.
    """

    layer: int
    kind: str  # "block" (joint routing), "attn" or "mlp" (staggered), "mlp" (routing="mlp")
    mask: Tensor
    logits: Tensor | None
    target: Tensor | None
    predictor_logits: Tensor | None = None
    threshold: float = 0.0  # the causal decision is decision_logits > threshold (calibrated)

    @property
    def name(self) -> str:
        return route_name(self.layer, self.kind)

    @property
    def decision_logits(self) -> Tensor:
        """Logits of the causal decision: the predictor's in predictor mode, else the router's."""
        return self.logits if self.predictor_logits is None else self.predictor_logits


def linear32(x: Tensor, lin: nn.Linear) -> Tensor:
    """`lin(x)` in at least float32, also under bf16 autocast or in a bf16 model.

    Routing decisions compare logits with each other (top-k) and with 0 (causal): in bf16 they
    would tie often and flip between training (autocast) and generation (no autocast).
    """
    if x.dtype == lin.weight.dtype == torch.float32 and not torch.is_autocast_enabled(
        x.device.type
    ):
        return F.linear(x, lin.weight, lin.bias)  # already float32: skip the context (decode)
    dt = at_least_float32(x.dtype)
    bias = None if lin.bias is None else lin.bias.to(dt)
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x.to(dt), lin.weight.to(dt), bias)


# -- selection ------------------------------------------------------------------------------------
def topk_indices(r_BT: Tensor, k: int) -> Tensor:
    """Indices (B, k) of the k largest router weights per row, sorted ascending by position.

    A stable descending sort breaks ties by position (earlier wins), so exactly k tokens are chosen
    and the choice is deterministic; sorting the chosen indices keeps the subsequence causal.
    """
    order = torch.sort(r_BT, dim=-1, descending=True, stable=True).indices[:, :k]
    return order.sort(dim=-1).values


def positions_mask(idx_BK: Tensor, seq_len: int) -> Tensor:
    """(B, seq_len) bool, True at the positions `idx_BK`."""
    return torch.zeros(idx_BK.shape[0], seq_len, dtype=torch.bool, device=idx_BK.device).scatter(
        1, idx_BK, True
    )


def topk_mask(r_BT: Tensor, k_B: Tensor, valid_BT: Tensor) -> Tensor:
    """(B, T) bool: top-k membership per row with a per-row k over the row's valid tokens only
    (right-padded prompts of different lengths), by the same rule as `topk_indices`."""
    B, T = r_BT.shape
    order = torch.sort(
        r_BT.masked_fill(~valid_BT, float("-inf")), dim=1, descending=True, stable=True
    ).indices
    ranks = torch.arange(T, device=r_BT.device).expand(B, T)
    rank_BT = torch.empty_like(order).scatter_(1, order, ranks)
    return rank_BT < k_B[:, None]


def causal_attention_mask(take_BT: Tensor) -> Tensor:
    """(B, 1, T, T) mask: query i sees key j iff j <= i and j took the block.

    The diagonal is always open so rows of tokens that skip (whose outputs are discarded) are never
    fully masked: a fully masked softmax row would give NaN and poison the backward pass.
    """
    T = take_BT.shape[1]
    eye = torch.eye(T, dtype=torch.bool, device=take_BT.device)
    lower = torch.ones(T, T, dtype=torch.bool, device=take_BT.device).tril()
    return ((lower & take_BT[:, None, :]) | eye).unsqueeze(1)


def gate(cfg: MoDConfig, r: Tensor, like: Tensor) -> Tensor:
    """g(r), the scale of a chosen token's update, in the dtype of the stream `like`."""
    if cfg.router_scores == "random":  # ablation: the noise scores carry no scale
        return torch.ones_like(r, dtype=like.dtype)
    if cfg.router_gate == "straight_through":
        # Exactly 1 forward (s - s.detach() is 0), sigmoid's gradient backward: a block updates
        # its takers as the dense block did (a converted pretrained model is unchanged), and the
        # router still learns which tokens' updates lower the loss.
        s = torch.sigmoid(r)
        return (1.0 + (s - s.detach())).to(like.dtype)
    if cfg.router_gate == "sigmoid_stopgrad":
        # An ablation: sigmoid(r) forward, no gradient to the router through the update, so
        # the router learns from its aux loss (or nothing, with a predictor) alone.
        return torch.sigmoid(r).detach().to(like.dtype)
    return (torch.sigmoid(r) if cfg.router_gate == "sigmoid" else r).to(like.dtype)


# -- losses and metrics ---------------------------------------------------------------------------
def router_aux_loss(routes: list[Route], like: Tensor) -> Tensor:
    """Mean over routers of the BCE between causal-decision logits and per-row top-k membership
    (routes without a target, those of decode steps, do not count)."""
    dtype = at_least_float32(like.dtype)
    losses = [
        F.binary_cross_entropy_with_logits(r.decision_logits.to(dtype), r.target.to(dtype))
        for r in routes
        if r.target is not None
    ]
    return torch.stack(losses).mean() if losses else like.new_zeros((), dtype=dtype)


def causal_takes(routes: list[Route]) -> list[tuple[Route, Tensor]]:
    """Each route with its causal decisions (decision logit > the router's threshold, 0 unless
    calibrated), to compare with its top-k membership (`Route.target`).

    A recursion step's causal decision is its own and the steps' before it (a token continues
    only while active, docs/mor.md), as its top-k target is nested in theirs: a token that
    stopped earlier counts as skipping, whatever its score at this step.
    """
    out, active = [], None  # the recursion steps' causal decisions so far
    for r in routes:
        if r.target is None:
            raise ValueError(f"route {r.name} has no top-k target (a cached decode step)")
        take = r.decision_logits > r.threshold
        if r.kind == "recursion":
            active = take = take if active is None else take & active
        out.append((r, take))
    return out


@torch.no_grad()
def routing_accuracy(routes: list[Route]) -> dict[str, float]:
    """The paper's routing accuracy: the share of tokens whose causal decision agrees with top-k
    membership, per router. With 12.5% of tokens in the top-k set a router that never fires
    scores 87.5%: read it beside `routing_scores`' recall and precision (docs/semantics.md).

    Keys are ``"<layer>"`` for joint routing and ``"<layer>.<kind>"`` for staggered and MLP-only
    routing.
    """
    return {r.name: (take == r.target).float().mean().item() for r, take in causal_takes(routes)}


def confusion(take: Tensor, target: Tensor) -> Tensor:
    """(4,) int64 counts on the host: [taken and in the top-k set, taken and not, skipped and in
    it, skipped and not] (true positives, false positives, false negatives, true negatives)."""
    take, target = take.bool(), target.bool()
    tp, fp, fn = (take & target).sum(), (take & ~target).sum(), (~take & target).sum()
    return torch.stack([tp, fp, fn, take.numel() - tp - fp - fn]).cpu()


def decision_scores(counts: Tensor) -> dict[str, float]:
    """Whether causal decisions imitate top-k, from `confusion` counts: `recall` (the share of
    top-k's tokens the causal decision takes: 0 for a router that never fires), `precision` (the
    share of taken tokens top-k chose; NaN when none is taken), `balanced_accuracy` (the mean of
    recall and the share of top-k's skippers it skips: 0.5 for a router that never or always
    fires), `take_rate`, and `accuracy`, the paper's (the share that agrees)."""
    tp, fp, fn, tn = (float(c) for c in counts)
    ratio = lambda a, b: a / b if b else float("nan")  # noqa: E731
    recall, specificity = ratio(tp, tp + fn), ratio(tn, tn + fp)
    return {
        "recall": recall,
        "precision": ratio(tp, tp + fp),
        "balanced_accuracy": (recall + specificity) / 2,
        "take_rate": ratio(tp + fp, tp + fp + fn + tn),
        "accuracy": ratio(tp + tn, tp + fp + fn + tn),
    }


@torch.no_grad()
def routing_scores(routes: list[Route]) -> dict[str, dict[str, float]]:
    """Per router, `decision_scores` of its causal decisions against its top-k set, from the
    routes of a top-k forward: recall and precision of the top-k set, balanced accuracy, the
    take-rate, and the paper's accuracy (`routing_accuracy`)."""
    return {r.name: decision_scores(confusion(take, r.target)) for r, take in causal_takes(routes)}


@torch.no_grad()
def calibrate_predictors(model: nn.Module, idx: Tensor, take: float) -> list[float]:
    """Shift each predictor's output bias so that a share `take` of the tokens of `idx` takes its
    sub-block in causal routing; returns each router's take-rate afterwards.

    For untrained predictor-mode models (benchmarks, tests), whose predictors say "take" or "skip"
    for nearly every token. Routers are calibrated in forward order, since each reads the output of
    the ones before. The threshold goes midway across the widest gap between neighbouring logits
    near the asked share (within 2% of the tokens), so no token sits on or near it: equal logits
    are common (a token that skipped every block before reads its bare embedding, so repeats of it
    score alike), and a threshold on a token's logit would let round-off decide for it. A gap
    below 1e-4 of the logits' range is an error.
    """
    if not model.config.has_predictor:
        raise ValueError(
            "calibrating needs predictors: causal_router='predictor' and learned router scores, "
            f"got causal_router={model.config.causal_router!r}, "
            f"router_scores={model.config.router_scores!r}"
        )
    if not 0 < take < 1:
        raise ValueError(f"take must be in (0, 1), got {take}")
    n_routes = len(model(idx, routing="causal").routes)
    for i in range(n_routes):
        route = model(idx, routing="causal").routes[i]
        z = route.predictor_logits.flatten().double().sort().values
        n = len(z)
        cut = min(max(int(n * (1 - take)), 1), n - 1)
        reach = max(1, n // 50)
        lo, hi = max(1, cut - reach), min(n - 1, cut + reach)
        gaps = z[lo : hi + 1] - z[lo - 1 : hi]  # gaps[j] lies between z[lo + j - 1] and z[lo + j]
        cut = lo + int(gaps.argmax())
        if float(z[cut] - z[cut - 1]) <= 1e-4 * float(z[-1] - z[0]):
            raise ValueError(
                f"router {route.name}: no gap between predictor logits near a share {take} to put "
                "the threshold in; calibrate on more varied tokens"
            )
        fc2 = model.predictor_for(route).fc2
        fc2.bias -= ((z[cut - 1] + z[cut]) / 2).to(fc2.bias.dtype)
    return [r.mask.float().mean().item() for r in model(idx, routing="causal").routes]


# -- diagnostics ----------------------------------------------------------------------------------
@torch.no_grad()
def routing_diagnostics(
    cfg: MoDConfig, topk: list[Route], causal: list[Route]
) -> tuple[dict[str, dict[str, float]], dict[str, Tensor]]:
    """What a trainer logs at each evaluation to watch the routers learn, from the routes of one
    probe batch in top-k and in causal routing: per router the distribution of the raw weights r
    (mean, std, 5/50/95th percentiles), the top-k boundary (mean over rows of the k-th largest r),
    the gate g(r) of the chosen tokens (mean, std, 10/50/90th percentiles: a gate that closes
    switches its block off), the causal take-rate; and the decisions
    themselves (``"<name>/topk"``, ``"<name>/causal"``: bool masks) to compare with the next
    evaluation's (`decision_flips`)."""
    stats: dict[str, dict[str, float]] = {}
    masks: dict[str, Tensor] = {}
    for t, c in zip(topk, causal, strict=True):
        r = t.logits.detach().double().cpu()  # statistics on the host (quantile's q too)
        q = torch.quantile(r.flatten(), torch.tensor([0.05, 0.5, 0.95], dtype=r.dtype))
        mask = t.mask.cpu()
        k = int(mask.sum(1).max())
        chosen = gate(cfg, r[mask], r).double()
        stats[t.name] = {
            "r_mean": float(r.mean()),
            "r_std": float(r.std()) if r.numel() > 1 else 0.0,
            "r_p05": float(q[0]),
            "r_p50": float(q[1]),
            "r_p95": float(q[2]),
            "topk_boundary": float(r.topk(k, dim=1).values[:, -1].mean()) if k else float("nan"),
            "gate_chosen_mean": float(chosen.mean()) if chosen.numel() else float("nan"),
            "gate_chosen_std": float(chosen.std()) if chosen.numel() > 1 else float("nan"),
            **_gate_quantiles(chosen),
            "causal_take_rate": float(c.mask.double().mean().cpu()),
        }
        masks[f"{t.name}/topk"] = mask.bool()
        masks[f"{c.name}/causal"] = c.mask.bool().cpu()
    return stats, masks


def _gate_quantiles(chosen: Tensor) -> dict[str, float]:
    if not chosen.numel():
        return dict.fromkeys(
            ("gate_chosen_p10", "gate_chosen_p50", "gate_chosen_p90"), float("nan")
        )
    q = torch.quantile(chosen, torch.tensor([0.1, 0.5, 0.9], dtype=chosen.dtype))
    return {
        "gate_chosen_p10": float(q[0]),
        "gate_chosen_p50": float(q[1]),
        "gate_chosen_p90": float(q[2]),
    }


def decision_flips(before: dict[str, Tensor], after: dict[str, Tensor]) -> dict[str, float]:
    """Per mask key present in both with the same shape: the share of tokens whose decision
    changed."""
    return {
        key: float((after[key] != m).double().mean())
        for key, m in before.items()
        if key in after and after[key].shape == m.shape
    }
