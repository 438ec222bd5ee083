"""`mod study`: the isoFLOP study. Does MoD beat dense at equal training compute?

At each training-FLOP budget, dense and MoD models (capacity 12.5%, every other block routed) of
several sizes are each trained for exactly as many steps as the budget buys, counted by
`estimate_flops(...).train`. At the middle budget, ablations of the middle MoD model: capacity,
every block routed, random routing, raw gate, predictor. The two best models of each budget are
trained again with a second seed, to show the seed spread beside the differences.

Every finished run is appended to ``<out>/results.jsonl``; each run trains in its own folder under
``<work>`` with checkpoints, so an interrupted study resumes where it stopped: finished runs are
skipped, an unfinished one continues from its last checkpoint. The report (``report.md``) and plots
are rewritten from ``results.jsonl`` after every run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from .config import MoDConfig
from .fileio import atomic_write_text, json_text
from .flops import estimate_flops
from .train import TrainConfig, has_checkpoint, train


@dataclass(frozen=True)
class StudySettings:
    budgets: tuple[float, ...]
    sizes: tuple[tuple[str, dict[str, Any]], ...]  # (label, MoDConfig overrides)
    seq_len: int
    batch_size: int
    eval_every_runs: int  # evaluations per run (the last one at the end)
    eval_batches: int
    base: dict[str, Any]
    ablation_size: str  # the size label the ablations vary
    # size labels to leave out at a budget: (budget, labels), for sizes far from its optimum
    skip: tuple[tuple[float, tuple[str, ...]], ...] = ()
    tokenizer: str = "byte"  # "bpe": trained once on the training split and cached

    def sizes_at(self, budget: float) -> tuple[tuple[str, dict[str, Any]], ...]:
        left_out = {lab for b, labs in self.skip if b == budget for lab in labs}
        return tuple(sz for sz in self.sizes if sz[0] not in left_out)


# Sizes bracket the compute-optimal size of these budgets (N ~ sqrt(C / 120) is 0.2M-0.6M
# parameters), so each isoFLOP curve can show its minimum. At the largest budget the smallest
# and largest sizes are left out: at 1.6e13 L is already ~40% worse than the best, and each run
# there costs ~12 minutes. 38 runs, 2.6 hours on 2 CPU cores; the ablations use size M.
FULL = StudySettings(
    budgets=(5e12, 1.6e13, 5e13),
    sizes=(
        ("XXS", dict(d_model=48, n_layers=3, n_heads=3)),
        ("XS", dict(d_model=64, n_layers=4, n_heads=4)),
        ("S", dict(d_model=96, n_layers=4, n_heads=4)),
        ("M", dict(d_model=128, n_layers=4, n_heads=4)),
        ("L", dict(d_model=192, n_layers=6, n_heads=6)),
    ),
    seq_len=256,
    batch_size=16,
    eval_every_runs=2,
    eval_batches=8,
    base=dict(max_seq_len=256),
    ablation_size="M",
    skip=((5e13, ("XXS", "L")),),
)

QUICK = StudySettings(
    budgets=(2e9, 6e9, 2e10),
    sizes=(
        ("S", dict(d_model=32, n_layers=2, n_heads=2)),
        ("M", dict(d_model=48, n_layers=2, n_heads=2)),
    ),
    seq_len=32,
    batch_size=4,
    eval_every_runs=1,
    eval_batches=1,
    base=dict(max_seq_len=32, predictor_hidden=16),
    ablation_size="M",
)

# The routing these studies ran with (the library's defaults when they ran), pinned so that a
# rerun reproduces them whatever the defaults become.
AUX_ROUTING = dict(causal_router="aux_loss", router_gate="sigmoid", aux_loss_weight=0.1)
MOD = dict(layer_pattern="DR", capacity=0.125, **AUX_ROUTING)
DENSE = dict(layer_pattern="D")
ABLATIONS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("capacity 25%", dict(capacity=0.25)),
    ("capacity 50%", dict(capacity=0.5)),
    ("every block routed", dict(layer_pattern="R")),
    ("random routing", dict(router_scores="random")),
    ("raw gate", dict(router_gate="raw")),
    ("predictor", dict(causal_router="predictor")),
)


@dataclass(frozen=True)
class RunSpec:
    name: str
    group: str  # "isoflop", "ablation" or "seed"
    label: str
    budget: float
    model: dict[str, Any]
    seed: int = 0
    # the run's own sequence length and batch size (None: the settings')
    seq_len: int | None = None
    batch_size: int | None = None
    evaluations: int | None = None  # evaluations in the run (None: the settings')
    # a capacity warm-up over this share of the run's steps (from 1.0 down to the capacity);
    # its extra FLOPs are charged to the budget
    capacity_warmup: float = 0.0


def _budget_tag(b: float) -> str:
    return f"{b:.2g}".replace("+", "")


def plan(settings: StudySettings) -> list[RunSpec]:
    """The isoFLOP grid and the ablations (second seeds are planned once their budget is done)."""
    specs = []
    for budget in settings.budgets:
        for size, shape in settings.sizes_at(budget):
            for arch, over in (("dense", DENSE), ("MoD", MOD)):
                specs.append(
                    RunSpec(
                        name=f"{_budget_tag(budget)}-{arch}-{size}-s0",
                        group="isoflop",
                        label=f"{arch} {size}",
                        budget=budget,
                        model={**settings.base, **shape, **over},
                    )
                )
    mid = settings.budgets[len(settings.budgets) // 2]
    size, shape = next(sz for sz in settings.sizes if sz[0] == settings.ablation_size)
    for label, over in ABLATIONS:
        tag = label.replace(" ", "-").replace("%", "")
        specs.append(
            RunSpec(
                name=f"{_budget_tag(mid)}-abl-{tag}-{size}-s0",
                group="ablation",
                label=f"MoD {size}, {label}",
                budget=mid,
                model={**settings.base, **shape, **MOD, **over},
            )
        )
    return specs


def second_seed(r: dict[str, Any]) -> RunSpec:
    """The run of result row `r` (a seed-0 run) again, with seed 1."""
    return RunSpec(
        name=r["name"][: -len("-s0")] + "-s1",
        group="seed",
        label=r["label"],
        budget=r["budget"],
        model=r["model"],
        seed=1,
        seq_len=r.get("seq_len"),
        batch_size=r.get("batch_size"),
    )


def seed_specs(results: list[dict[str, Any]], budget: float) -> list[RunSpec]:
    """Second seeds for the two best isoFLOP runs of a budget (by the honest, causal loss)."""
    runs = [r for r in results if r["group"] == "isoflop" and r["budget"] == budget]
    return [second_seed(r) for r in sorted(runs, key=lambda r: r["val_loss_causal"])[:2]]


def run_one(
    spec: RunSpec, settings: StudySettings, work: Path, data: str | None, progress: bool = False
) -> dict:
    model = dict(spec.model)
    if settings.tokenizer != "byte" and "vocab_size" not in model:
        # The model's vocabulary is the tokenizer's (training sets it): count its FLOPs.
        from .data import corpus_files, make_tokenizer, split_files

        train_files, _ = split_files(corpus_files(data))
        model["vocab_size"] = make_tokenizer(settings.tokenizer, train_files).vocab_size
        spec = dataclasses.replace(spec, model=model)
    cfg = MoDConfig(**spec.model)
    seq_len = settings.seq_len if spec.seq_len is None else spec.seq_len
    batch_size = settings.batch_size if spec.batch_size is None else spec.batch_size
    per_step = estimate_flops(cfg, seq_len, batch_size, with_dense=False)
    steps, warmup, spent = steps_for_budget(
        cfg, seq_len, batch_size, spec.budget, spec.capacity_warmup
    )
    evals = settings.eval_every_runs if spec.evaluations is None else spec.evaluations
    out = work / spec.name
    log_every = max(1, min(10, steps))
    tc = TrainConfig(
        out=str(out),
        data=data,
        tokenizer=settings.tokenizer,
        batch_size=batch_size,
        seq_len=seq_len,
        steps=steps,
        capacity_warmup=warmup,
        capacity_warmup_ratio=0.0,  # the spec's warm-up, in steps, or none
        warmup_steps=max(1, min(50, steps // 10)),
        eval_every=max(1, steps // evals),
        # Checkpoints between the (few) evaluations, so a study killed mid-run loses at most a
        # twentieth of that run; at log steps, so that every checkpoint has its line in the log.
        checkpoint_every=max(log_every, steps // 20 // log_every * log_every),
        eval_batches=settings.eval_batches,
        log_every=log_every,
        seed=spec.seed,
    )
    resume = has_checkpoint(out)  # .checkpoint.old counts: a kill between a write's renames
    t0 = time.perf_counter()
    summary = train(
        None if resume else cfg, tc, resume=resume, overwrite=not resume, progress=progress
    )
    acc = summary["routing_accuracy"]
    # The routing as built, not left to defaults that may change (see LEGACY_ROUTING).
    routing = dict(causal_router=cfg.causal_router, aux_loss_weight=cfg.aux_loss_weight)
    row = {
        **dataclasses.asdict(dataclasses.replace(spec, model={**spec.model, **routing})),
        "steps": steps,
        "tokens": summary["tokens"],
        "params": summary["params"],
        "flops_budget_used": spent,
        "flops_per_forward_token": per_step.forward_per_token,
        "val_loss_topk": summary["val_loss_topk"],
        "val_loss_causal": summary["val_loss_causal"],
        "routing_accuracy": acc,
        "routing_accuracy_mean": sum(acc.values()) / len(acc) if acc else None,
        "causal_take_rate": summary["causal_take_rate"],
        "train_time_s": summary["train_time_s"],
        "tokens_per_s": summary["tokens"] / max(summary["train_time_s"], 1e-9),
        "wall_s": time.perf_counter() - t0,
    }
    if cfg.has_experts:
        # The budget charged the bound (every slot a real expert, or the capacity's share);
        # these are what the run actually spent, from the shares it logged in training.
        ran = summary["train_expert_share"]
        shares = [ran.get(str(i), 0.0) for i in range(cfg.n_layers)]
        spent = estimate_flops(cfg, seq_len, batch_size, with_dense=False, expert_share=shares)
        row["train_expert_share"] = ran
        row["expert_take_rate"] = summary.get("expert_take_rate", {})
        row["flops_per_forward_token_spent"] = spent.forward_per_token
        row["flops_spent"] = steps * spent.train
    return row


def steps_for_budget(
    cfg: MoDConfig, seq_len: int, batch_size: int, budget: float, warmup_share: float = 0.0
) -> tuple[int, int, float]:
    """(steps, warm-up steps, training FLOPs spent): the most steps whose training FLOPs fit in
    `budget`, with the capacity warmed up from 1.0 over `warmup_share` of them (each warm-up
    step charged at its own capacity, `tune.capacity_at`)."""
    from .train.tune import capacity_at, warmup_steps

    per_step = estimate_flops(cfg, seq_len, batch_size, with_dense=False).train
    plain = max(1, math.floor(budget / per_step))
    if warmup_share <= 0 or cfg.is_dense:
        return plain, 0, plain * per_step
    cost_at: dict[float, float] = {}

    def cost(steps: int) -> tuple[int, float]:
        w = warmup_steps(warmup_share, steps)
        total = 0.0
        for s in range(min(w, steps)):
            c = capacity_at(s, cfg.capacity, w)
            if c not in cost_at:
                cost_at[c] = estimate_flops(
                    dataclasses.replace(cfg, capacity=c), seq_len, batch_size, with_dense=False
                ).train
            total += cost_at[c]
        return w, total + max(0, steps - w) * per_step

    lo, hi = 1, plain  # warm-up steps cost more: the answer is at most `plain`
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(mid)[1] <= budget:
            lo = mid
        else:
            hi = mid - 1
    w, spent = cost(lo)
    return lo, w, spent


# Rows written before the predictor became the default (docs/study/round2) may name no causal
# router: those models trained with the aux loss at 0.1, and are rebuilt so.
LEGACY_ROUTING = dict(causal_router="aux_loss", aux_loss_weight=0.1)


def load_results(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line cut short by a crash
            continue
        model = row.get("model") if isinstance(row, dict) else None
        if isinstance(model, dict) and "causal_router" not in model:
            row["model"] = {**LEGACY_ROUTING, **model}
        rows.append(row)
    return rows


@dataclass(frozen=True)
class Plan:
    """A study: its settings (full or quick), its runs, its report, and its default folders (the
    results, committed; the runs' checkpoints, deleted per run)."""

    name: str
    settings: Callable[[bool], StudySettings]  # quick -> settings
    runs: Callable[[StudySettings], list[RunSpec]]
    report: Callable[[list[dict[str, Any]], Path, StudySettings], None]
    out: str
    work: str
    # the second seeds of a budget once its grid is done: (results, budget, settings) -> runs
    seeds: Callable[[list[dict[str, Any]], float, StudySettings], list[RunSpec]] = lambda r, b, s: (
        seed_specs(r, b)
    )
    # after the runs, measurements of the trained models (results, out, work, data); their
    # checkpoints are kept for it
    finish: Callable[[list[dict[str, Any]], Path, Path, str | None], None] | None = None


def study(
    out: str | Path | None = None,
    work: str | Path | None = None,
    quick: bool = False,
    data: str | None = None,
    keep_checkpoints: bool = False,
    progress: bool = True,
    plan: Plan | None = None,
) -> list[dict[str, Any]]:
    """Run (or resume) a study, by default `ISOFLOP` (MoD against dense over sizes, with
    ablations; `study_mode.PLAN` is dense, MoD, MoE and MoDE); returns all results and writes the
    report and plots. `out` / `work` default to the plan's folders."""
    plan = ISOFLOP if plan is None else plan
    settings = plan.settings(quick)
    plan_fn, report_fn = plan.runs, plan.report
    out = Path(plan.out if out is None else out)
    work = Path(plan.work if work is None else work)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.jsonl"
    results = load_results(results_path)
    done = {r["name"] for r in results}
    specs = plan_fn(settings)
    n_total = len(specs) + 2 * len(settings.budgets)
    bar = tqdm(total=n_total, initial=len(done), desc="study", unit="run", disable=not progress)
    pending = list(specs)
    seeded: set[float] = set()
    while pending:
        spec = pending.pop(0)
        if spec.name not in done:
            bar.set_postfix_str(spec.name)
            row = run_one(spec, settings, work, data, progress)
            with results_path.open("a") as fh:
                fh.write(json_text(row) + "\n")
            results.append(row)
            done.add(spec.name)
            bar.update(1)
            report_fn(results, out, settings)
            if not keep_checkpoints and plan.finish is None:
                shutil.rmtree(work / spec.name, ignore_errors=True)
        for budget in settings.budgets:  # a budget's isoFLOP runs done: plan its second seeds
            grid = [s for s in specs if s.group == "isoflop" and s.budget == budget]
            if budget not in seeded and all(s.name in done for s in grid):
                seeded.add(budget)
                pending.extend(plan.seeds(results, budget, settings))
    bar.close()
    if plan.finish is not None:
        plan.finish(results, out, work, data)
    report_fn(results, out, settings)
    return results


ISOFLOP = Plan(
    name="isoflop",
    settings=lambda quick: QUICK if quick else FULL,
    runs=lambda settings: plan(settings),
    report=lambda results, out, settings: write_report(results, out, settings),
    out="docs/study",
    work="runs/study",
)


# -- report ---------------------------------------------------------------------------------------
def _fmt_row(r: dict[str, Any]) -> str:
    acc = r.get("routing_accuracy_mean")
    return (
        f"| {r['label']} | {r['seed']} | {r['params'] / 1e6:.2f}M | "
        f"{r['flops_per_forward_token'] / 1e6:.2f}M | {r['steps']} | {r['tokens'] / 1e6:.2f}M | "
        f"{r['val_loss_topk']:.4f} | {r['val_loss_causal']:.4f} | "
        f"{'' if acc is None else f'{acc:.1%}'} | {r['tokens_per_s']:,.0f} |"
    )


_HEADER = (
    "| model | seed | params | FLOPs/fwd token | steps | tokens | val loss top-k | "
    "val loss causal | routing acc. | train tok/s |\n|---|---|---|---|---|---|---|---|---|---|"
)


def write_report(results: list[dict[str, Any]], out: Path, settings: StudySettings) -> None:
    intro = [
        "# isoFLOP study: MoD against dense at equal training compute",
        "",
        f"Default corpus, byte tokenizer, sequences of {settings.seq_len} tokens, batch "
        f"{settings.batch_size}. Each run trains for floor(budget / training FLOPs per step) "
        "steps, FLOPs from `mixture_of_depths.flops.estimate_flops`. Losses are validation "
        "losses in nats per token; MoD runs are judged by the causal loss, the one generation "
        "gets. Generated by `mod study`; plots: `isoflop.png`, `ablations.png`.",
        "",
    ]
    body: list[str] = []
    for budget in sorted({r["budget"] for r in results}):
        rows = [r for r in results if r["budget"] == budget and r["group"] in ("isoflop", "seed")]
        body += [f"## Budget {budget:.1e} FLOPs", "", _HEADER]
        body += [_fmt_row(r) for r in sorted(rows, key=lambda r: (r["label"], r["seed"]))]
        body.append("")
        spread = _seed_spread(rows)
        if spread:
            body += [f"Seed spread (|seed 0 - seed 1| of the causal loss): {spread}", ""]
    ablations = [r for r in results if r["group"] == "ablation"]
    if ablations:
        body += ["## Ablations at the middle budget", "", _HEADER]
        body += [_fmt_row(r) for r in ablations]
        body.append("")
    summary = findings(results)
    atomic_write_text(
        out / "report.md", "\n".join([*intro, *format_findings(summary), "", *body]) + "\n"
    )
    atomic_write_text(out / "findings.json", json_text(summary, indent=1) + "\n")
    try:
        _plots(results, out)
    except Exception as exc:  # plots are a convenience; the results are already saved
        print(f"note: plots failed: {exc!r}")


def _seed_gaps(rows: list[dict[str, Any]]) -> dict[str, float]:
    """|seed 0 - seed 1| of the causal loss, per label that has both seeds."""
    by_label: dict[str, dict[int, float]] = {}
    for r in rows:
        by_label.setdefault(r["label"], {})[r["seed"]] = r["val_loss_causal"]
    return {lab: abs(s[0] - s[1]) for lab, s in by_label.items() if 0 in s and 1 in s}


def _mean_seeds(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Per label, the mean of `key` over its seeds."""
    by_label: dict[str, list[float]] = {}
    for r in rows:
        by_label.setdefault(r["label"], []).append(r[key])
    return {lab: sum(v) / len(v) for lab, v in by_label.items()}


def _describe(r: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "label": r["label"],
        "params": r["params"],
        "flops_per_forward_token": r["flops_per_forward_token"],
        "tokens_per_s": r["tokens_per_s"],
        "seeds": sum(1 for x in rows if x["label"] == r["label"]),
    }


def findings(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The study's answers, computed from the results: per budget the best dense and best MoD
    (MoD judged by its causal loss; seeds averaged where there are two), the gap against the seed
    spread, the cheapest MoD forward that matches the best dense loss; learned against random
    routing; the causal-mode gap; routing accuracy."""
    out: dict[str, Any] = {"budgets": []}
    iso = [r for r in results if r["group"] in ("isoflop", "seed")]
    for budget in sorted({r["budget"] for r in iso}):
        rows = [r for r in iso if r["budget"] == budget]
        dense = [r for r in rows if r["model"].get("layer_pattern") == "D"]
        mod = [r for r in rows if r["model"].get("layer_pattern") != "D"]
        if not dense or not mod:
            continue
        d_loss = _mean_seeds(dense, "val_loss_topk")
        m_loss = _mean_seeds(mod, "val_loss_causal")
        m_topk = _mean_seeds(mod, "val_loss_topk")
        bd, bm = min(d_loss, key=d_loss.get), min(m_loss, key=m_loss.get)
        first = {r["label"]: r for r in rows if r["seed"] == 0}
        gaps = _seed_gaps(rows)
        spread = max(gaps.values()) if gaps else None
        gain = (d_loss[bd] - m_loss[bm]) / d_loss[bd]
        diff = d_loss[bd] - m_loss[bm]
        if spread is None:
            verdict = "no second seed yet"
        elif abs(diff) <= spread:
            verdict = "within the seed spread"
        else:
            verdict = "MoD better" if diff > 0 else "dense better"
        # MoD models at this budget whose causal loss reaches the best dense loss (or comes within
        # the seed spread of it): the cheapest forward among them, against the best dense's.
        tol = spread or 0.0
        match = [lab for lab in m_loss if m_loss[lab] <= d_loss[bd] + tol]
        cheapest = min(match, key=lambda lab: first[lab]["flops_per_forward_token"], default=None)

        out["budgets"].append(
            {
                "budget": budget,
                "best_dense": {**_describe(first[bd], rows), "val_loss": d_loss[bd]},
                "best_mod": {
                    **_describe(first[bm], rows),
                    "val_loss_causal": m_loss[bm],
                    "val_loss_topk": m_topk[bm],
                },
                "mod_gain": gain,
                "seed_spread": spread,
                "verdict": verdict,
                "mod_matching": None
                if cheapest is None
                else {
                    **_describe(first[cheapest], rows),
                    "val_loss_causal": m_loss[cheapest],
                    "flops_ratio_vs_best_dense": first[cheapest]["flops_per_forward_token"]
                    / first[bd]["flops_per_forward_token"],
                },
            }
        )
    mods = [r for r in iso if r["model"].get("layer_pattern") != "D"]
    if mods:
        gaps = [(r["val_loss_causal"] - r["val_loss_topk"]) / r["val_loss_topk"] for r in mods]
        accs = [r["routing_accuracy_mean"] for r in mods if r["routing_accuracy_mean"] is not None]
        out["causal_gap"] = {"mean": sum(gaps) / len(gaps), "min": min(gaps), "max": max(gaps)}
        if accs:
            out["routing_accuracy"] = {
                "mean": sum(accs) / len(accs),
                "min": min(accs),
                "max": max(accs),
            }
    abl = [r for r in results if r["group"] == "ablation"]
    if abl:
        base = [
            r
            for r in iso
            if r["group"] == "isoflop"
            and r["budget"] == abl[0]["budget"]
            and r["model"].get("layer_pattern") != "D"
            and r["model"]["d_model"] == abl[0]["model"]["d_model"]
        ]
        if base:
            b = base[0]
            out["ablations"] = [
                {
                    "label": r["label"].split(", ")[-1],
                    "val_loss_topk": r["val_loss_topk"],
                    "val_loss_causal": r["val_loss_causal"],
                    "vs_baseline_causal": (r["val_loss_causal"] - b["val_loss_causal"])
                    / b["val_loss_causal"],
                    "routing_accuracy_mean": r["routing_accuracy_mean"],
                }
                for r in [b, *abl]
            ]
            out["ablations"][0]["label"] = "baseline (learned, sigmoid gate, aux loss)"
    return out


def format_findings(f: dict[str, Any]) -> list[str]:
    lines = [
        "## Headline",
        "",
        "MoD is judged by its causal-mode loss (what generation gets); losses are the mean over "
        "seeds where a second seed ran. Seed spread: the largest |seed 0 - seed 1| at that budget.",
        "",
        "| budget | best dense | params | FLOPs/fwd tok | tok/s | loss | best MoD | params | "
        "FLOPs/fwd tok | tok/s | loss top-k | loss causal | MoD vs dense | seed spread | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b in f["budgets"]:
        d, m = b["best_dense"], b["best_mod"]
        sp = "-" if b["seed_spread"] is None else f"{b['seed_spread']:.4f}"
        lines.append(
            f"| {b['budget']:.1e} | {d['label']} | {d['params'] / 1e6:.2f}M | "
            f"{d['flops_per_forward_token'] / 1e6:.2f}M | {d['tokens_per_s']:,.0f} | "
            f"{d['val_loss']:.4f} | {m['label']} | {m['params'] / 1e6:.2f}M | "
            f"{m['flops_per_forward_token'] / 1e6:.2f}M | {m['tokens_per_s']:,.0f} | "
            f"{m['val_loss_topk']:.4f} | {m['val_loss_causal']:.4f} | {-100 * b['mod_gain']:+.2f}% "
            f"loss | {sp} | {b['verdict']} |"
        )
    lines += [
        "",
        "MoD matching the best dense loss at the same budget (within the seed spread):",
        "",
    ]
    for b in f["budgets"]:
        mm = b["mod_matching"]
        if mm is None:
            lines.append(f"- {b['budget']:.1e}: no MoD model reaches it.")
        else:
            lines.append(
                f"- {b['budget']:.1e}: {mm['label']} (causal {mm['val_loss_causal']:.4f}) at "
                f"{mm['flops_per_forward_token'] / 1e6:.2f}M FLOPs per forward token, "
                f"{mm['flops_ratio_vs_best_dense']:.2f}x the best dense model's."
            )
    if "causal_gap" in f:
        g = f["causal_gap"]
        lines += [
            "",
            f"Causal-mode loss over top-k loss, MoD runs: mean {100 * g['mean']:+.2f}% "
            f"(range {100 * g['min']:+.2f}% to {100 * g['max']:+.2f}%).",
        ]
    if "routing_accuracy" in f:
        a = f["routing_accuracy"]
        lines.append(
            f"Routing accuracy (causal decision vs top-k, mean over routed layers), MoD runs: "
            f"mean {100 * a['mean']:.1f}% (range {100 * a['min']:.1f}% to {100 * a['max']:.1f}%)."
        )
    if "ablations" in f:
        lines += [
            "",
            "## Ablations (middle budget, size of the ablation runs)",
            "",
            "| variant | loss top-k | loss causal | vs baseline (causal) | routing acc. |",
            "|---|---|---|---|---|",
        ]
        for a in f["ablations"]:
            acc = a["routing_accuracy_mean"]
            lines.append(
                f"| {a['label']} | {a['val_loss_topk']:.4f} | {a['val_loss_causal']:.4f} | "
                f"{100 * a['vs_baseline_causal']:+.2f}% | {'' if acc is None else f'{acc:.1%}'} |"
            )
    return lines


def _seed_spread(rows: list[dict[str, Any]]) -> str:
    return ", ".join(f"{lab} {gap:.4f}" for lab, gap in _seed_gaps(rows).items())


def _plots(results: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    iso = [r for r in results if r["group"] == "isoflop"]
    if iso:
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
        for i, budget in enumerate(sorted({r["budget"] for r in iso})):
            color = f"C{i}"
            for arch, style, key in (
                ("dense", "o-", "val_loss_topk"),
                ("MoD", "s--", "val_loss_causal"),
            ):
                # Seeds averaged per size, as in the headline table.
                runs = [
                    r
                    for r in results
                    if r["group"] in ("isoflop", "seed")
                    and r["budget"] == budget
                    and r["label"].startswith(arch)
                ]
                loss = _mean_seeds(runs, key)
                params = {r["label"]: r["params"] for r in runs}
                labels = sorted(loss, key=params.get)
                if labels:
                    ax.plot(
                        [params[lab] for lab in labels],
                        [loss[lab] for lab in labels],
                        style,
                        color=color,
                        label=f"{arch} @ {budget:.2g} FLOPs",
                    )
        ax.set_xscale("log")
        ax.set_xlabel("parameters")
        ax.set_ylabel("validation loss (MoD: causal; seeds averaged)")
        ax.set_title("isoFLOP curves: loss against size at fixed training FLOPs")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "isoflop.png")
        plt.close(fig)
    abl = [r for r in results if r["group"] == "ablation"]
    if abl:
        mid = abl[0]["budget"]
        ref = [r for r in iso if r["budget"] == mid and r["label"].startswith("MoD")]
        base = [r for r in ref if r["model"]["d_model"] == abl[0]["model"]["d_model"]]
        if not base:  # no baseline run of the ablations' size yet: nothing to compare with
            return
        rows = base + abl
        fig, ax = plt.subplots(figsize=(8, 4), dpi=120)
        names = [r["label"].split(", ")[-1] if ", " in r["label"] else "baseline" for r in rows]
        x = list(range(len(rows)))
        # Change of each loss against the baseline's causal loss, in %; bars beyond the axis
        # (an ablation that breaks the model) are cut and labelled with their value.
        ref_loss = rows[0]["val_loss_causal"]
        lim = 6.0
        for off, key, lab in ((-0.2, "val_loss_topk", "top-k"), (0.2, "val_loss_causal", "causal")):
            pct = [100 * (r[key] - ref_loss) / ref_loss for r in rows]
            ax.bar([i + off for i in x], [max(-lim, min(lim, p)) for p in pct], 0.4, label=lab)
            for i, p in enumerate(pct):
                if abs(p) > lim:
                    ax.annotate(
                        f"{p:+.0f}%",
                        (i + off, lim if p > 0 else -lim),
                        ha="center",
                        va="bottom" if p > 0 else "top",
                        fontsize=7,
                    )
        ax.axhline(0, color="black", lw=0.6)
        gaps = _seed_gaps([r for r in results if r["budget"] == mid and r["group"] != "ablation"])
        if gaps:  # differences inside this band are within the seed noise of this budget
            band = 100 * max(gaps.values()) / ref_loss
            ax.axhspan(-band, band, color="grey", alpha=0.15, label="seed spread")
        ax.set_ylim(-lim * 1.15, lim * 1.15)
        ax.set_xticks(x, names, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("loss vs baseline causal loss (%)")
        ax.legend()
        ax.set_title(f"ablations at {mid:.2g} FLOPs")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "ablations.png")
        plt.close(fig)


def plot_vs_dense(
    groups: list[tuple[str, dict[str, float], float | None]],
    labels: list[str],
    path: Path,
    title: str,
    ylabel: str = "validation loss vs dense (%), lower is better",
    rotate: bool = False,
) -> None:
    """Bars of each label's loss against the group's dense one (%), one colour per group
    (legend, losses by label, seed spread for whiskers or None)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=120)
    width = 0.8 / max(1, len(groups))
    for i, (legend, loss, spread) in enumerate(groups):
        ref = loss["dense"]
        xs = [j + (i - (len(groups) - 1) / 2) * width for j in range(len(labels))]
        pct = [100 * (loss.get(lab, float("nan")) - ref) / ref for lab in labels]
        ax.bar(xs, pct, width, label=legend, color=f"C{i}")
        if spread is not None:
            band = 100 * spread / ref
            ax.errorbar(xs, pct, yerr=band, fmt="none", ecolor="black", lw=0.8, capsize=2)
    ax.axhline(0, color="black", lw=0.6)
    tick = dict(rotation=20, ha="right") if rotate else {}
    ax.set_xticks(range(len(labels)), labels, fontsize=8, **tick)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
