"""`analyse(model, tokens)`: one causal and one top-k forward over held-out rows, and per token
which routed (sub-)blocks it took, the router weights, the predictive entropy and the loss;
then the tables built from them (by skip run, by blocks taken, by token class)."""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..model import MoDTransformer
from ..routing import Route, confusion, decision_scores
from .stats import (
    bootstrap_spearman,
    independence_test,
    longest_run,
    mean_interval,
    poisson_binomial,
)


@dataclass
class Report:
    """`analyse`'s result. Per-token arrays are flattened over the rows, (N, ...)."""

    router_names: list[str]
    tokens: Tensor  # (N,) ids
    taken: Tensor  # (N, R) bool, causal routing
    taken_topk: Tensor  # (N, R) bool, top-k routing
    weights: Tensor  # (N, R) router logits r (causal pass)
    entropy: Tensor  # (N,) predictive entropy (nats) of the causal pass
    loss: Tensor  # (N,) next-token loss (nats); NaN where a row has no next token
    depth_hist: Tensor  # (R + 1,) tokens that took 0..R routers
    independent_hist: Tensor  # (R + 1,) expected counts under independent per-router coins
    longest_skip: Tensor  # (N,) longest run of consecutive skipped routers
    agreement: dict[str, float] = field(default_factory=dict)  # causal == top-k: the paper's
    # per router, recall and precision of the top-k set (routing.decision_scores)
    scores: dict[str, dict[str, float]] = field(default_factory=dict)
    take_rate: dict[str, float] = field(default_factory=dict)  # causal, per router
    correlations: dict[str, dict[str, float]] = field(default_factory=dict)
    baseline_loss: Tensor | None = None  # (N,) the baseline model's loss on the same tokens
    row_len: int = 1 << 62  # tokens per row (N is rows x row_len)
    # blocks taken against independent coins: variance ratio, total variation, permutation p
    independence: dict[str, float] = field(default_factory=dict)

    @property
    def row(self) -> Tensor:
        """(N,) the row of each token (for intervals clustered by row)."""
        return torch.arange(len(self.tokens)) // self.row_len

    @property
    def excess(self) -> Tensor | None:
        """(N,) this model's loss minus the baseline's (None without a baseline)."""
        return None if self.baseline_loss is None else self.loss - self.baseline_loss

    @property
    def depth(self) -> Tensor:
        return self.taken.sum(-1)


def _table(routes: list[Route]) -> tuple[list[str], Tensor, Tensor]:
    names = [r.name for r in routes]
    taken = torch.stack([r.mask.cpu() for r in routes], -1)  # (B, T, R)
    weights = torch.stack([r.logits.detach().float().cpu() for r in routes], -1)
    return names, taken, weights


def _token_loss(logits: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """(B, T) predictive entropy and next-token loss (NaN at each row's last place), in float64
    so that the excess over a baseline is not round-off."""
    logp = logits.double().cpu().log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    loss = torch.full(idx.shape, float("nan"), dtype=torch.float64)
    loss[:, :-1] = -logp[:, :-1].gather(-1, idx[:, 1:].cpu()[..., None])[..., 0]
    return entropy, loss


@torch.no_grad()
def _forward(model: MoDTransformer, idx: Tensor, routing: str) -> Any:
    was = model.training
    model.eval()
    try:
        return model(idx.to(next(model.parameters()).device), routing=routing)
    finally:
        model.train(was)


@torch.no_grad()
def analyse(
    model: MoDTransformer,
    tokens: Tensor,
    bootstrap: int = 1000,
    seed: int = 0,
    baseline: MoDTransformer | None = None,
) -> Report:
    """The routing of `tokens` ((T,) or (B, T) ids, each row a held-out stretch) through `model`
    (see the module docstring). `baseline`, if given, is run on the same tokens (causal routing if
    it has routers) for each token's excess loss; it must share the vocabulary."""
    idx = tokens[None] if tokens.dim() == 1 else tokens
    causal = _forward(model, idx, "causal")
    topk = _forward(model, idx, "topk")
    if not causal.routes:
        raise ValueError("the model has no routed blocks: nothing to inspect")
    names, taken, weights = _table(causal.routes)
    _, taken_topk, _ = _table(topk.routes)
    B, T, R = taken.shape
    entropy, loss = _token_loss(causal.logits, idx)
    base_loss = None
    if baseline is not None:
        if baseline.config.vocab_size != model.config.vocab_size:
            raise ValueError(
                f"baseline vocab_size {baseline.config.vocab_size} differs from the model's "
                f"{model.config.vocab_size}: the baseline must be trained on the same tokenizer"
            )
        base_loss = _token_loss(_forward(baseline, idx, "causal").logits, idx)[1].reshape(B * T)
    flat = lambda t: t.reshape(B * T, *t.shape[2:])  # noqa: E731
    taken, taken_topk, weights = flat(taken), flat(taken_topk), flat(weights)
    entropy, loss = flat(entropy), flat(loss)
    depth = taken.sum(-1)
    rates = taken.double().mean(0)
    same = (taken == taken_topk).double().mean(0)
    n = B * T
    report = Report(
        router_names=names,
        tokens=flat(idx.cpu()),
        taken=taken,
        taken_topk=taken_topk,
        weights=weights,
        entropy=entropy,
        loss=loss,
        depth_hist=torch.bincount(depth, minlength=R + 1),
        independent_hist=poisson_binomial(rates) * n,
        longest_skip=longest_run(~taken),
        agreement={nm: float(same[j]) for j, nm in enumerate(names)},
        scores={
            nm: decision_scores(confusion(taken[:, j], taken_topk[:, j]))
            for j, nm in enumerate(names)
        },
        take_rate={nm: float(rates[j]) for j, nm in enumerate(names)},
        baseline_loss=base_loss,
        row_len=T,
    )
    has_next = ~loss.isnan()
    d = depth.double()
    rows = report.row
    report.correlations = {  # intervals by whole rows (a row's tokens are not independent)
        "depth_vs_entropy": bootstrap_spearman(d, entropy.double(), bootstrap, seed, groups=rows),
        "depth_vs_loss": bootstrap_spearman(
            d[has_next], loss[has_next].double(), bootstrap, seed, groups=rows[has_next]
        ),
    }
    if not model.config.recursive:  # recursion steps are nested by construction: no coins to test
        report.independence = independence_test(taken, bootstrap, seed)
    if base_loss is not None:
        # Does the router give compute to the tokens a dense model finds hard?
        report.correlations["depth_vs_baseline_loss"] = bootstrap_spearman(
            d[has_next], base_loss[has_next], bootstrap, seed, groups=rows[has_next]
        )
    return report


# -- statistics that can be undefined ------------------------------------------------------------
_AGAINST = {"depth_vs_entropy": "entropy", "depth_vs_loss": "loss",
            "depth_vs_baseline_loss": "baseline loss"}  # fmt: skip


def undefined_reason(report: Report, key: str) -> str | None:
    """Why the statistic `key` (a correlation, or "variance_ratio") is NaN, or None if it is a
    number: NaN printed as ``+nan`` tells a reader nothing; constant routing is the usual cause."""
    if key == "variance_ratio":
        ratio = report.independence.get("variance_ratio", 0.0)
        return None if ratio == ratio else "routing is constant: no variance"
    rho = report.correlations[key]["rho"]
    if rho == rho:
        return None
    sel = torch.ones(len(report.tokens), dtype=torch.bool)
    if key != "depth_vs_entropy":  # the loss-based ones: tokens with a next token
        sel = ~report.loss.isnan()
    if int(sel.sum()) < 2:
        return f"{int(sel.sum())} token(s) with a next token: too few"
    taken = report.taken[sel]
    if (taken == taken[:1]).all():
        return "routing is constant: no variance"
    depth = report.depth[sel]
    if depth.min() == depth.max():
        return "blocks taken are the same for every token: no variance"
    return f"the {_AGAINST.get(key, key)} is the same for every token: no variance"


def rho_text(report: Report, key: str, digits: int = 3) -> str:
    """Spearman's rho of correlation `key` as text, or "undefined (why)"."""
    why = undefined_reason(report, key)
    return f"undefined ({why})" if why else f"{report.correlations[key]['rho']:+.{digits}f}"


def interval_text(report: Report, key: str) -> str:
    """The 95% bootstrap interval of correlation `key` as text, or why there is none: it resamples
    whole rows (windows), so one row (a short ``--text``) gives no interval, not ``+nan``."""
    v = report.correlations[key]
    if v["low"] == v["low"]:
        return f"95% bootstrap interval over rows {v['low']:+.4f} to {v['high']:+.4f}"
    rows = report.row if key == "depth_vs_entropy" else report.row[~report.loss.isnan()]
    n = len(torch.unique(rows))
    if n < 2:
        return (
            f"no bootstrap interval: it resamples whole rows (windows) and needs two or more, "
            f"here {n}"
        )
    return "no bootstrap interval: no resample had a defined rho"


def variance_ratio_text(report: Report, of: str = "the independent one") -> str:
    """The variance of blocks taken against `of` (its value under independent coins) as text:
    "1.23x OF", or "over OF undefined (why)"."""
    why = undefined_reason(report, "variance_ratio")
    ratio = report.independence["variance_ratio"]
    return f"over {of} undefined ({why})" if why else f"{ratio:.2f}x {of}"


def loss_by(report: Report, groups: Tensor) -> dict[int, dict[str, float]]:
    """Per value of `groups` ((N,) ints, e.g. the longest skip run or the blocks taken): how many
    tokens, their mean loss and, with a baseline, their mean excess loss with the half-width of its
    95% interval (tokens with a next token)."""
    out = {}
    ok = ~report.loss.isnan()
    excess = report.excess
    for k in sorted(set(groups.tolist())):
        sel = (groups == k) & ok
        row = {
            "tokens": int((groups == k).sum()),
            "mean_loss": float(report.loss[sel].mean()) if sel.any() else float("nan"),
        }
        if excess is not None:
            row["mean_excess"], row["excess_half_width"] = mean_interval(
                excess[sel], report.row[sel]
            )
            row["mean_baseline_loss"] = (
                float(report.baseline_loss[sel].mean()) if sel.any() else float("nan")
            )
        out[k] = row
    return out


def loss_by_run(report: Report) -> dict[int, dict[str, float]]:
    """`loss_by` the longest run of consecutive skipped routers."""
    return loss_by(report, report.longest_skip)


# -- by token class ------------------------------------------------------------------------------
BYTE_CLASSES = ("whitespace", "punctuation", "digits", "letters/identifiers", "other")


def byte_class(token: int) -> str:
    """The class of a byte-tokenizer id: whitespace, punctuation, digits, letters and underscore
    (identifiers), or other (non-ASCII bytes, control bytes, end-of-text)."""
    if token >= 128:
        return "other"
    ch = chr(token)
    if ch in " \t\n\r\f\v":
        return "whitespace"
    if ch.isdigit():
        return "digits"
    if ch.isalpha() or ch == "_":
        return "letters/identifiers"
    if ch.isprintable():
        return "punctuation"
    return "other"


TEXT_CLASSES = ("whitespace", "punctuation", "digits", "letters/identifiers", "mixed")


def text_class(text: str) -> str:
    """The class of a (BPE) token's text: whitespace only; punctuation, digits or
    letters/identifiers once leading and trailing whitespace is dropped (" (" is punctuation,
    " foo" a word); mixed for the rest (" x+1", "\ufffd", the empty end-of-text)."""
    core = text.strip()
    if not text:
        return "mixed"
    if not core:
        return "whitespace"
    if core.isdigit() and core.isascii():
        return "digits"
    if all(ch.isalnum() or ch == "_" for ch in core) and not core.isdigit():
        return "letters/identifiers"
    if all(unicodedata.category(ch)[0] in "PS" and ch not in "_\ufffd" for ch in core):
        return "punctuation"  # U+FFFD: part of a character's bytes, not a symbol
    return "mixed"


def class_table(report: Report, decode: Any = None) -> dict[str, dict[str, float]]:
    """Per class, its tokens and the share of them each router took (causal). Byte tokenizer:
    `byte_class` of each id; with `decode` (id -> text, a BPE tokenizer's): `text_class`."""
    if decode is None:
        classes, order = [byte_class(int(t)) for t in report.tokens.tolist()], BYTE_CLASSES
    else:
        memo: dict[int, str] = {}
        for t in set(report.tokens.tolist()):
            memo[t] = text_class(decode(t))
        classes, order = [memo[t] for t in report.tokens.tolist()], TEXT_CLASSES
    out = {}
    for c in order:
        sel = torch.tensor([k == c for k in classes])
        if sel.any():
            shares = report.taken[sel].double().mean(0).tolist()
            out[c] = {
                "tokens": int(sel.sum()),
                **dict(zip(report.router_names, shares, strict=True)),
            }
    return out


def extremes(
    report: Report, k: int = 10, min_count: int = 5
) -> dict[str, list[tuple[int, float, int]]]:
    """Any tokenizer (BPE): the `k` ids with the most and the least routers taken on average
    (ids seen at least `min_count` times), as (id, mean blocks taken, count)."""
    ids, inverse, counts = torch.unique(report.tokens, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inverse, report.depth.double())
    mean = sums / counts
    ok = counts >= min_count
    rows = [
        (int(i), float(m), int(c)) for i, m, c, o in zip(ids, mean, counts, ok, strict=True) if o
    ]
    rows.sort(key=lambda r: (-r[1], r[0]))
    return {"most": rows[:k], "least": rows[::-1][:k]}
