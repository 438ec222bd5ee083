"""The machinery every study shares: a run's spec, training it to its FLOP budget, and the
resumable loop over a plan's runs.

A `Plan` names its settings (full or quick), its runs, its report and its default `Folders`.
`study(plan)` trains each planned run for exactly as many steps as its budget buys, counted by
`estimate_flops(...).train` (`steps_for_budget`). Every finished run is appended to
``<out>/results.jsonl``; each run trains in its own folder under ``<work>`` with checkpoints, so
an interrupted study resumes where it stopped: finished runs are skipped, an unfinished one
continues from its last checkpoint. The report is rewritten from the results after every run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..config import MoDConfig
from ..data import corpus_files, make_tokenizer, split_files
from ..fileio import json_text
from ..flops import estimate_flops
from ..train import TrainConfig, has_checkpoint, train
from ..train.tune import capacity_at, warmup_steps


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


# The routing these studies ran with (the library's defaults when they ran), pinned so that a
# rerun reproduces them whatever the defaults become.
AUX_ROUTING = dict(causal_router="aux_loss", router_gate="sigmoid", aux_loss_weight=0.1)

# Rows written before the predictor became the default (experiments/round2) may name no causal
# router: those models trained with the aux loss at 0.1, and are rebuilt so.
LEGACY_ROUTING = dict(causal_router="aux_loss", aux_loss_weight=0.1)


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
    lr: float | None = None  # the peak learning rate (None: TrainConfig's)
    # the learning-rate warm-up as a share of the run's steps (None: a tenth, at most 50 steps)
    lr_warmup: float | None = None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> RunSpec:
        """The spec of a result row (rows written before a field existed get its default)."""
        fields = dataclasses.fields(cls)
        return cls(**{f.name: row[f.name] for f in fields if f.name in row})


@dataclass(frozen=True)
class Folders:
    """A study's folders, all inside its own folder `root` (experiments/<study>): its results,
    report and figures in `root` (committed), its runs' checkpoints in ``root/runs`` (ignored
    by git); a ``--quick`` smoke run in ``root/quick`` (ignored too), never over the committed
    results, and never in whatever folder the user stands in."""

    root: str

    def out_for(self, quick: bool) -> str:
        return str(Path(self.root) / "quick") if quick else self.root

    def work_for(self, quick: bool) -> str:
        return str(Path(self.out_for(quick)) / "runs")


def budget_tag(b: float) -> str:
    """A budget as it appears in run names: 1.5e13 -> "1.5e13", 5e12 -> "5e12"."""
    return f"{b:.2g}".replace("+", "")


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


def mean_seeds(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Per label, the mean of `key` over its seeds."""
    by_label: dict[str, list[float]] = {}
    for r in rows:
        by_label.setdefault(r["label"], []).append(r[key])
    return {lab: sum(v) / len(v) for lab, v in by_label.items()}


def seed_gaps(rows: list[dict[str, Any]]) -> dict[str, float]:
    """|seed 0 - seed 1| of the causal loss, per label that has both seeds."""
    by_label: dict[str, dict[int, float]] = {}
    for r in rows:
        by_label.setdefault(r["label"], {})[r["seed"]] = r["val_loss_causal"]
    return {lab: abs(s[0] - s[1]) for lab, s in by_label.items() if 0 in s and 1 in s}


@dataclass(frozen=True)
class Prepared:
    """What a run trains, fixed before it starts: its spec (with the vocabulary counted in),
    model, training run, and the training FLOPs its steps spend."""

    spec: RunSpec
    model: MoDConfig
    train: TrainConfig
    spent: float


def prepare(spec: RunSpec, settings: StudySettings, work: Path, data: str | None) -> Prepared:
    """The model and training run of `spec` in ``<work>/<name>``: as many steps as its budget
    buys, its warm-ups, evaluations and checkpoints (the one place a spec becomes a run, for
    `run_one` and for the command lines a scheduler runs, `scheduler.commands`)."""
    model = dict(spec.model)
    if settings.tokenizer != "byte" and "vocab_size" not in model:
        # The model's vocabulary is the tokenizer's (training sets it): count its FLOPs.
        train_files, _ = split_files(corpus_files(data))
        model["vocab_size"] = make_tokenizer(settings.tokenizer, train_files).vocab_size
        spec = dataclasses.replace(spec, model=model)
    cfg = MoDConfig(**spec.model)
    seq_len = settings.seq_len if spec.seq_len is None else spec.seq_len
    batch_size = settings.batch_size if spec.batch_size is None else spec.batch_size
    steps, warmup, spent = steps_for_budget(
        cfg, seq_len, batch_size, spec.budget, spec.capacity_warmup
    )
    evals = settings.eval_every_runs if spec.evaluations is None else spec.evaluations
    log_every = max(1, min(10, steps))
    tc = TrainConfig(
        out=str(work / spec.name),
        data=data,
        tokenizer=settings.tokenizer,
        batch_size=batch_size,
        seq_len=seq_len,
        steps=steps,
        capacity_warmup=warmup,
        capacity_warmup_ratio=0.0,  # the spec's warm-up, in steps, or none
        warmup_steps=lr_warmup_steps(spec, steps),
        eval_every=max(1, steps // evals),
        # Checkpoints between the (few) evaluations, so a study killed mid-run loses at most a
        # twentieth of that run; at log steps, so that every checkpoint has its line in the log.
        checkpoint_every=max(log_every, steps // 20 // log_every * log_every),
        eval_batches=settings.eval_batches,
        log_every=log_every,
        seed=spec.seed,
        **({} if spec.lr is None else {"lr": spec.lr}),
    )
    return Prepared(spec, cfg, tc, spent)


def run_one(
    spec: RunSpec, settings: StudySettings, work: Path, data: str | None, progress: bool = False
) -> dict:
    """Train `spec` to its budget in ``<work>/<name>`` (resuming from its checkpoint if it has
    one) and return its result row."""
    run = prepare(spec, settings, work, data)
    out = Path(run.train.out)
    resume = has_checkpoint(out)  # .checkpoint.old counts: a kill between a write's renames
    t0 = time.perf_counter()
    summary = train(
        None if resume else run.model, run.train, resume=resume, overwrite=not resume,
        progress=progress,
    )  # fmt: skip
    return result_row(run, summary, time.perf_counter() - t0)


def lr_warmup_steps(spec: RunSpec, steps: int) -> int:
    """The learning-rate warm-up of `spec` in steps: its `lr_warmup` share of `steps`, or by
    default a tenth of them, at most 50 (what every study before round 4 trained with)."""
    if spec.lr_warmup is None:
        return max(1, min(50, steps // 10))
    return max(1, min(steps, round(spec.lr_warmup * steps)))


def result_row(run: Prepared, summary: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """The results.jsonl row of a run that finished training (its `train` summary), which took
    `wall_s` seconds here."""
    spec, cfg, tc, spent = run.spec, run.model, run.train, run.spent
    per_step = estimate_flops(cfg, tc.seq_len, tc.batch_size, with_dense=False)
    acc = summary["routing_accuracy"]
    # The routing as built, not left to defaults that may change (see LEGACY_ROUTING).
    routing = dict(causal_router=cfg.causal_router, aux_loss_weight=cfg.aux_loss_weight)
    row = {
        **dataclasses.asdict(dataclasses.replace(spec, model={**spec.model, **routing})),
        "steps": tc.steps,
        "tokens": summary["tokens"],
        "params": summary["params"],
        "flops_budget_used": spent,
        "flops_per_forward_token": per_step.forward_per_token,
        "val_loss_topk": summary["val_loss_topk"],
        "val_loss_causal": summary["val_loss_causal"],
        "routing_accuracy": acc,
        "routing_accuracy_mean": sum(acc.values()) / len(acc) if acc else None,
        # whether the causal decisions imitate top-k: the paper's accuracy above rewards a
        # router that never fires (docs/semantics.md)
        **{k: summary[k] for k in ("routing_recall", "routing_precision") if k in summary},
        "causal_take_rate": summary["causal_take_rate"],
        "train_time_s": summary["train_time_s"],
        "tokens_per_s": summary["tokens"] / max(summary["train_time_s"], 1e-9),
        "wall_s": wall_s,
    }
    if summary.get("copy_probe"):
        row["copy_probe"] = summary["copy_probe"]
    if cfg.has_experts:
        # The budget charged the bound (every slot a real expert, or the capacity's share);
        # these are what the run actually spent, from the shares it logged in training.
        ran = summary["train_expert_share"]
        shares = [ran.get(str(i), 0.0) for i in range(cfg.n_layers)]
        used = estimate_flops(cfg, tc.seq_len, tc.batch_size, with_dense=False, expert_share=shares)
        row["train_expert_share"] = ran
        row["expert_take_rate"] = summary.get("expert_take_rate", {})
        row["flops_per_forward_token_spent"] = used.forward_per_token
        row["flops_spent"] = tc.steps * used.train
    return row


def steps_for_budget(
    cfg: MoDConfig, seq_len: int, batch_size: int, budget: float, warmup_share: float = 0.0
) -> tuple[int, int, float]:
    """(steps, warm-up steps, training FLOPs spent): the most steps whose training FLOPs fit in
    `budget`, with the capacity warmed up from 1.0 over `warmup_share` of them (each warm-up
    step charged at its own capacity, `tune.capacity_at`)."""
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


def finished_line(row: dict[str, Any], done: int, to_go: int, seconds: float) -> str:
    """A background study's line per finished run: its loss, how far the study is (the runs
    planned so far: later seeds join as results call for them) and how long the run took."""
    took = f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"
    runs = "run" if done == 1 else "runs"
    return (f"{row['name']}: causal loss {row['val_loss_causal']:.4f} ({done} {runs} done, "
            f"{to_go} more planned so far; this one took {took})")  # fmt: skip


def load_results(path: Path) -> list[dict[str, Any]]:
    """The rows of a results (or metrics) file, [] if there is none; a line cut short by a crash
    is skipped, and a row from before the predictor default gets the routing it trained with."""
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


def rewrite_report(study: Any, out: Path, quick: bool = False) -> None:
    """Rewrite `study`'s report, findings and figures from the results in `out` alone, training
    nothing (`mod study FOLDER --report`): a `Plan` or a `rounds.Round` from its results.jsonl,
    a `Loop` by its own `report`."""
    if isinstance(study, Loop):
        if study.report is None:
            raise ValueError(f"study {study.name!r} cannot rewrite its report from its results")
        study.report(out, quick)
        return
    results = load_results(out / "results.jsonl")
    if not results:
        raise ValueError(f"no results in {out / 'results.jsonl'}: nothing to report")
    study.report(results, out, study.settings(quick))


@dataclass(frozen=True)
class Loop:
    """A study with a loop of its own (a conversion pipeline, a GPU lease): `run(out, work,
    quick, data, progress)` runs or resumes it and returns its exit status; `folders` are its
    defaults."""

    name: str
    folders: Folders
    run: Callable[[Path, Path, bool, str | None, bool], int]
    # its report rewritten from the results in `out` (`mod study FOLDER --report`)
    report: Callable[[Path, bool], None] | None = None


@dataclass(frozen=True)
class Plan:
    """A study: its settings (full or quick), its runs, its report, and its default folders (the
    results, committed; the runs' checkpoints, deleted per run)."""

    name: str
    settings: Callable[[bool], StudySettings]  # quick -> settings
    runs: Callable[[StudySettings], list[RunSpec]]
    report: Callable[[list[dict[str, Any]], Path, StudySettings], None]
    folders: Folders
    # the second seeds of a group of the grid once it is done: (results, group, settings) ->
    # runs; a group is what `seed_group` says of a grid run (by default its budget)
    seeds: Callable[[list[dict[str, Any]], Any, StudySettings], list[RunSpec]] = lambda r, b, s: (
        seed_specs(r, b)
    )
    seed_group: Callable[[RunSpec], Any] = lambda spec: spec.budget
    # after the runs, measurements of the trained models (results, out, work, data); their
    # checkpoints are kept for it
    finish: Callable[[list[dict[str, Any]], Path, Path, str | None], None] | None = None


def plan_runs(
    plan: Plan, settings: StudySettings, results: list[dict[str, Any]]
) -> Iterator[RunSpec]:
    """Every run `plan` calls for, in the order `study` trains them, finished ones included:
    its planned runs, and once a seed group of its grid is done (every run in `results`),
    that group's second seeds (`plan.seeds`) next, before the later groups' runs (so a group is
    complete, seeds and all, early; a resumed study's done groups keep their order). `results`
    is read after each run is handed out: `study` appends the row of each run it trains; the
    scheduler's fixed results give the runs called for so far (`scheduler.pending`). A name may
    come twice (a plan's own second seed that `plan.seeds` gives too): it is one run."""
    specs = plan.runs(settings)
    queue = list(specs)
    groups: dict[Any, list[RunSpec]] = {}  # the grid's runs by seed group, in plan order
    for spec in specs:
        if spec.group == "isoflop":
            groups.setdefault(plan.seed_group(spec), []).append(spec)
    seeded: set[Any] = set()
    while queue:
        yield queue.pop(0)
        done = {r["name"] for r in results}
        new: list[RunSpec] = []
        for key, grid in groups.items():  # a group's isoFLOP runs done: its second seeds
            if key not in seeded and all(s.name in done for s in grid):
                seeded.add(key)
                new += plan.seeds(results, key, settings)
        queue[:0] = new


def study(
    plan: Plan,
    out: str | Path | None = None,
    work: str | Path | None = None,
    quick: bool = False,
    data: str | None = None,
    keep_checkpoints: bool = False,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Run (or resume) `plan` (e.g. `isoflop.ISOFLOP`, `mode.PLAN`, `kv.PLAN`); returns all
    results and writes the report and plots. `out` / `work` default to the plan's folders."""
    settings = plan.settings(quick)
    out = Path(plan.folders.out_for(quick) if out is None else out)
    work = Path(plan.folders.work_for(quick) if work is None else work)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.jsonl"
    results = load_results(results_path)
    done = {r["name"] for r in results}
    specs = plan.runs(settings)
    n_total = len(specs) + 2 * len(settings.budgets)
    print(f"{plan.name}: {sum(sp.name not in done for sp in specs)} runs to train, {len(done)} "
          "done; the grid's second seeds come on top", file=sys.stderr)  # fmt: skip
    bar = tqdm(total=n_total, initial=len(done), desc="study", unit="run", disable=not progress)
    for spec in plan_runs(plan, settings, results):
        if spec.name in done:
            continue
        bar.set_postfix_str(spec.name)
        started = time.monotonic()
        row = run_one(spec, settings, work, data, progress)
        with results_path.open("a") as fh:
            fh.write(json_text(row) + "\n")
        results.append(row)
        done.add(spec.name)
        bar.update(1)
        if not progress:  # a log line per run where no bar shows it (a background study)
            to_go = len({sp.name for sp in plan_runs(plan, settings, results)} - done)
            print(finished_line(row, len(done), to_go, time.monotonic() - started), flush=True)
        plan.report(results, out, settings)
        if not keep_checkpoints and plan.finish is None:
            shutil.rmtree(work / spec.name, ignore_errors=True)
    bar.close()
    if plan.finish is not None:
        plan.finish(results, out, work, data)
    plan.report(results, out, settings)
    return results
