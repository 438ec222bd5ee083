"""What the second round trains: its settings, the routing variants, and the plan that follows
the results (the ablations, then the winner's warm-up, the longer runs and the grid)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixture_of_depths.studies.runner import (
    AUX_ROUTING,
    Folders,
    RunSpec,
    StudySettings,
    budget_tag,
    mean_seeds,
)

# --quick writes beside them, never into the committed results
FOLDERS = Folders(str(Path(__file__).resolve().parent))


@dataclass(frozen=True)
class Round2Settings:
    grid: StudySettings  # budgets, sizes, tokenizer; seq_len/batch_size are the first context's
    contexts: tuple[tuple[int, int], ...]  # (seq_len, batch_size), the same tokens per step
    ablation_budget: float
    long_budget: float  # the winner, random routing and dense again, trained this much longer
    ablation_evaluations: int
    profile_rows: int  # held-out rows `inspect.analyse` profiles each ablation's routing on


_SIZES = (
    ("XXXS", dict(d_model=32, n_layers=4, n_heads=2)),
    ("XXS", dict(d_model=48, n_layers=4, n_heads=3)),
    ("XS", dict(d_model=64, n_layers=4, n_heads=4)),
    ("S", dict(d_model=96, n_layers=4, n_heads=4)),
    ("M", dict(d_model=128, n_layers=6, n_heads=4)),
    ("L", dict(d_model=192, n_layers=6, n_heads=6)),
)

# Three sizes around each budget's expected compute-optimal size; where an architecture's best
# size lands on the edge of those, `plan` adds the next size out (`_bracket`), so every isoFLOP
# curve shows its minimum. The ablations use S at the smallest budget (~2 minutes a run).
FULL = Round2Settings(
    grid=StudySettings(
        budgets=(1.5e13, 5e13, 1.5e14),
        sizes=_SIZES,
        seq_len=256,
        batch_size=16,
        eval_every_runs=2,
        eval_batches=8,
        base={},
        ablation_size="S",
        skip=(
            (1.5e13, ("XXXS", "XXS", "L")),
            (5e13, ("XXXS", "XXS", "XS")),
            (1.5e14, ("XXXS", "XXS", "XS")),
        ),
        tokenizer="bpe",
    ),
    contexts=((256, 16), (1024, 4)),
    ablation_budget=1.5e13,
    long_budget=5e13,
    ablation_evaluations=10,
    profile_rows=16,
)

QUICK = Round2Settings(
    grid=StudySettings(
        budgets=(3e9, 1e10),
        sizes=(
            ("S", dict(d_model=32, n_layers=2, n_heads=2, predictor_hidden=16)),
            ("M", dict(d_model=48, n_layers=2, n_heads=2, predictor_hidden=16)),
        ),
        seq_len=32,
        batch_size=4,
        eval_every_runs=1,
        eval_batches=1,
        base={},
        ablation_size="S",
        tokenizer="bpe",
    ),
    contexts=((32, 4), (64, 2)),
    ablation_budget=3e9,
    long_budget=6e9,
    ablation_evaluations=3,
    profile_rows=2,
)

MOD = dict(layer_pattern="DR", capacity=0.125, **AUX_ROUTING)  # variants override the routing
DENSE = dict(layer_pattern="D")
# (label, tag, MoDConfig overrides): the learned causal routers, in the order the report shows.
LEARNED: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("aux loss 0.1 (round 1)", "aux", dict(aux_loss_weight=0.1)),
    ("aux loss 0.01", "aux001", dict(aux_loss_weight=0.01)),
    ("aux loss 1.0", "aux1", dict(aux_loss_weight=1.0)),
    ("predictor", "pred", dict(causal_router="predictor")),
    ("aux loss 0.1, straight-through gate", "aux-st", dict(router_gate="straight_through")),
    ("predictor, straight-through gate", "pred-st",
     dict(causal_router="predictor", router_gate="straight_through")),
    # the router learns from its aux loss alone: what the aux loss by itself makes of routing
    ("aux loss 0.1, no LM gradient to the router", "aux-sg", dict(router_gate="sigmoid_stopgrad")),
)  # fmt: skip
SEEDS = (0, 1)
WARMUP = 0.1


def _ablation(
    s: Round2Settings, label: str, tag: str, over: dict[str, Any], seed: int, **kw: Any
) -> RunSpec:
    g = s.grid
    size, shape = next(sz for sz in g.sizes if sz[0] == g.ablation_size)
    seq_len, batch = s.contexts[0]
    return RunSpec(
        name=f"abl-{tag}-s{seed}",
        group="ablation",
        label=label,
        budget=s.ablation_budget,
        model={"max_seq_len": seq_len, **shape, **over},
        seed=seed,
        seq_len=seq_len,
        batch_size=batch,
        evaluations=s.ablation_evaluations,
        **kw,
    )


def mean_of(rows: list[dict[str, Any]], key: str) -> float:
    """The mean of `key` over `rows`."""
    return sum(r[key] for r in rows) / len(rows)


def winner(results: list[dict[str, Any]]) -> tuple[str, str, dict[str, Any]] | None:
    """The learned causal router with the lowest causal loss averaged over its seeds, once every
    learned variant has all its seeds (None before)."""
    best = None
    for label, tag, over in LEARNED:
        rows = [r for r in results if r["name"] in {f"abl-{tag}-s{sd}" for sd in SEEDS}]
        if len(rows) < len(SEEDS):
            return None
        loss = mean_of(rows, "val_loss_causal")
        if best is None or loss < best[0]:
            best = (loss, (label, tag, over))
    return None if best is None else best[1]


def mod_arm(results: list[dict[str, Any]]) -> tuple[str, str, dict[str, Any], float] | None:
    """The MoD arm of the longer runs and the grid: the winner, with the capacity warm-up if its
    warm-up runs beat it on the mean causal loss over the seeds; (label, tag, overrides,
    warm-up). None until the winner's warm-up runs are all in."""
    win = winner(results)
    if win is None:
        return None
    label, tag, over = win
    plain = [r for r in results if r["name"] in {f"abl-{tag}-s{sd}" for sd in SEEDS}]
    warm = [r for r in results if r["name"] in {f"abl-{tag}-warm-s{sd}" for sd in SEEDS}]
    if len(warm) < len(SEEDS):
        return None
    if mean_of(warm, "val_loss_causal") < mean_of(plain, "val_loss_causal"):
        return f"{label}, capacity warm-up {WARMUP:.0%}", f"{tag}-warm", over, WARMUP
    return label, tag, over, 0.0


def plan(s: Round2Settings, results: list[dict[str, Any]]) -> list[RunSpec]:
    """Every run the results so far call for, in the order to run them (those already done
    included): the ablations; then, once the learned routers are all in, the winner's warm-up
    ablation; then the longer runs and the grid with `mod_arm` as the MoD arm; second seeds of
    a grid budget once its first seeds are done."""
    by_name = {r["name"]: r for r in results}
    specs = _ablations(s, by_name)
    win = winner(results)
    if win is None:
        return specs
    label, tag, over = win
    for seed in SEEDS:
        specs.append(
            _ablation(s, f"{label}, capacity warm-up {WARMUP:.0%}", f"{tag}-warm", {**MOD, **over},
                      seed, capacity_warmup=WARMUP)
        )  # fmt: skip
    arm = mod_arm(results)
    if arm is None:
        return specs
    specs += _longer(s, arm)
    # Budget by budget, both contexts at each: a study cut short still compares the contexts.
    for budget in s.grid.budgets:
        for seq_len, batch in s.contexts:
            specs += _grid(s, by_name, budget, seq_len, batch, arm)
    return specs


def _ablations(s: Round2Settings, by_name: dict[str, dict[str, Any]]) -> list[RunSpec]:
    """Phase 1: each learned router, random routing and dense, both seeds; then random routing
    at the aux-loss model's own causal take-rates, once that model's seed is in."""
    specs = []
    for seed in SEEDS:
        for label, tag, over in LEARNED:
            specs.append(_ablation(s, label, tag, {**MOD, **over}, seed))
        specs.append(
            _ablation(s, "random, take-rate = capacity", "rand", {**MOD, "router_scores": "random"},
                      seed)
        )  # fmt: skip
        specs.append(_ablation(s, "dense", "dense", DENSE, seed))
    for seed in SEEDS:  # random at the aux-loss model's own causal rates (the same seed's)
        aux = by_name.get(f"abl-aux-s{seed}")
        if aux is not None:
            # strictly inside (0, 1): a router that never (or always) took stays a coin
            rates = ",".join(
                f"{min(max(v, 1e-4), 1 - 1e-4):.6f}" for v in aux["causal_take_rate"].values()
            )
            over = {**MOD, "router_scores": "random", "random_take_rates": rates}
            specs.append(
                _ablation(s, "random, take-rates of aux loss 0.1", "rand-rates", over, seed)
            )
    return specs


def _longer(s: Round2Settings, arm: tuple[str, str, dict[str, Any], float]) -> list[RunSpec]:
    """The MoD arm, random routing and dense trained 3.3x longer (does learned routing pull away
    from random with more training?), and the MoD model without its routed blocks at both
    budgets (does the routed compute do anything at this size?)."""
    label, tag, over, warmup = arm
    specs = []
    for seed in SEEDS:
        for lab, t, o, w in ((label, tag, over, warmup), ("random, take-rate = capacity", "rand",
                             {"router_scores": "random"}, 0.0)):  # fmt: skip
            spec = _ablation(s, lab, t, {**MOD, **o}, seed, capacity_warmup=w)
            specs.append(dataclasses.replace(spec, name=f"long-{t}-s{seed}", group="longer",
                                             budget=s.long_budget))  # fmt: skip
        spec = _ablation(s, "dense", "dense", DENSE, seed)
        specs.append(dataclasses.replace(spec, name=f"long-dense-s{seed}", group="longer",
                                         budget=s.long_budget))  # fmt: skip
    # The MoD model less its routed blocks: its unrouted layers alone, a dense model.
    g = s.grid
    layers = dict(g.sizes)[g.ablation_size]["n_layers"] // 2
    bare = {**DENSE, "n_layers": layers}
    bare_label = f"dense, {layers} layers (the MoD model without its routed blocks)"
    for seed in SEEDS:
        specs.append(_ablation(s, bare_label, "bare", bare, seed))
        spec = _ablation(s, bare_label, "bare", bare, seed)
        specs.append(dataclasses.replace(spec, name=f"long-bare-s{seed}", group="longer",
                                         budget=s.long_budget))  # fmt: skip
    return specs


def _grid(
    s: Round2Settings,
    by_name: dict[str, dict[str, Any]],
    budget: float,
    seq_len: int,
    batch: int,
    arm: tuple[str, str, dict[str, Any], float],
) -> list[RunSpec]:
    """Phase 2 at one budget and context: dense and the MoD arm at each size, the sizes widened
    (`_bracket`) until each architecture's best has a tried size on both sides; the second
    seeds once every first seed is in."""
    g = s.grid
    _, _, over, warmup = arm
    order = [n for n, _ in g.sizes]
    sizes = [size for size, _ in g.sizes_at(budget)]
    while True:
        grid = [
            RunSpec(
                name=f"ctx{seq_len}-{budget_tag(budget)}-{arch}-{size}-s0",
                group="isoflop",
                label=f"{arch} {size}",
                budget=budget,
                model={"max_seq_len": seq_len, **dict(g.sizes)[size], **arch_over},
                seq_len=seq_len,
                batch_size=batch,
                capacity_warmup=warmup if arch == "MoD" else 0.0,
            )
            for size in sizes
            for arch, arch_over in (("dense", DENSE), ("MoD", {**MOD, **over}))
        ]
        if not grid or not all(sp.name in by_name for sp in grid):
            break
        # second seeds, where in, count too: the summary's best is the seeds' mean
        seeded = [by_name.get(sp.name[:-3] + "-s1") for sp in grid]
        rows = [by_name[sp.name] for sp in grid] + [r for r in seeded if r is not None]
        more = _bracket(rows, sizes, order)
        if not more:
            break
        sizes = sorted({*sizes, *more}, key=order.index)
    if all(sp.name in by_name for sp in grid):
        return grid + _second_seeds([by_name[sp.name] for sp in grid])
    return grid


def _bracket(rows: list[dict[str, Any]], tried: list[str], sizes: list[str]) -> set[str]:
    """The sizes to add so that each architecture's best size (by the mean over the seeds in
    `rows`; MoD by its causal loss, as `findings` judges) has a tried size on both sides: the
    next size out where the best is the smallest or the largest tried, if `sizes` (smallest
    first) holds one."""
    more = set()
    for arch in ("dense", "MoD"):
        mine = mean_seeds([r for r in rows if r["label"].startswith(arch + " ")], "val_loss_causal")
        best = min(mine, key=mine.get).split(" ", 1)[1]
        i = sizes.index(best)
        if best == tried[0] and i > 0:
            more.add(sizes[i - 1])
        if best == tried[-1] and i + 1 < len(sizes):
            more.add(sizes[i + 1])
    return more - set(tried)


def _second_seeds(rows: list[dict[str, Any]]) -> list[RunSpec]:
    """Seed 1 of the best two sizes of each architecture (by seed 0's causal loss): the models
    the budget's headline compares and their runners-up, so that neither the gap nor the choice
    of the best size rests on one seed."""
    out = []
    for arch in ("dense", "MoD"):
        mine = [r for r in rows if r["label"].startswith(arch + " ")]
        for r in sorted(mine, key=lambda r: r["val_loss_causal"])[:2]:
            spec = RunSpec.from_row(r)
            out.append(dataclasses.replace(spec, name=r["name"][:-3] + "-s1", group="seed", seed=1))
    return out
