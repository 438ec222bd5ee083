"""What the third round trains: where round 2 found MoD furthest behind (1024 tokens of context,
1.5e14 training FLOPs, BPE), the reference pair again with the new diagnostics, and one arm per
hypothesis of why MoD stops learning where dense learns to look back."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixture_of_depths.config import MoDConfig
from mixture_of_depths.studies.runner import (
    Folders,
    RunSpec,
    StudySettings,
    budget_tag,
    mean_seeds,
    seed_gaps,
)

from ..round2.planning import DENSE, MOD, WARMUP
from ..round2.planning import FULL as ROUND2

FOLDERS = Folders(str(Path(__file__).resolve().parent))


@dataclass(frozen=True)
class Round3Settings:
    grid: StudySettings  # the BPE tokenizer, the context, the batch, the evaluation windows
    budget: float
    evaluations: int  # per run (round 2's grid had 2)
    dense_size: str  # round 2's best sizes at this budget and context
    mod_size: str
    seeds: tuple[int, ...]  # every arm
    deciding_seeds: tuple[
        int, ...
    ]  # the arms that decide the conclusion, and any that closes the gap


_SIZES = dict(ROUND2.grid.sizes)

FULL = Round3Settings(
    grid=StudySettings(
        budgets=(1.5e14,),
        sizes=ROUND2.grid.sizes,
        seq_len=1024,
        batch_size=4,
        eval_every_runs=10,
        eval_batches=64,  # 256 windows of 1024 tokens (round 2: 32)
        base={},
        ablation_size="S",
        tokenizer="bpe",
    ),
    budget=1.5e14,
    evaluations=10,
    dense_size="XS",
    mod_size="S",
    seeds=(0, 1),
    deciding_seeds=(0, 1, 2),
)

QUICK = Round3Settings(
    grid=StudySettings(
        budgets=(4e9,),
        sizes=(
            ("XS", dict(d_model=32, n_layers=2, n_heads=2, predictor_hidden=16)),
            ("S", dict(d_model=48, n_layers=2, n_heads=2, predictor_hidden=16)),
        ),
        seq_len=64,
        batch_size=2,
        eval_every_runs=2,
        eval_batches=2,
        base={},
        ablation_size="S",
        tokenizer="bpe",
    ),
    budget=4e9,
    evaluations=2,
    dense_size="XS",
    mod_size="S",
    seeds=(0,),
    deciding_seeds=(0, 1),
)

# Round 2's MoD arm (the predictor, with a 10% capacity warm-up), the reference of every variant.
MOD_ARM = {**MOD, "causal_router": "predictor"}


@dataclass(frozen=True)
class Arm:
    """One configuration of the round: its label and tag, the architecture and its overrides of
    the reference, and whether it decides the conclusion (then it has `deciding_seeds`)."""

    label: str
    tag: str
    arch: str  # "dense" or "MoD"
    over: dict[str, Any]
    deciding: bool = False
    lr: float | None = None


ARMS: tuple[Arm, ...] = (
    Arm("dense XS", "dense", "dense", {}, deciding=True),
    Arm("MoD S (round 2's arm)", "mod", "MoD", {}, deciding=True),
    Arm("MoD S, residual KV (skipped_kv=residual)", "residual", "MoD",
        {"skipped_kv": "residual"}, deciding=True),
    Arm("MoD S, MLP routed, attention dense (routing=mlp)", "mlp", "MoD",
        {"routing": "mlp"}, deciding=True),
    Arm("MoD S, straight-through gate", "st", "MoD", {"router_gate": "straight_through"}),
    Arm("MoD S, capacity 25%", "cap25", "MoD", {"capacity": 0.25}),
    Arm("MoD S, capacity 50%", "cap50", "MoD", {"capacity": 0.5}),
    Arm("dense XS, lr 1e-3", "dense-lr1e-3", "dense", {}, lr=1e-3),
    Arm("dense XS, lr 4e-3", "dense-lr4e-3", "dense", {}, lr=4e-3),
    # 4e-3 first: dense at 1e-3 stayed flat past place 32 as MoD does at 2e-3 (seed 0), so a
    # higher rate is the one that could take MoD through the same transition
    Arm("MoD S, lr 4e-3", "mod-lr4e-3", "MoD", {}, lr=4e-3),
    # MLP-only routing was level with dense at 2e-3, but dense at 4e-3 gained 0.18 nats (seed 0):
    # the variant needs the same chance before it can be called level with a tuned dense
    Arm("MoD S, routing=mlp, lr 4e-3", "mlp-lr4e-3", "MoD", {"routing": "mlp"}, lr=4e-3),
    Arm("MoD S, lr 1e-3", "mod-lr1e-3", "MoD", {}, lr=1e-3),
    # deciding since MLP-only routing (attention for every token in all 4 layers) overtook dense
    # at seed 0: whether 2 layers of attention for every token learn to look back is the question
    Arm("MoD S without its routed blocks (2 dense layers)", "bare", "bare", {}, deciding=True),
)  # fmt: skip


def supported(arm: Arm) -> bool:
    """Whether this version of the library builds the arm's model (a variant the config cannot
    express yet waits in the plan until it can)."""
    try:
        MoDConfig(**{**MOD_ARM, **arm.over})
    except (ValueError, TypeError):
        return False
    return True


def spec_of(s: Round3Settings, arm: Arm, seed: int) -> RunSpec:
    """The run of `arm` with `seed`."""
    g = s.grid
    if arm.arch == "dense":
        model = {**_SIZES[s.dense_size], **DENSE}
    elif arm.arch == "bare":  # the MoD model less its routed blocks: its dense layers alone
        shape = _SIZES[s.mod_size]
        model = {**shape, **DENSE, "n_layers": shape["n_layers"] // 2}
    else:
        model = {**_SIZES[s.mod_size], **MOD_ARM, **arm.over}
    return RunSpec(
        name=f"r3-{budget_tag(s.budget)}-{arm.tag}-s{seed}",
        group="round3",
        label=arm.label,
        budget=s.budget,
        model={"max_seq_len": g.seq_len, **model},
        seed=seed,
        seq_len=g.seq_len,
        batch_size=g.batch_size,
        evaluations=s.evaluations,
        capacity_warmup=WARMUP if arm.arch == "MoD" else 0.0,
        lr=arm.lr,
    )


def closes_the_gap(s: Round3Settings, results: list[dict[str, Any]], arm: Arm) -> bool:
    """Whether `arm`'s mean causal loss is within the dense arm's seed spread of it, or better
    (then it gets the deciding arms' seeds too)."""
    results = own_rows(results)
    dense = [r for r in results if r["label"] == ARMS[0].label]
    mine = [r for r in results if r["label"] == arm.label]
    if len(dense) < 2 or not mine:
        return False
    means = mean_seeds(dense + mine, "val_loss_causal")
    spread = max(seed_gaps(dense).values(), default=0.0)
    return means[arm.label] <= means[ARMS[0].label] + spread


def closes_at_its_rate(s: Round3Settings, results: list[dict[str, Any]], arm: Arm) -> bool:
    """Whether `arm` is another learning rate of a MoD variant that closes the gap: that
    variant's verdict against a tuned dense is taken at its best rate, so each of its rates
    needs the deciding seeds too."""
    base = next(
        (a for a in ARMS if a.over == arm.over and a.arch == arm.arch and a.lr is None), None
    )
    return arm.lr is not None and base is not None and closes_the_gap(s, results, base)


def own_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the round's arms (group "round3"), not of the winner's isoFLOP points."""
    return [r for r in results if r.get("group") == "round3"]


def leading(results: list[dict[str, Any]], arm: Arm) -> bool:
    """Whether MoD arm `arm`'s mean causal loss so far is nearer dense's than round 2's MoD
    arm's (it closes more than half the gap): its seeds then come first, among the deciding
    runs. A dense arm never leads: it closes no gap (`plan` gives a better dense rate its
    seeds)."""
    means = mean_seeds(own_rows(results), "val_loss_causal")
    dense, mod, mine = (means.get(a.label) for a in (ARMS[0], ARMS[1], arm))
    if (
        arm in ARMS[:2]
        or arm.arch == "dense"
        or dense is None
        or mod is None
        or mine is None
        or mod <= dense
    ):
        return False
    return mod - mine > (mod - dense) / 2


def plan(s: Round3Settings, results: list[dict[str, Any]]) -> list[RunSpec]:
    """Every run the results so far call for, in the order to run them: the deciding arms (and
    any MoD arm that closes the gap to dense or leads, `leading`) seed by seed, then the other
    arms seed by seed, so that what decides the conclusion has its seeds first; within a seed,
    dense and the leading arms first, and among the other arms the learning-rate arms first
    (whether round 2 compared untuned arms outranks the other hypotheses once dense gained from
    a rate of its own). A dense rate that beats the reference is the reference at its best:
    every verdict against dense hangs on it, so once every arm has its first seed, its other
    seeds come next, up to the deciding arms' count. The third seed of every deciding arm and of
    any MoD arm that closes the gap, at each of its rates (`closes_at_its_rate`). Then the
    winner's isoFLOP points (`follow_up`), once there is a winner: they come before the other
    arms' later seeds, which repeat readings that closed little of the gap, where the points
    test the conclusion itself (issue 36, item 4). Arms the library cannot build yet are left
    out until it can."""
    arms = [a for a in ARMS if supported(a)]
    lead = [a for a in arms if leading(results, a)]
    arms = [*arms[:1], *lead, *(a for a in arms[1:] if a not in lead)]
    first, then = [], []
    for seed in sorted({*s.seeds, *s.deciding_seeds}):
        for arm in arms:
            more = arm.deciding or (
                arm.arch != "dense"
                and (closes_the_gap(s, results, arm) or closes_at_its_rate(s, results, arm))
            )
            tuned = arm.arch == "dense" and arm.lr is not None and closes_the_gap(s, results, arm)
            if seed in s.seeds or ((more or tuned) and seed in s.deciding_seeds):
                if more or arm in lead:
                    first.append(spec_of(s, arm, seed))
                else:
                    key = (seed > min(s.seeds) and not tuned, seed, arm.lr is None)
                    then.append((key, spec_of(s, arm, seed)))
    then.sort(key=lambda t: t[0])  # stable: ARMS order within a key
    readings = [sp for key, sp in then if not key[0]]  # first seeds, and a tuned dense's
    repeats = [sp for key, sp in then if key[0]]
    return first + readings + follow_up(s, results) + repeats


# -- item 4: a variant that brings MoD within dense's seed spread, or ahead ---------------------
# Its isoFLOP points at round 2's 1024-token budgets, with dense and round 2's MoD arm (joint
# routing) rerun beside it where round 3 has no such arm (round 2 evaluated on 32 windows, round
# 3 on 256): sizes per budget. Round 2's MoD led dense at 5e13: whether the winner gives that up
# there is part of the advice (docs/study.md), so it is measured with the same evaluation.
FOLLOW_UP: tuple[tuple[float, tuple[str, ...], tuple[str, ...], tuple[str, ...]], ...] = (
    # (budget, the winner's sizes, dense's sizes, round 2's MoD arm's sizes: its best there)
    (5e13, ("XXS", "XS", "S"), ("XXS", "XS"), ("XS",)),
    (1.5e14, ("XS", "S", "M"), (), ()),  # dense and MoD: the round's own XS and S arms
)


def winner(s: Round3Settings, results: list[dict[str, Any]]) -> Arm | None:
    """The first MoD variant (round 2's arm aside) with two seeds or more that closes the gap
    (`closes_the_gap`: within dense's seed spread of it, or better)."""
    for arm in ARMS[2:]:
        seeds = {r["seed"] for r in own_rows(results) if r["label"] == arm.label}
        if arm.arch == "MoD" and len(seeds) >= 2 and closes_the_gap(s, results, arm):
            return arm
    return None


def best_dense(results: list[dict[str, Any]]) -> Arm:
    """Dense at its best learning rate: among the dense arms that trained every seed the
    reference did, the one with the lowest mean causal loss on those seeds (the reference while
    no other rate has them all). The winner's isoFLOP points are trained beside it too, so the
    winner is compared with a tuned dense, not only with round 2's rate."""
    rows = own_rows(results)
    ref = {r["seed"] for r in rows if r["label"] == ARMS[0].label}
    best, best_loss = ARMS[0], None
    for arm in (a for a in ARMS if a.arch == "dense"):
        losses = {r["seed"]: r["val_loss_causal"] for r in rows if r["label"] == arm.label}
        if not ref or not ref <= set(losses):
            continue
        loss = sum(losses[seed] for seed in ref) / len(ref)
        if best_loss is None or loss < best_loss:
            best, best_loss = arm, loss
    return best


def over_text(over: dict[str, Any]) -> str:
    """Overrides as "key=value, ..." ("" for none)."""
    return ", ".join(f"{k}={v}" for k, v in over.items())


def _over_text(arm: Arm) -> str:
    lr = {"lr": arm.lr} if arm.lr is not None else {}
    return over_text({**arm.over, **lr}) or "round 2's arm"


def iso_spec(s: Round3Settings, arm: Arm, budget: float, size: str, seed: int) -> RunSpec:
    """`arm` (MoD or dense) at `size` and `budget`, as the round trains it otherwise."""
    base = spec_of(s, arm, seed)
    shape = _SIZES[size] if arm.arch == "dense" else {**_SIZES[size], **MOD_ARM, **arm.over}
    if arm.arch == "dense":
        shape = {**shape, **DENSE}
    return dataclasses.replace(
        base,
        name=f"r3-iso-{budget_tag(budget)}-{arm.tag}-{size}-s{seed}",
        group="isoflop",
        # never an arm's label: these rows are the winner's points, judged apart (`own_rows`)
        label=(f"dense {size}" if arm.arch == "dense" else f"MoD {size}, {_over_text(arm)}")
        + (f", lr {arm.lr:g}" if arm.arch == "dense" and arm.lr is not None else "")
        + f", {budget_tag(budget)} FLOPs",
        budget=budget,
        model={"max_seq_len": s.grid.seq_len, **shape},
    )


def follow_up(s: Round3Settings, results: list[dict[str, Any]]) -> list[RunSpec]:
    """With a `winner`: its isoFLOP points (the sizes of `FOLLOW_UP` at each budget) and dense's
    and round 2's MoD arm's where the round has none, seed 0, dense at round 2's rate and, where
    another rate beat it, at its best (`best_dense`); then a second seed for the best size of
    each (by causal loss, once all its sizes ran). A point the round already trained (the winner
    at its own size and budget) is reused, not trained again (`rounds.twin`)."""
    arm = winner(s, results)
    if arm is None or s is not FULL:
        return []
    done = {r["name"]: r for r in results}
    tuned = best_dense(results)
    specs = []
    for budget, sizes, dense_sizes, joint_sizes in FOLLOW_UP:
        sides = [(arm, sizes), (ARMS[0], dense_sizes)]
        sides += [(tuned, dense_sizes)] if tuned is not ARMS[0] else []
        sides += [(ARMS[1], joint_sizes)]
        for who, names in sides:
            firsts = [iso_spec(s, who, budget, size, 0) for size in names]
            specs += firsts
            if firsts and all(sp.name in done for sp in firsts):
                best = min(firsts, key=lambda sp: done[sp.name]["val_loss_causal"])
                size = best.name.rsplit("-", 2)[1]
                specs.append(iso_spec(s, who, budget, size, 1))
    return specs


def arm_of(row: dict[str, Any]) -> Arm | None:
    """The arm a result row belongs to."""
    return next((a for a in ARMS if a.label == row["label"]), None)


def arm_of_run(name: str) -> Arm:
    """The arm a run was planned from, by its tag in the run's name (`spec_of`'s
    "r3-<budget>-<tag>-s<seed>" or `iso_spec`'s "r3-iso-<budget>-<tag>-<size>-s<seed>"): an
    isoFLOP point's label is not its arm's."""
    parts = name.split("-")
    tag = "-".join(parts[3:-2] if parts[1] == "iso" else parts[2:-1])
    arm = next((a for a in ARMS if a.tag == tag), None)
    if arm is None:
        raise ValueError(f"run {name!r}: no round 3 arm has the tag {tag!r}")
    return arm
