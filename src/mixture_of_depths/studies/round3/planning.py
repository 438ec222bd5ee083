"""What the third round trains: where round 2 found MoD furthest behind (1024 tokens of context,
1.5e14 training FLOPs, BPE), the reference pair again with the new diagnostics, and one arm per
hypothesis of why MoD stops learning where dense learns to look back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...config import MoDConfig
from ..round2.planning import DENSE, MOD, WARMUP
from ..round2.planning import FULL as ROUND2
from ..runner import Folders, RunSpec, StudySettings, budget_tag, mean_seeds, seed_gaps

FOLDERS = Folders(out="docs/study/round3", work="runs/study-round3", quick_apart=True)


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
    Arm("MoD S, lr 1e-3", "mod-lr1e-3", "MoD", {}, lr=1e-3),
    Arm("MoD S, lr 4e-3", "mod-lr4e-3", "MoD", {}, lr=4e-3),
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
    dense = [r for r in results if r["label"] == ARMS[0].label]
    mine = [r for r in results if r["label"] == arm.label]
    if len(dense) < 2 or not mine:
        return False
    means = mean_seeds(dense + mine, "val_loss_causal")
    spread = max(seed_gaps(dense).values(), default=0.0)
    return means[arm.label] <= means[ARMS[0].label] + spread


def plan(s: Round3Settings, results: list[dict[str, Any]]) -> list[RunSpec]:
    """Every run the results so far call for, in the order to run them: the deciding arms (and
    any arm that closes the gap to dense) seed by seed, then the other arms seed by seed, so
    that what decides the conclusion has its seeds first; the third seed of every deciding arm
    and of any arm that closes the gap. Arms the library cannot build yet are left out until
    it can."""
    arms = [a for a in ARMS if supported(a)]
    first, then = [], []
    for seed in sorted({*s.seeds, *s.deciding_seeds}):
        for arm in arms:
            more = arm.deciding or closes_the_gap(s, results, arm)
            if seed in s.seeds or (more and seed in s.deciding_seeds):
                (first if more else then).append(spec_of(s, arm, seed))
    return first + then


def arm_of(row: dict[str, Any]) -> Arm | None:
    """The arm a result row belongs to."""
    return next((a for a in ARMS if a.label == row["label"]), None)
