"""What round 4 trains, and the rule that reads it (written before its first run).

Where round 3 left the largest budget (1024 tokens, 1.5e14 training FLOPs, BPE): dense's best
learning rate (4e-3) was the top of the rates tried, at one size, and MLP-only routing never had
the same tuning. This round brackets dense in rate and size, tunes MLP-only routing the same
way, and tries the two MoD variants that could win here (README.md has the question, the rule
and the answer).

An arm is a family (the model's routing), a size (round 2's size table), a peak learning rate
and a learning-rate warm-up. Round 3's rows at this budget are this round's anchors
(``anchors.jsonl``, copied from round 3's results): the plan and the report read them beside
the round's own rows, by the arm each row's model and rates make (`arm_key`), never by label.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mixture_of_depths.config import MoDConfig
from mixture_of_depths.studies.runner import RunSpec, StudySettings

HERE = Path(__file__).resolve().parent
ANCHORS = HERE / "anchors.jsonl"

# round 2's size table (round 3 trained from it): d_model, layers, heads
SIZES: dict[str, dict[str, int]] = {
    "XXXS": dict(d_model=32, n_layers=4, n_heads=2),
    "XXS": dict(d_model=48, n_layers=4, n_heads=3),
    "XS": dict(d_model=64, n_layers=4, n_heads=4),
    "S": dict(d_model=96, n_layers=4, n_heads=4),
    "M": dict(d_model=128, n_layers=6, n_heads=4),
    "L": dict(d_model=192, n_layers=6, n_heads=6),
}
ORDER = tuple(SIZES)

# Round 2's MoD arm as round 3 trained it: every other block routed at 12.5%, the predictor as
# the causal router, sigmoid gates, a 10% capacity warm-up.
MOD = dict(layer_pattern="DR", capacity=0.125, causal_router="predictor",
           router_gate="sigmoid", aux_loss_weight=0.1)  # fmt: skip
CAPACITY_WARMUP = 0.1

# family -> (what the family changes of the MoD arm (None: dense), its words)
FAMILIES: dict[str, tuple[dict[str, Any] | None, str]] = {
    "dense": (None, "dense"),
    "joint": ({"routing": "joint"}, "MoD, joint routing (round 2's arm)"),
    "mlp": ({"routing": "mlp"}, "MoD, MLP routed every other layer, attention dense"),
    "mlp-all": ({"routing": "mlp", "layer_pattern": "R"},
                "MoD, MLP routed in every layer, attention dense"),
    # (b): every token queries a routed layer's attention, only its takers are keys and values
    # (and take the MLP): README.md says why
    "mlp-kv": ({"routing": "mlp_kv"},
               "MoD, takers' keys only: every token queries, takers write KV and take the MLP"),
}  # fmt: skip
BASE_LR = 2e-3  # TrainConfig's peak rate: round 3's arms without a rate of their own


@dataclass(frozen=True)
class Settings:
    grid: StudySettings  # tokenizer, context, batch, evaluation windows
    budget: float
    evaluations: int
    seeds: tuple[int, ...]  # every arm
    deciding_seeds: tuple[int, ...]  # the tuned arms, and any within the spread of dense
    anchors: bool  # read round 3's rows (the full round only)


FULL = Settings(
    grid=StudySettings(
        budgets=(1.5e14,), sizes=tuple(SIZES.items()), seq_len=1024, batch_size=4,
        eval_every_runs=10, eval_batches=64, base={}, ablation_size="S", tokenizer="bpe",
    ),
    budget=1.5e14,
    evaluations=10,
    seeds=(0, 1),
    deciding_seeds=(0, 1, 2),
    anchors=True,
)  # fmt: skip

QUICK = Settings(
    grid=StudySettings(
        budgets=(3e9,), sizes=tuple(SIZES.items()), seq_len=64, batch_size=2,
        eval_every_runs=2, eval_batches=2, base={}, ablation_size="S", tokenizer="bpe",
    ),
    budget=3e9,
    evaluations=2,
    seeds=(0,),
    deciding_seeds=(0,),
    anchors=False,
)  # fmt: skip


@dataclass(frozen=True)
class Arm:
    family: str
    size: str
    lr: float
    lr_warmup: float | None = None  # share of the steps; None: the harness's (<= 50 steps)

    @property
    def tag(self) -> str:
        warm = "" if self.lr_warmup is None else f"-w{self.lr_warmup:g}"
        return f"{self.family}-{self.size}-lr{rate_tag(self.lr)}{warm}"

    @property
    def label(self) -> str:
        warm = "" if self.lr_warmup is None else f", warm-up {self.lr_warmup:.0%} of the steps"
        return f"{FAMILIES[self.family][1]}, {self.size}, lr {rate_tag(self.lr)}{warm}"


def rate_tag(lr: float) -> str:
    """A learning rate as run names write it: 0.008 -> "8e-3", 0.016 -> "1.6e-2"."""
    mantissa, exp = f"{lr:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exp)}"


def model_of(s: Settings, arm: Arm) -> dict[str, Any]:
    """`arm`'s MoDConfig fields (the vocabulary is the tokenizer's, set by the harness)."""
    over, _ = FAMILIES[arm.family]
    shape = {"max_seq_len": s.grid.seq_len, **SIZES[arm.size]}
    if s is QUICK:
        shape["predictor_hidden"] = 16
    if over is None:
        return {**shape, "layer_pattern": "D"}
    return {**shape, **MOD, **over}


def supported(arm: Arm) -> bool:
    """Whether this version of the library builds `arm`'s model: an arm it cannot build yet
    waits outside the plan until it can."""
    try:
        MoDConfig(**model_of(FULL, arm))
    except (ValueError, TypeError):
        return False
    return True


def spec_of(s: Settings, arm: Arm, seed: int, group: str = "round4") -> RunSpec:
    """The run of `arm` with `seed`."""
    return RunSpec(
        name=f"r4-{arm.tag}-s{seed}",
        group=group,
        label=arm.label,
        budget=s.budget,
        model=model_of(s, arm),
        seed=seed,
        seq_len=s.grid.seq_len,
        batch_size=s.grid.batch_size,
        evaluations=s.evaluations,
        capacity_warmup=0.0 if arm.family == "dense" else CAPACITY_WARMUP,
        lr=arm.lr,
        lr_warmup=arm.lr_warmup,
    )


# -- reading rows back as arms -------------------------------------------------------------


def arm_key(row: dict[str, Any]) -> Arm | None:
    """The arm a result row trained (round 3's anchors included), from its model and rates;
    None for a model outside this round's families (round 3's other arms)."""
    m = row["model"]
    size = next((k for k, v in SIZES.items() if all(m.get(f) == x for f, x in v.items())), None)
    family = family_of(m)
    if size is None or family is None:
        return None
    return Arm(family, size, row.get("lr") or BASE_LR, row.get("lr_warmup"))


def family_of(model: dict[str, Any]) -> str | None:
    """The family of a row's model fields, or None for any other model."""
    pattern = model.get("layer_pattern", "D")
    if "R" not in pattern:
        return "dense" if pattern == "D" else None
    for family, (over, _) in FAMILIES.items():
        if over is None:
            continue
        want = {**MOD, **over}
        if all(model.get(k, default_of(k)) == v for k, v in want.items()) and all(
            model.get(k, default_of(k)) == default_of(k) for k in ("skipped_kv",)
        ):
            return family
    return None


def default_of(field: str) -> Any:
    return MoDConfig.__dataclass_fields__[field].default


def anchors(s: Settings) -> list[dict[str, Any]]:
    """Round 3's rows at this budget (the full round only)."""
    if not s.anchors or not ANCHORS.exists():
        return []
    rows = [json.loads(line) for line in ANCHORS.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["budget"] == s.budget]


def seeds_of(rows: list[dict[str, Any]], arm: Arm) -> dict[int, float]:
    """`arm`'s causal loss per seed over `rows` (the first row of a seed: an anchor before a
    rerun of it)."""
    out: dict[int, float] = {}
    for r in rows:
        if arm_key(r) == arm and r["seed"] not in out:
            out[r["seed"]] = r["val_loss_causal"]
    return out


def paired_mean(a: dict[int, float], b: dict[int, float]) -> float | None:
    """Mean of a - b over the seeds both have (None: none shared)."""
    shared = sorted(set(a) & set(b))
    return statistics.fmean(a[k] - b[k] for k in shared) if shared else None


def spread(*arms: dict[int, float]) -> float:
    """The seed spread of a comparison: the largest range (max - min) of any arm's seeds."""
    return max((max(v.values()) - min(v.values()) for v in arms if len(v) >= 2), default=0.0)


# -- the plan ----------------------------------------------------------------------------------

DENSE_XS = Arm("dense", "XS", 4e-3)  # round 3's best dense: the top of its rates, one size
FIRST: tuple[Arm, ...] = (
    Arm("dense", "XS", 8e-3),  # item 1: the rate above
    Arm("mlp", "S", 3e-3),  # item 2: between round 3's 2e-3 and 4e-3
    Arm(
        "mlp", "S", 4e-3, lr_warmup=0.1
    ),  # item 2: 4e-3 with a warm-up of 10% (round 3's: 50 steps)
    Arm("dense", "S", 4e-3),  # item 1: the sizes either side
    Arm("dense", "XXS", 4e-3),
)
TUNED = FIRST[:3]  # the deciding seeds: the rate arms
MLP_RATES: tuple[Arm, ...] = (
    Arm("mlp", "S", 2e-3), Arm("mlp", "S", 3e-3), Arm("mlp", "S", 4e-3),
    Arm("mlp", "S", 4e-3, lr_warmup=0.1),
)  # fmt: skip
# Round 3's models trained again, seed 0, for the look-back probe and decode timings (their
# checkpoints were not kept between sessions): the deciding arms, and the two that test round
# 3's mechanism (takers reading every key; the dense layers alone). Each is round 3's own run
# (`RunSpec.from_row`), so its loss must come out as round 3's did.
RERUNS: tuple[str, ...] = (
    "r3-1.5e14-dense-lr4e-3-s0", "r3-1.5e14-mlp-s0", "r3-1.5e14-mod-s0", "r3-1.5e14-dense-s0",
    "r3-1.5e14-residual-s0", "r3-1.5e14-bare-s0",
)  # fmt: skip


def rerun_specs(s: Settings) -> list[RunSpec]:
    """`RERUNS` as runs of this round (group "rerun", named "r4-rerun-..."), where the anchors
    hold them."""
    rows = {r["name"]: r for r in anchors(s)}
    return [
        replace(RunSpec.from_row(rows[n]), name="r4-rerun-" + n.removeprefix("r3-"), group="rerun")
        for n in RERUNS if n in rows
    ]  # fmt: skip


def best_arm(rows: list[dict[str, Any]], arms: list[Arm], min_seeds: int = 2) -> Arm | None:
    """Among `arms` with at least `min_seeds` seeds, the lowest mean causal loss over the seeds
    they all share (None: fewer than one such arm, or no seed they all share)."""
    have = {a: seeds_of(rows, a) for a in arms}
    have = {a: v for a, v in have.items() if len(v) >= min_seeds}
    if not have:
        return None
    shared = set.intersection(*(set(v) for v in have.values()))
    if not shared:
        return None
    return min(have, key=lambda a: statistics.fmean(have[a][k] for k in shared))


def beats(rows: list[dict[str, Any]], a: Arm, b: Arm) -> bool:
    """Whether `a`'s mean over the seeds it shares with `b` is lower (two seeds or more)."""
    sa, sb = seeds_of(rows, a), seeds_of(rows, b)
    shared = set(sa) & set(sb)
    return len(shared) >= 2 and statistics.fmean(sa[k] - sb[k] for k in shared) < 0


def dense_rates(rows: list[dict[str, Any]]) -> list[Arm]:
    """Dense XS's rates so far, and the next one up while the top one is still the best:
    8e-3 beating 4e-3 calls for 1.6e-2 (the best rate must be interior)."""
    rates = sorted({a.lr for r in rows if (a := arm_key(r)) and a.family == "dense"
                    and a.size == "XS" and a.lr_warmup is None})  # fmt: skip
    arms = [Arm("dense", "XS", lr) for lr in rates]
    if len(arms) >= 2 and beats(rows, arms[-1], arms[-2]):
        arms.append(Arm("dense", "XS", arms[-1].lr * 2))
    return arms


def dense_sizes(rows: list[dict[str, Any]], lr: float) -> list[Arm]:
    """Dense sizes at `lr`: XXS, XS and S, and the next size out where an end is the best."""
    arms = [Arm("dense", size, lr) for size in ("XXS", "XS", "S")]
    present = [a for a in arms if seeds_of(rows, a)]
    while len(present) >= 2 and present == arms:
        best = best_arm(rows, arms)
        if best is arms[0] and ORDER.index(best.size) > 0:
            arms.insert(0, Arm("dense", ORDER[ORDER.index(best.size) - 1], lr))
        elif best is arms[-1] and ORDER.index(best.size) < len(ORDER) - 1:
            arms.append(Arm("dense", ORDER[ORDER.index(best.size) + 1], lr))
        else:
            break
        present = [a for a in arms if seeds_of(rows, a)]
    return arms


def bracketed_dense(rows: list[dict[str, Any]]) -> Arm:
    """Dense at its best (rate, size) so far: the best XS rate, then the best size at it."""
    rate = best_arm(rows, dense_rates(rows)) or DENSE_XS
    return best_arm(rows, dense_sizes(rows, rate.lr)) or rate


def plan(s: Settings, results: list[dict[str, Any]]) -> list[RunSpec]:
    """Every run the results so far call for, in the order to run them (see README.md):
    the first seeds of `FIRST`, their second, the rate arms' third; then what the results call
    for: dense's next rate up and next size out, MLP-only routing's best rate at XS, the MLP
    in every layer and the takers'-keys variant at MLP-only's best rate, dense's sizes at its
    best rate where that is not 4e-3, a third seed for every MoD arm within the spread of the
    bracketed dense; last, round 3's reruns (seed 0), which an idle worker takes meanwhile."""
    rows = anchors(s) + results
    specs = [spec_of(s, a, seed) for seed in s.seeds for a in FIRST]
    specs += [spec_of(s, a, seed) for a in TUNED for seed in s.deciding_seeds
              if seed not in s.seeds]  # fmt: skip
    dense = dense_rates(rows)
    specs += [spec_of(s, a, seed) for a in dense[2:] for seed in s.seeds]
    specs += [spec_of(s, a, seed) for a in dense_sizes(rows, DENSE_XS.lr) for seed in s.seeds]
    mlp = best_arm(rows, list(MLP_RATES)) if all(
        len(seeds_of(rows, a)) >= min(2, len(s.seeds)) for a in MLP_RATES[1:2] + MLP_RATES[3:]
    ) else None  # fmt: skip
    if mlp is not None:
        for family, size in (("mlp", "XS"), ("mlp-all", "S"), ("mlp-kv", "S")):
            arm = replace(mlp, family=family, size=size)
            if supported(arm):
                specs += [spec_of(s, arm, seed) for seed in s.seeds]
    best = bracketed_dense(rows)
    if best.lr != DENSE_XS.lr:
        specs += [spec_of(s, a, seed) for a in dense_sizes(rows, best.lr) for seed in s.seeds]
    specs += third_seeds(s, rows, best)
    anchored = {(arm_key(r), r["seed"]) for r in anchors(s)}
    specs = [sp for sp in specs if (arm_key(dataclasses.asdict(sp)), sp.seed) not in anchored]
    specs += rerun_specs(s)
    return unique(specs)


def third_seeds(s: Settings, rows: list[dict[str, Any]], dense: Arm) -> list[RunSpec]:
    """The deciding seeds of every MoD arm (of this round's families) whose paired mean against
    the bracketed dense is within the seed spread of it, or better."""
    d = seeds_of(rows, dense)
    arms = {a for r in rows if (a := arm_key(r)) and a.family != "dense"}
    out = []
    for arm in sorted(arms, key=lambda a: a.tag):
        mine = seeds_of(rows, arm)
        diff = paired_mean(mine, d)
        if len(mine) >= 2 and diff is not None and diff <= spread(mine, d):
            out += [spec_of(s, arm, seed) for seed in s.deciding_seeds]
    return out


def unique(specs: list[RunSpec]) -> list[RunSpec]:
    """`specs` without repeats: the first of each name."""
    seen: set[str] = set()
    out = []
    for sp in specs:
        if sp.name not in seen:
            seen.add(sp.name)
            out.append(sp)
    return out
