"""What the GPU plan trains, and how much: round 3's deciding arms (and, if time allows, the
straight-through gate, the MoD model without its routed blocks and two learning rates) at one
training budget for every run, the largest that both the time left and the corpus allow. Pure
functions of the settings, the timing pass's measurements and the corpus size: no training."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixture_of_depths.config import MoDConfig
from mixture_of_depths.flops import estimate_flops
from mixture_of_depths.studies.runner import Folders, RunSpec, steps_for_budget

from ..round3 import planning as r3

FOLDERS = Folders(str(Path(__file__).resolve().parent))

# A tier: (round 3's arm tag, seeds). Tiers after the first run only if time allows.
Tier = tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class GpuSettings:
    round3: r3.Round3Settings  # sizes, context, batch, evaluations and their windows
    tiers: tuple[Tier, ...]
    ceiling: float | None = None  # at most this budget (the dry run's tiny ones)
    # an extra tier is kept while the budget stays at least this share of what the first tier
    # alone would get (extras may cost the deciding runs at most a fifth of their budget)
    keep_share: float = 0.8
    safety: float = 1.2  # measured step times, times this: the loop's logs, checkpoints, data


FULL = GpuSettings(
    round3=r3.FULL,
    tiers=(
        # MLP-only routing joined the deciding arms when it overtook dense on the CPU (seed 0)
        (("dense", (0, 1, 2)), ("mod", (0, 1, 2)), ("residual", (0, 1, 2)), ("mlp", (0, 1, 2))),
        (("st", (0, 1, 2)), ("bare", (0, 1))),
        # dense's best rate on the CPU (4e-3, three seeds) is the reference at its best
        (("dense-lr4e-3", (0, 1)), ("mod-lr1e-3", (0, 1)), ("mod-lr4e-3", (0, 1))),
    ),
)

DRY = GpuSettings(
    round3=r3.QUICK,
    tiers=((("dense", (0, 1)), ("mod", (0,)), ("residual", (0,))), (("st", (0,)),)),
    ceiling=r3.QUICK.budget,
)


@dataclass(frozen=True)
class Timing:
    """An arm's seconds per training step and per evaluation forward (top-k, no gradient), and
    a process's start (imports, CUDA, the tokens, the model), each the slowest of its processes,
    measured with `concurrency` processes sharing the device at once."""

    step_s: float
    forward_s: float
    startup_s: float
    concurrency: int


@dataclass(frozen=True)
class Choice:
    budget: float
    limit: str  # what set it: "corpus" (one epoch), "time", or "ceiling" (the dry run)
    tiers: int  # how many tiers run
    specs: tuple[RunSpec, ...]
    predicted_s: float  # the slowest run's predicted seconds
    corpus_budget: float  # the one-epoch cap


def arm(tag: str) -> r3.Arm:
    """Round 3's arm of `tag`."""
    for a in r3.ARMS:
        if a.tag == tag:
            return a
    raise ValueError(f"no round-3 arm {tag!r}; the arms are {[a.tag for a in r3.ARMS]}")


def spec_of(s: GpuSettings, tag: str, seed: int, budget: float, vocab: int) -> RunSpec:
    """Round 3's run of arm `tag` at `budget`, named ``gpu-r3-...``, with the vocabulary."""
    rs = dataclasses.replace(s.round3, budget=budget)
    spec = r3.spec_of(rs, arm(tag), seed)
    return dataclasses.replace(
        spec, name="gpu-" + spec.name, model={**spec.model, "vocab_size": vocab}
    )


def specs(s: GpuSettings, budget: float, vocab: int, tiers: int | None = None) -> list[RunSpec]:
    """Every run of the first `tiers` tiers (all: None), tier by tier, arm by arm."""
    return [
        spec_of(s, tag, seed, budget, vocab)
        for tier in s.tiers[:tiers]
        for tag, seeds in tier
        for seed in seeds
    ]


def config_of(spec: RunSpec) -> MoDConfig:
    return MoDConfig(**spec.model)


def step_flops(s: GpuSettings, spec: RunSpec) -> float:
    """Training FLOPs of one step of `spec` at its own capacity (`estimate_flops`, as the CPU
    study counts them)."""
    g = s.round3.grid
    return estimate_flops(config_of(spec), g.seq_len, g.batch_size, with_dense=False).train


def corpus_budget(s: GpuSettings, runs: list[RunSpec], corpus_tokens: int) -> float:
    """The largest budget at which no run reads more tokens than the training split holds (one
    epoch's worth): the cheapest run per token binds. Windows are drawn at random, so a run at
    it reads some text twice and some not at all."""
    g = s.round3.grid
    steps = corpus_tokens // (g.batch_size * g.seq_len)
    if steps < 1:
        raise ValueError(
            f"the corpus's training split has {corpus_tokens} tokens, fewer than one batch of "
            f"{g.batch_size} x {g.seq_len}: give a larger --data"
        )
    return min(steps * step_flops(s, sp) for sp in runs)


def round_down(budget: float) -> float:
    """`budget` rounded down to two significant digits (so that its run names, `budget_tag`,
    name it exactly): 5.47e13 -> 5.4e13."""
    if budget <= 0:
        raise ValueError(f"a budget must be positive, got {budget}")
    unit = 10.0 ** (math.floor(math.log10(budget)) - 1)
    out = math.floor(budget / unit + 1e-9) * unit
    return float(f"{out:.2g}")


def evaluation_forwards(s: GpuSettings, spec: RunSpec) -> int:
    """Forwards a run spends outside its training steps: each evaluation (top-k, and causal for
    a routed model, on every window; the copy probe and the routing probe), the final one, and
    the loss by place at the end."""
    g = s.round3.grid
    modes = 1 if config_of(spec).is_dense else 2
    evals = (spec.evaluations or g.eval_every_runs) + 1
    return evals * (g.eval_batches * modes + 3) + g.eval_batches


def predicted_seconds(s: GpuSettings, spec: RunSpec, t: Timing, steps: int, scale: float) -> float:
    """A run's predicted wall time: its start, its steps and its evaluations, at step times
    scaled by `scale` (the share of the measured concurrency that runs)."""
    work = steps * t.step_s + evaluation_forwards(s, spec) * t.forward_s
    return t.startup_s + s.safety * scale * work


def time_budget(s: GpuSettings, spec: RunSpec, t: Timing, seconds: float, scale: float) -> float:
    """The budget whose steps fit `spec` in `seconds` (0 if not even its evaluations do)."""
    fixed = predicted_seconds(s, spec, t, 0, scale)
    steps = (seconds - fixed) / (s.safety * scale * t.step_s)
    return max(0.0, math.floor(steps) * step_flops(s, spec))


def tier_budget(
    s: GpuSettings, runs: list[RunSpec], timings: dict[str, Timing], seconds: float, cap: float
) -> tuple[float, str]:
    """The budget of `runs` run all at once (the same for every run) and what limits it."""
    scale = share_of_measured(runs, timings)
    by_time = min(time_budget(s, sp, timings[tag_of(sp)], seconds, scale) for sp in runs)
    options = [(cap, "corpus"), (by_time, "time")]
    if s.ceiling is not None:
        options.append((s.ceiling, "ceiling"))
    return min(options)


def share_of_measured(runs: list[RunSpec], timings: dict[str, Timing]) -> float:
    """The step times' scale when fewer processes run than the timing pass measured with: their
    share of it, as if the device's rate were shared among them (the steps are launch-bound and
    time-sliced; an assumption, printed with the plan)."""
    measured = max(t.concurrency for t in timings.values())
    return min(1.0, len(runs) / measured)


def tag_of(spec: RunSpec) -> str:
    """The round-3 arm tag of a run."""
    found = r3.arm_of({"label": spec.label})
    if found is None:
        raise ValueError(f"run {spec.name} has no round-3 arm (label {spec.label!r})")
    return found.tag


def choose(
    s: GpuSettings,
    timings: dict[str, Timing],
    corpus_tokens: int,
    vocab: int,
    seconds: float,
) -> Choice:
    """The runs and their budget: every tier whose arms have a timing, all at once, at the
    largest budget that fits `seconds` and the corpus's one epoch; the last tiers are dropped
    while they would cost the first more than `keep_share` of its budget. Refuses (ValueError)
    where not even the first tier gets two steps per evaluation."""
    usable = 0
    for tier in s.tiers:
        if any(tag not in timings for tag, _ in tier):
            break
        usable += 1
    if usable == 0:
        raise ValueError(f"the timing pass measured none of the deciding arms {s.tiers[0]}")
    cap = corpus_budget(s, specs(s, 1.0, vocab, usable), corpus_tokens)  # budgets change steps
    first, _ = tier_budget(s, specs(s, 1.0, vocab, 1), timings, seconds, cap)
    for n in range(usable, 0, -1):
        budget, limit = tier_budget(s, specs(s, 1.0, vocab, n), timings, seconds, cap)
        if n == 1 or budget >= s.keep_share * first:
            break
    least = 2 * s.round3.evaluations
    if budget <= 0 or budget < least * max(step_flops(s, sp) for sp in specs(s, 1.0, vocab, n)):
        raise ValueError(
            f"{seconds:.0f} s buy only {budget:.2g} training FLOPs a run, under {least} steps "
            "(two per evaluation) for the costliest deciding run; give more --minutes"
        )
    runs = specs(s, round_down(budget), vocab, n)
    scale = share_of_measured(runs, timings)
    slowest = max(
        predicted_seconds(s, sp, timings[tag_of(sp)], steps_of(s, sp), scale) for sp in runs
    )
    return Choice(round_down(budget), limit, n, tuple(runs), slowest, round_down(cap))


def steps_of(s: GpuSettings, spec: RunSpec) -> int:
    """The steps `spec`'s budget buys, with its capacity warm-up charged (`runner`'s rule)."""
    g = s.round3.grid
    model = json.dumps(spec.model, sort_keys=True)
    return _steps(model, g.seq_len, g.batch_size, spec.budget, spec.capacity_warmup)


@functools.lru_cache(maxsize=256)
def _steps(model: str, seq_len: int, batch_size: int, budget: float, warmup: float) -> int:
    # the seeds of an arm share it (a warm-up's steps are priced one by one)
    cfg = MoDConfig(**json.loads(model))
    return steps_for_budget(cfg, seq_len, batch_size, budget, warmup)[0]


def tokens_of(s: GpuSettings, spec: RunSpec) -> int:
    g = s.round3.grid
    return steps_of(s, spec) * g.batch_size * g.seq_len


def describe(s: GpuSettings, c: Choice, corpus_tokens: int) -> list[str]:
    """The plan in words: budget, what limits it, tokens per run against the corpus."""
    why = {"corpus": "one epoch of the corpus's training split (the cheapest run per token)",
           "time": "the time left", "ceiling": "the dry run's ceiling"}[c.limit]  # fmt: skip
    lines = [
        f"budget {c.budget:.2g} training FLOPs a run (set by {why}; the one-epoch cap is "
        f"{c.corpus_budget:.2g}); corpus: {corpus_tokens:,} training tokens (BPE)",
        f"{len(c.specs)} runs at once (tiers 1-{c.tiers} of {len(s.tiers)}); the slowest "
        f"predicted to take {c.predicted_s:.0f} s",
    ]
    seen: dict[str, Any] = {}
    for sp in c.specs:
        seen.setdefault(tag_of(sp), sp)
    for sp in seen.values():
        n = tokens_of(s, sp)
        lines.append(
            f"  {sp.label}: {steps_of(s, sp)} steps, {n:,} tokens "
            f"({n / corpus_tokens:.2f} of the training split)"
        )
    return lines
