"""Where the compute went, token by token: the numbers behind `mod inspect`.

`analyse(model, tokens)` runs one forward pass in causal routing (what generation does) and one in
top-k routing over the same rows and reports, per token, which routed (sub-)blocks it took, the
router weights, the model's predictive entropy and its loss; and over all tokens:

- the histogram of blocks taken per token, beside the histogram routing would give if each
  router flipped an independent coin at its own take-rate (a Poisson-binomial distribution);
- the longest run of consecutive skipped routers of each token (in layer order), its
  distribution, and the mean loss by run length;
- Spearman's rho of blocks taken against entropy and against loss, with percentile bootstrap
  intervals over tokens;
- how often the causal decision and top-k agree, per router.

Everything is computed with torch on the host; no plotting here.
"""

from __future__ import annotations

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
    x: Tensor, y: Tensor, n: int = 1000, seed: int = 0, level: float = 0.95
) -> dict[str, float]:
    """rho, and the percentile bootstrap interval over resampled (x, y) pairs."""
    g = torch.Generator().manual_seed(seed)
    rho = spearman(x, y)
    draws = []
    for _ in range(n):
        idx = torch.randint(0, len(x), (len(x),), generator=g)
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


@torch.no_grad()
def analyse(model: MoDTransformer, tokens: Tensor, bootstrap: int = 1000, seed: int = 0) -> Report:
    """The routing of `tokens` ((T,) or (B, T) ids, each row a held-out stretch) through `model`
    (see the module docstring)."""
    idx = tokens[None] if tokens.dim() == 1 else tokens
    was = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        idx = idx.to(device)
        causal = model(idx, routing="causal")
        topk = model(idx, routing="topk")
    finally:
        model.train(was)
    if not causal.routes:
        raise ValueError("the model has no routed blocks: nothing to inspect")
    names, taken, weights = _table(causal.routes)
    _, taken_topk, _ = _table(topk.routes)
    B, T, R = taken.shape
    logits = causal.logits.float().cpu()
    logp = logits.log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)  # (B, T)
    loss = torch.full((B, T), float("nan"))
    nxt = idx[:, 1:].cpu()
    loss[:, :-1] = -logp[:, :-1].gather(-1, nxt[..., None])[..., 0]
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
    )
    has_next = ~loss.isnan()
    d = depth.double()
    report.correlations = {
        "depth_vs_entropy": bootstrap_spearman(d, entropy.double(), bootstrap, seed),
        "depth_vs_loss": bootstrap_spearman(d[has_next], loss[has_next].double(), bootstrap, seed),
    }
    return report


def loss_by_run(report: Report) -> dict[int, dict[str, float]]:
    """Per longest-skip-run length: how many tokens and their mean loss (tokens with a next)."""
    out = {}
    ok = ~report.loss.isnan()
    for k in sorted(set(report.longest_skip.tolist())):
        sel = (report.longest_skip == k) & ok
        out[k] = {
            "tokens": int((report.longest_skip == k).sum()),
            "mean_loss": float(report.loss[sel].mean()) if sel.any() else float("nan"),
        }
    return out


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


def class_table(report: Report) -> dict[str, dict[str, float]]:
    """Byte tokenizer: per class, its tokens and the share of them each router took (causal)."""
    classes = [byte_class(int(t)) for t in report.tokens.tolist()]
    out = {}
    for c in BYTE_CLASSES:
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
    ax.set_xlabel("routed blocks taken per token")
    ax.set_ylabel("tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, out / "depth_hist.png")

    runs = loss_by_run(report)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = list(runs)
    ax.bar(xs, [runs[x]["tokens"] for x in xs], color="tab:gray")
    ax.set_xlabel("longest run of consecutive skipped routed blocks")
    ax.set_ylabel("tokens")
    ax2 = ax.twinx()
    ax2.plot(xs, [runs[x]["mean_loss"] for x in xs], "o-", color="tab:red")
    ax2.set_ylabel("mean loss (nats)", color="tab:red")
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
    lines += ["", "| longest skip run | tokens | mean loss |", "|---|---|---|"]
    lines += [
        f"| {k} | {v['tokens']} | {v['mean_loss']:.4f} |" for k, v in loss_by_run(report).items()
    ]
    lines += [""]
    for key in ("depth_vs_entropy", "depth_vs_loss"):
        v = c[key]
        interval = f"95% bootstrap interval {v['low']:+.4f} to {v['high']:+.4f}"
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
                    f"{decode(i) if decode else i!r} {m:.2f} ({n})" for i, m, n in extreme[side]
                ),
            ]
    return "\n".join(lines) + "\n"


# -- the page --------------------------------------------------------------------------------------
_DEPTH_COLORS = ("#ffffff", "#e5f5e0", "#a1d99b", "#41ab5d", "#006d2c", "#00441b")


def _depth_color(depth: int, routers: int) -> str:
    top = len(_DEPTH_COLORS) - 1
    return _DEPTH_COLORS[min(top, round(depth * top / max(routers, 1)))]


def html_page(report: Report, decode: Any, images: dict[str, Path], numbers: str) -> str:
    """One self-contained page (no network): the text coloured by routed blocks taken (causal),
    each token's per-router decisions and weights on hover, the pictures inlined, the numbers."""
    import base64
    import html

    R = len(report.router_names)
    spans = []
    for i, tok in enumerate(report.tokens.tolist()):
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
        "Hover a token for each router's decision and weight.</p>"
        f'<div class="text">{"".join(spans)}</div>{pictures}'
        f"<pre>{html.escape(numbers)}</pre></body></html>\n"
    )
