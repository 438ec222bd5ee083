"""The statistics `mod inspect` reports, in torch on the host: the Poisson-binomial law of
independent routers, a permutation test against it, run lengths, Spearman's rho with bootstrap
intervals over rows, and means with intervals clustered by row."""

from __future__ import annotations

import torch
from torch import Tensor


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


def mean_interval(x: Tensor, rows: Tensor) -> tuple[float, float]:
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
