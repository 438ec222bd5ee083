"""Where the compute went, token by token: the numbers behind `mod inspect`.

`analyse(model, tokens)` runs one forward pass in causal routing (what generation does) and one in
top-k routing over the same rows and reports, per token, which routed (sub-)blocks it took, the
router weights, the model's predictive entropy and its loss; and over all tokens:

- the histogram of blocks taken per token, beside the histogram routing would give if each
  router flipped an independent coin at its own take-rate (a Poisson-binomial distribution);
- the longest run of consecutive skipped routers of each token (in layer order), its
  distribution, and the mean loss by run length;
- Spearman's rho of blocks taken against entropy and against loss, with percentile bootstrap
  intervals over rows (each drawn whole);
- how often the causal decision and top-k agree, per router;
- with a `baseline` model (a dense twin trained on the same tokens), each token's excess loss
  (this model's minus the baseline's): a skipper's low loss alone cannot say skipping was free,
  because the router picks which tokens skip; the baseline tells what they would have cost.

Everything is computed with torch on the host; no plotting here.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .model import MoDTransformer
from .routing import Route


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
    agreement: dict[str, float] = field(default_factory=dict)  # causal == top-k, per router
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


def poisson_binomial(p: Tensor) -> Tensor:
    """P(sum = k), k = 0..len(p), of independent Bernoulli(p_i): the exact convolution."""
    dist = torch.ones(1, dtype=torch.float64)
    for pi in p.to(torch.float64):
        dist = torch.cat([dist * (1 - pi), dist.new_zeros(1)]) + torch.cat(
            [dist.new_zeros(1), dist * pi]
        )
    return dist


def independence_test(taken: Tensor, n: int = 1000, seed: int = 0) -> dict[str, float]:
    """Does routing differ from independent per-router coins at the same rates? For (N, R) bool
    decisions: the variance of blocks taken per token over its value under independence,
    sum p(1 - p) (1: independent; above: routers take the same tokens; below: they share them
    out), the total variation distance between the observed histogram and the Poisson-binomial
    one, and a permutation test's two-sided p-value: each router's column is shuffled on its own
    (keeping every router's rate exactly, breaking only the link between routers) `n` times."""
    x = taken.double()
    N, R = x.shape
    p = x.mean(0)
    var_ind = float((p * (1 - p)).sum())
    var_obs = float(x.sum(1).var(unbiased=False))
    hist = torch.bincount(taken.sum(1), minlength=R + 1).double()
    tv = 0.5 * float((hist / N - poisson_binomial(p)).abs().sum())
    g = torch.Generator().manual_seed(seed)
    draws = torch.empty(n, dtype=torch.float64)
    for i in range(n):
        cols = [x[torch.randperm(N, generator=g), j] for j in range(R)]
        draws[i] = torch.stack(cols, 1).sum(1).var(unbiased=False)
    far = ((draws - var_ind).abs() >= abs(var_obs - var_ind) - 1e-12).sum()
    return {
        "variance_ratio": var_obs / var_ind if var_ind > 0 else float("nan"),
        "total_variation": tv,
        "p_value": float((far + 1) / (n + 1)) if n > 0 else float("nan"),
        "permutations": n,
    }


def longest_run(skipped: Tensor) -> Tensor:
    """(N, R) bool -> (N,) the longest run of consecutive True along the last axis."""
    run = torch.zeros(skipped.shape[0], dtype=torch.long)
    best = torch.zeros_like(run)
    for j in range(skipped.shape[1]):
        run = torch.where(skipped[:, j], run + 1, torch.zeros_like(run))
        best = torch.maximum(best, run)
    return best


def ranks(x: Tensor) -> Tensor:
    """Ranks 1..n of `x` (1-D), ties given their average rank (as Spearman's rho needs)."""
    x = x.to(torch.float64)
    order = torch.argsort(x, stable=True)
    _, inverse, counts = torch.unique_consecutive(x[order], return_inverse=True, return_counts=True)
    start = torch.cumsum(counts, 0) - counts  # 0-based first place of each tied group
    avg = start.to(torch.float64) + (counts.to(torch.float64) + 1) / 2
    r = torch.empty_like(x)
    r[order] = avg[inverse]
    return r


def spearman(x: Tensor, y: Tensor) -> float:
    """Spearman's rho: Pearson's correlation of the (average) ranks; NaN if either is constant."""
    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = (rx.square().sum() * ry.square().sum()).sqrt()
    return float((rx * ry).sum() / den) if den > 0 else float("nan")


def bootstrap_spearman(
    x: Tensor,
    y: Tensor,
    n: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    groups: Tensor | None = None,
) -> dict[str, float]:
    """rho, and the percentile bootstrap interval over resampled (x, y) pairs; with `groups`
    ((N,) ints, e.g. each token's row), over resampled groups, each drawn whole: tokens of one
    row are not independent, and resampling them alone makes the interval too narrow."""
    g = torch.Generator().manual_seed(seed)
    rho = spearman(x, y)
    members: list[Tensor] = []
    if groups is not None and len(x):
        _, inverse = torch.unique(groups, return_inverse=True)
        members = [torch.nonzero(inverse == j).flatten() for j in range(int(inverse.max()) + 1)]
    draws = []
    if groups is not None and len(members) < 2:
        n = 0  # one row drawn again and again is no interval: NaN bounds below
    for _ in range(n):
        if groups is None:
            idx = torch.randint(0, len(x), (len(x),), generator=g)
        else:
            pick = torch.randint(0, len(members), (len(members),), generator=g)
            idx = torch.cat([members[j] for j in pick.tolist()])
        v = spearman(x[idx], y[idx])
        if v == v:  # a resample of constant values has no rho
            draws.append(v)
    if not draws:
        return {"rho": rho, "low": float("nan"), "high": float("nan"), "n": len(x)}
    d = torch.tensor(draws, dtype=torch.float64)
    a = (1 - level) / 2
    low, high = torch.quantile(d, torch.tensor([a, 1 - a], dtype=torch.float64)).tolist()
    return {"rho": rho, "low": low, "high": high, "n": len(x)}


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
    report.independence = independence_test(taken, bootstrap, seed)
    if base_loss is not None:
        # Does the router give compute to the tokens a dense model finds hard?
        report.correlations["depth_vs_baseline_loss"] = bootstrap_spearman(
            d[has_next], base_loss[has_next], bootstrap, seed, groups=rows[has_next]
        )
    return report


def _mean_interval(x: Tensor, rows: Tensor) -> tuple[float, float]:
    """Mean of `x` and the half-width of its 95% interval, clustered by `rows` (each token's row):
    tokens of one row are not independent, so the variance is the cluster-robust one, from the
    rows' sums of deviations (NaN width with fewer than 2 rows)."""
    x = x.double()
    if len(x) == 0:
        return float("nan"), float("nan")
    mean = float(x.mean())
    ids, inverse = torch.unique(rows, return_inverse=True)
    n_rows = len(ids)
    if n_rows < 2:
        return mean, float("nan")
    dev = torch.zeros(n_rows, dtype=torch.float64).index_add_(0, inverse, x - mean)
    var = n_rows / (n_rows - 1) * float(dev.square().sum()) / len(x) ** 2
    return mean, 1.96 * var**0.5


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
            row["mean_excess"], row["excess_half_width"] = _mean_interval(
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


# -- outputs ---------------------------------------------------------------------------------------
def _save(fig: object, path: Path) -> None:
    import matplotlib.pyplot as plt

    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[arg-type]
    tmp.replace(path)


def plot(report: Report, out: Path, row_len: int, show: int = 96) -> list[Path]:
    """routing.png, depth_hist.png, skip_runs.png and entropy.png in `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    R = len(report.router_names)
    n = min(show, row_len)
    fig, axes = plt.subplots(2, 1, figsize=(12, 1.2 + 0.5 * R), sharex=True)
    for ax, taken, title in (
        (axes[0], report.taken, "causal"),
        (axes[1], report.taken_topk, "top-k"),
    ):
        ax.imshow(
            taken[:n].T.float().numpy(),
            aspect="auto",
            cmap="Greens",
            vmin=0,
            vmax=1,
            interpolation="nearest",
        )
        ax.set_yticks(range(R), [f"L{nm}" for nm in report.router_names])
        ax.set_title(f"routed blocks taken ({title} routing), first {n} tokens", fontsize=9)
    axes[1].set_xlabel("token position")
    fig.tight_layout()
    _save(fig, out / "routing.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    k = [float(i) for i in range(R + 1)]
    ax.bar([i - 0.2 for i in k], report.depth_hist.tolist(), width=0.4, label="observed (causal)")
    ax.bar(
        [i + 0.2 for i in k],
        report.independent_hist.tolist(),
        width=0.4,
        label="independent coins, same rates",
    )
    ax.set_xticks(range(R + 1))
    ind = report.independence
    if ind:
        ax.set_title(
            f"variance {ind['variance_ratio']:.2f}x independent, permutation p = "
            f"{ind['p_value']:.3g}",
            fontsize=9,
        )
    ax.set_xlabel("routed blocks taken per token")
    ax.set_ylabel("tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, out / "depth_hist.png")

    runs = loss_by_run(report)
    xs = list(runs)
    has_base = report.baseline_loss is not None
    fig, axes = plt.subplots(1, 2 if has_base else 1, figsize=(11 if has_base else 6, 3.5))
    ax = axes[0] if has_base else axes
    ax.bar(xs, [runs[x]["tokens"] for x in xs], color="tab:gray")
    ax.set_xlabel("longest run of consecutive skipped routed blocks")
    ax.set_ylabel("tokens")
    ax.set_xticks(xs)
    ax2 = ax.twinx()
    ax2.plot(xs, [runs[x]["mean_loss"] for x in xs], "o-", color="tab:red", label="this model")
    if has_base:
        ax2.plot(
            xs,
            [runs[x]["mean_baseline_loss"] for x in xs],
            "s--",
            color="black",
            label="baseline, same tokens",
        )
        ax2.legend(fontsize=8, loc="upper left")
    ax2.set_ylabel("mean loss (nats)", color="tab:red")
    if has_base:
        ax = axes[1]
        by_depth = loss_by(report, report.depth)
        for table, label, shift, color in (
            (runs, "by longest skip run", -0.08, "tab:red"),
            (by_depth, "by routed blocks taken", 0.08, "tab:blue"),
        ):
            ks = list(table)
            ax.errorbar(
                [k + shift for k in ks],
                [table[k]["mean_excess"] for k in ks],
                yerr=[table[k]["excess_half_width"] for k in ks],
                fmt="o",
                capsize=3,
                color=color,
                label=label,
            )
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(range(R + 1))
        ax.set_xlabel("longest skip run / blocks taken")
        ax.set_ylabel("loss minus baseline's (nats)")
        ax.set_title("excess loss over the baseline, mean and 95% interval", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, out / "skip_runs.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    depth = report.depth
    ok = ~report.loss.isnan()
    for values, label, color in (
        (report.entropy, "entropy", "tab:blue"),
        (report.loss, "loss", "tab:red"),
    ):
        means = [
            float(values[(depth == d) & ok].mean()) if ((depth == d) & ok).any() else float("nan")
            for d in range(R + 1)
        ]
        ax.plot(range(R + 1), means, "o-", label=f"mean {label}", color=color)
    c = report.correlations
    ax.set_title(
        f"Spearman rho: depth~entropy {c['depth_vs_entropy']['rho']:+.3f}, "
        f"depth~loss {c['depth_vs_loss']['rho']:+.3f}",
        fontsize=9,
    )
    ax.set_xticks(range(R + 1))
    ax.set_xlabel("routed blocks taken")
    ax.set_ylabel("nats")
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, out / "entropy.png")
    return [out / f for f in ("routing.png", "depth_hist.png", "skip_runs.png", "entropy.png")]


def report_md(
    report: Report, classes: dict | None, extreme: dict | None, decode: Any = None
) -> str:
    """The numbers, as markdown."""
    c = report.correlations
    lines = [
        "# Where the compute went",
        "",
        f"{len(report.tokens)} held-out tokens, {len(report.router_names)} routers.",
        "",
        "| router | take-rate (causal) | causal agrees with top-k |",
        "|---|---|---|",
    ]
    lines += [
        f"| {nm} | {report.take_rate[nm]:.3f} | {report.agreement[nm]:.3f} |"
        for nm in report.router_names
    ]
    lines += ["", "| blocks taken | tokens | independent coins |", "|---|---|---|"]
    lines += [
        f"| {k} | {int(report.depth_hist[k])} | {float(report.independent_hist[k]):.1f} |"
        for k in range(len(report.depth_hist))
    ]
    ind = report.independence
    if ind:
        lines += [
            "",
            f"Against independent coins at the same per-router rates: variance of blocks taken "
            f"{ind['variance_ratio']:.2f}x the independent one (1: independent; above 1: routers "
            f"pick the same tokens; below: they share them out); total variation distance "
            f"{ind['total_variation']:.3f}; permutation test p = {ind['p_value']:.4f} "
            f"({ind['permutations']} shuffles of each router's decisions).",
        ]
    excess = report.baseline_loss is not None
    for title, table in (
        ("longest skip run", loss_by_run(report)),
        ("blocks taken", loss_by(report, report.depth)),
    ):
        head = f"| {title} | tokens | mean loss |"
        if excess:
            head += " baseline's loss | excess (95% interval) |"
        lines += ["", head, "|---|---|---|" + ("---|---|" if excess else "")]
        for k, v in table.items():
            row = f"| {k} | {v['tokens']} | {v['mean_loss']:.4f} |"
            if excess:
                row += (
                    f" {v['mean_baseline_loss']:.4f} | {v['mean_excess']:+.4f} "
                    f"(±{v['excess_half_width']:.4f}) |"
                )
            lines.append(row)
    if excess:
        ok = ~report.loss.isnan()
        mean, half = _mean_interval(report.excess[ok], report.row[ok])
        lines += [
            "",
            f"All tokens: excess loss over the baseline {mean:+.4f} (±{half:.4f}). Intervals "
            "are 95%, clustered by row (tokens of one row are not independent).",
        ]
    lines += [""]
    for key in ("depth_vs_entropy", "depth_vs_loss", "depth_vs_baseline_loss"):
        if key not in c:
            continue
        v = c[key]
        interval = f"95% bootstrap interval over rows {v['low']:+.4f} to {v['high']:+.4f}"
        name = key.replace("_", " ")
        lines.append(f"- {name}: Spearman rho {v['rho']:+.4f} ({interval}, n = {v['n']})")
    if classes:
        lines += [
            "",
            "| class | tokens | " + " | ".join(f"L{n}" for n in report.router_names) + " |",
        ]
        lines += ["|---|---|" + "---|" * len(report.router_names)]
        for name, row in classes.items():
            lines.append(
                f"| {name} | {row['tokens']} | "
                + " | ".join(f"{row[n]:.3f}" for n in report.router_names)
                + " |"
            )
    if extreme:
        for side in ("most", "least"):
            lines += [
                "",
                f"{side} routed tokens (id, mean blocks taken, count): "
                + ", ".join(
                    f"{decode(i) if decode else repr(i)} {m:.2f} ({n})" for i, m, n in extreme[side]
                ),
            ]
    return "\n".join(lines) + "\n"


# -- the page --------------------------------------------------------------------------------------
_DEPTH_COLORS = ("#ffffff", "#e5f5e0", "#a1d99b", "#41ab5d", "#006d2c", "#00441b")


def _depth_color(depth: int, routers: int) -> str:
    top = len(_DEPTH_COLORS) - 1
    return _DEPTH_COLORS[min(top, round(depth * top / max(routers, 1)))]


def html_page(
    report: Report, decode: Any, images: dict[str, Path], numbers: str, show: int = 4096
) -> str:
    """One self-contained page (no network): the text coloured by routed blocks taken (causal),
    each token's per-router decisions and weights on hover (the first `show` tokens: the
    numbers cover them all), the pictures inlined, the numbers."""
    import base64
    import html

    R = len(report.router_names)
    spans = []
    shown_tokens = report.tokens.tolist()[:show]
    for i, tok in enumerate(shown_tokens):
        depth = int(report.taken[i].sum())
        color = _depth_color(depth, R)
        hover = []
        for j, nm in enumerate(report.router_names):
            act = "take" if report.taken[i, j] else "skip"
            topk = ", top-k takes" if report.taken_topk[i, j] else ""
            hover.append(f"L{nm}: {act} (r = {float(report.weights[i, j]):+.2f}{topk})")
        hover.append(f"entropy {float(report.entropy[i]):.2f}, loss {float(report.loss[i]):.2f}")
        text = decode(tok)
        shown = html.escape(text).replace("\n", "&#8629;<br>").replace(" ", "&nbsp;")
        spans.append(
            f'<span class="tok" data-depth="{depth}" style="background:{color}" '
            f'title="{html.escape(chr(10).join(hover))}">{shown or "&#9633;"}</span>'
        )
    pictures = "".join(
        f'<figure><img alt="{name}" src="data:image/png;base64,'
        f'{base64.b64encode(path.read_bytes()).decode()}"><figcaption>{name}</figcaption></figure>'
        for name, path in images.items()
    )
    legend = "".join(
        f'<span class="key" style="background:{_depth_color(d, R)}">{d}</span>'
        for d in range(R + 1)
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>mod inspect</title><style>"
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto}"
        ".text{font-family:monospace;line-height:1.7;border:1px solid #ccc;padding:1em}"
        ".tok{border-radius:2px}.key{display:inline-block;width:2em;text-align:center;"
        "border:1px solid #999;margin-right:2px}img{max-width:100%}"
        "</style></head><body><h1>Where the compute went</h1>"
        f"<p>Routed blocks each token took (causal routing), 0 to {R}: {legend}. "
        "Hover a token for each router's decision and weight."
        + (
            f" The first {len(shown_tokens)} of {len(report.tokens)} tokens."
            if len(shown_tokens) < len(report.tokens)
            else ""
        )
        + "</p>"
        f'<div class="text">{"".join(spans)}</div>{pictures}'
        f"<pre>{html.escape(numbers)}</pre></body></html>\n"
    )
