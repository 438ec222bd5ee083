"""`mod study --plan round2`: the isoFLOP study again, with fair baselines, on BPE tokens.

Phase 1, the routing ablations (one size, one budget, 256 tokens of context, two seeds each):
learned routing with the aux loss at weights 0.01, 0.1 (round 1's default) and 1.0, the
predictor, each causal router with the straight-through gate (1 forward, sigmoid's gradient) in
place of the sigmoid, the aux-loss router with no gradient from the LM loss, random routing
compute-matched in causal mode (each token takes a block with probability = the capacity) and
random routing at the aux-loss model's own measured
per-router take-rates, the dense model of that size, and the winning learned router with a
capacity warm-up over the first 10% of steps (its extra FLOPs charged to the budget); then the
winner (with the warm-up where it helped), random routing and dense trained 3.3x longer, and the
MoD model without its routed blocks (its unrouted layers alone, dense) at both budgets: does the
routed compute do anything at this size? Every run
logs the routing diagnostics at ten evaluations (`routing_diag` in its metrics, copied to
``<out>/metrics/``), and its checkpoint is profiled with `inspect.analyse` before it is deleted:
blocks taken per token, the share of takes that go to newline tokens, and Spearman's rho of
blocks taken against the predictive entropy.

Phase 2, the isoFLOP grid: dense against MoD with the winning causal router (lowest mean causal
loss over the two seeds among the learned variants), BPE tokens (vocabulary 4096, trained once
and cached), at 256 and 1024 tokens of context with 4096 tokens per step, three budgets up to
1.5e14 training FLOPs, three sizes at each (and the next size out wherever an architecture's best
lands on an edge, so each curve shows its minimum); the best two sizes of each architecture at
each budget train again with a second seed. Each run's checkpoint is profiled before it is
deleted: its held-out loss by place in the context (`position_profile`), which tells what a
model learns from its context apart from the rest (runs finished before this profile existed
have none). About 20 hours on 2 CPU cores (~90 GFLOP/s),
so it runs over several sessions: rerun to resume.

Runs, resumption and FLOP accounting are `study.py`'s: an interrupted study resumes where it
stopped. The report is rewritten after every run; `notes.md` in the output folder, if present
(the diagnosis in words), is included in it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from .config import MoDConfig
from .fileio import atomic_write_text, json_text
from .runtime.runlock import RunLock, RunLockedError
from .study import (
    AUX_ROUTING,
    RunSpec,
    StudySettings,
    _budget_tag,
    _mean_seeds,
    findings,
    format_findings,
    load_results,
    run_one,
)

OUT = "docs/study/round2"
WORK = "runs/study-round2"


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


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def winner(results: list[dict[str, Any]]) -> tuple[str, str, dict[str, Any]] | None:
    """The learned causal router with the lowest causal loss averaged over its seeds, once every
    learned variant has all its seeds (None before)."""
    best = None
    for label, tag, over in LEARNED:
        rows = [r for r in results if r["name"] in {f"abl-{tag}-s{sd}" for sd in SEEDS}]
        if len(rows) < len(SEEDS):
            return None
        loss = _mean(rows, "val_loss_causal")
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
    if _mean(warm, "val_loss_causal") < _mean(plain, "val_loss_causal"):
        return f"{label}, capacity warm-up {WARMUP:.0%}", f"{tag}-warm", over, WARMUP
    return label, tag, over, 0.0


def plan(s: Round2Settings, results: list[dict[str, Any]]) -> list[RunSpec]:
    """Every run the results so far call for, in the order to run them (those already done
    included): the ablations; then, once the learned routers are all in, the winner's warm-up
    ablation; then the longer runs and the grid with `mod_arm` as the MoD arm; second seeds of
    a grid budget once its first seeds are done."""
    by_name = {r["name"]: r for r in results}
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
    label, tag, over, warmup = arm
    # does learned routing pull away from random with more training? (3.3x the steps)
    for seed in SEEDS:
        for lab, t, o, w in ((label, tag, over, warmup), ("random, take-rate = capacity", "rand",
                             {"router_scores": "random"}, 0.0)):  # fmt: skip
            spec = _ablation(s, lab, t, {**MOD, **o}, seed, capacity_warmup=w)
            specs.append(dataclasses.replace(spec, name=f"long-{t}-s{seed}", group="longer",
                                             budget=s.long_budget))  # fmt: skip
        spec = _ablation(s, "dense", "dense", DENSE, seed)
        specs.append(dataclasses.replace(spec, name=f"long-dense-s{seed}", group="longer",
                                         budget=s.long_budget))  # fmt: skip
    # Does the routed compute do anything at this size? The MoD model less its routed blocks:
    # its unrouted layers alone, a dense model, at both budgets.
    g = s.grid
    layers = dict(g.sizes)[g.ablation_size]["n_layers"] // 2
    bare = {**DENSE, "n_layers": layers}
    bare_label = f"dense, {layers} layers (the MoD model without its routed blocks)"
    for seed in SEEDS:
        specs.append(_ablation(s, bare_label, "bare", bare, seed))
        spec = _ablation(s, bare_label, "bare", bare, seed)
        specs.append(dataclasses.replace(spec, name=f"long-bare-s{seed}", group="longer",
                                         budget=s.long_budget))  # fmt: skip
    # Budget by budget, both contexts at each: a study cut short still compares the contexts.
    for budget in g.budgets:
        for seq_len, batch in s.contexts:
            sizes = [size for size, _ in g.sizes_at(budget)]
            while True:
                grid = [
                    RunSpec(
                        name=f"ctx{seq_len}-{_budget_tag(budget)}-{arch}-{size}-s0",
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
                more = _bracket(rows, sizes, [n for n, _ in g.sizes])
                if not more:
                    break
                sizes = sorted({*sizes, *more}, key=[n for n, _ in g.sizes].index)
            specs += grid
            if all(sp.name in by_name for sp in grid):
                specs += _second_seeds([by_name[sp.name] for sp in grid])
    return specs


def _bracket(rows: list[dict[str, Any]], tried: list[str], sizes: list[str]) -> set[str]:
    """The sizes to add so that each architecture's best size (by the mean over the seeds in
    `rows`; MoD by its causal loss, as `findings` judges) has a tried size on both sides: the
    next size out where the best is the smallest or the largest tried, if `sizes` (smallest
    first) holds one."""
    more = set()
    for arch in ("dense", "MoD"):
        mine = _mean_seeds(
            [r for r in rows if r["label"].startswith(arch + " ")], "val_loss_causal"
        )
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
            spec = RunSpec(**{f.name: r[f.name] for f in dataclasses.fields(RunSpec)})
            out.append(dataclasses.replace(spec, name=r["name"][:-3] + "-s1", group="seed", seed=1))
    return out


# -- running ---------------------------------------------------------------------------------------
def run(
    out: str | Path | None = None,
    work: str | Path | None = None,
    quick: bool = False,
    data: str | None = None,
    progress: bool = True,
    max_runs: int | None = None,
    worker: int | None = None,
    poll_s: float = 10.0,
) -> list[dict[str, Any]]:
    """Run (or resume) the second round; returns all results and rewrites the report after each
    run. `max_runs` stops after that many new runs (a slice of the study, resumable).

    Several processes may run it at once on the same `out` and `work` (`mod study --workers`):
    each claims the next run nobody holds (a lock per training run under ``<work>/.claims``,
    so twins (`_twin`) never train twice either; the kernel drops it if its process dies),
    appends its row under a lock, and waits while every run the results call for so far is
    another worker's (their rows may call for more). A worker may finish a second seed that a
    seed landing meanwhile took out of the plan (`_bracket` reads second seeds): its row is
    kept, one more seed. `max_runs` counts this process's runs; `worker` names this process
    in the one line it prints per finished run."""
    s = QUICK if quick else FULL
    out = Path(out if out is not None else OUT + ("-quick" if quick else ""))
    work = Path(work if work is not None else WORK + ("-quick" if quick else ""))
    (out / "metrics").mkdir(parents=True, exist_ok=True)
    results_path = out / "results.jsonl"
    claims = work / ".claims"
    results = load_results(results_path)
    bar = tqdm(desc="round 2", unit="run", initial=len(results), disable=not progress)
    new = 0

    def record(row: dict[str, Any]) -> None:
        with _waiting_lock(claims, "results"):  # one writer of the file and the report
            with results_path.open("a+b") as fh:  # appends go to the end, wherever we read
                if fh.seek(0, 2) > 0:
                    fh.seek(-1, 2)
                    if fh.read(1) != b"\n":
                        fh.write(b"\n")  # end a line cut short by a kill: our row stays whole
                fh.write((json_text(row) + "\n").encode())
            results[:] = load_results(results_path)
            write_report(results, out, s)
        bar.update(1)
        if worker is not None:
            print(f"[worker {worker}] {row['name']}: causal loss {row['val_loss_causal']:.4f}",
                  flush=True)  # fmt: skip

    while max_runs is None or new < max_runs:
        results[:] = load_results(results_path)  # with the other workers' rows
        done = {r["name"] for r in results}
        pending = [sp for sp in plan(s, results) if sp.name not in done]
        if not pending:
            break
        claim, spec = None, None
        for spec in pending:
            claim = _claim(claims, _training_key(spec))
            if claim is not None:
                break
        if claim is None:  # all of them another worker's
            time.sleep(poll_s)
            continue
        try:  # released however the run ends; the kernel drops it if the process dies
            results[:] = load_results(results_path)
            if spec.name in {r["name"] for r in results}:
                continue  # finished by another worker between our reading and our claim
            bar.total = len(done) + len(pending)
            bar.set_postfix_str(spec.name)
            row, folder = _result_of(spec, s, results, out, work, data, progress)
            record(row)
            if folder is not None:  # trained here, not reused
                new += 1
                shutil.rmtree(folder, ignore_errors=True)
        finally:
            claim.release()
    bar.close()
    with _waiting_lock(claims, "results"):
        results[:] = load_results(results_path)
        write_report(results, out, s)
    try:
        claims.rmdir()  # empty once no worker holds anything
    except OSError:
        pass
    return results


def _result_of(
    spec: RunSpec,
    s: Round2Settings,
    results: list[dict[str, Any]],
    out: Path,
    work: Path,
    data: str | None,
    progress: bool,
) -> tuple[dict[str, Any], Path | None]:
    """`spec`'s result row, with its metrics copied to ``<out>/metrics``, and the run folder it
    trained in (None where a finished twin's row is reused instead)."""
    twin = _twin(spec, results)
    if twin is not None:  # the same run, already done under another name: reuse it
        row = {**twin, "name": spec.name, "group": spec.group, "label": spec.label,
               "evaluations": spec.evaluations, "same_run_as": twin["name"]}  # fmt: skip
        row.pop("profile", None)
        shutil.copyfile(out / "metrics" / f"{twin['name']}.jsonl",
                        out / "metrics" / f"{spec.name}.jsonl")  # fmt: skip
        return row, None
    row = run_one(spec, s.grid, work, data, progress)
    folder = work / spec.name
    shutil.copyfile(folder / "metrics.jsonl", out / "metrics" / f"{spec.name}.jsonl")
    if spec.group == "ablation" and spec.model.get("layer_pattern", "D") != "D":
        row["profile"] = routing_profile(folder / "checkpoint", data, s.profile_rows)
    # every trained run, so that a grid row reusing it (`_twin`) has one too
    batch = s.grid.batch_size if spec.batch_size is None else spec.batch_size
    seq_len = s.grid.seq_len if spec.seq_len is None else spec.seq_len
    row["loss_by_position"] = position_profile(
        folder / "checkpoint", data, batch, seq_len, s.grid.eval_batches
    )
    return row, folder


def _training_key(spec: RunSpec) -> str:
    """What `spec` trains, as a lock name: runs that are each other's `_twin` share it."""
    if spec.model.get("router_scores") == "random":  # never reused: see `_twin`
        return spec.name
    what = {k: getattr(spec, k) for k in ("budget", "seed", "seq_len", "batch_size",
                                          "capacity_warmup")}  # fmt: skip
    what["model"] = dataclasses.asdict(MoDConfig(**spec.model))
    text = json.dumps(what, sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"train-{digest}"


def _claim(folder: Path, name: str) -> RunLock | None:
    """This process's hold on `name`, or None where a live process holds it. A lock that
    cannot be checked (a process on another machine) is an error, not a wait."""
    while True:
        try:
            return RunLock(folder, f"{name}.lock").acquire()
        except RunLockedError as exc:
            if not exc.held:
                raise
            return None
        except FileNotFoundError:  # a finishing worker removed the empty folder under us
            continue


@contextlib.contextmanager
def _waiting_lock(folder: Path, name: str) -> Iterator[None]:
    """Hold the lock `folder/name`, waiting for it while another process does."""
    lock = _claim(folder, name)
    while lock is None:
        time.sleep(0.05)
        lock = _claim(folder, name)
    try:
        yield
    finally:
        lock.release()


def _twin(spec: RunSpec, results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A finished run that trained exactly what `spec` would: the same model, budget, seed,
    context, batch and warm-up (the grid's size-S runs at the ablation and longer budgets are
    the ablations' dense and MoD-arm runs again). Evaluations do not change training, except
    where random routing draws its noise at evaluation too, so those are never reused."""
    if spec.model.get("router_scores") == "random":
        return None
    keys = ("budget", "seed", "seq_len", "batch_size", "capacity_warmup")
    for r in results:
        if any(r.get(k) != getattr(spec, k) for k in keys):
            continue
        vocab = r["model"].get("vocab_size")
        if MoDConfig(**{**spec.model, "vocab_size": vocab}) == MoDConfig(**r["model"]):
            return r
    return None


def routing_profile(ckpt: Path, data: str | None, rows: int) -> dict[str, Any]:
    """Where a trained model's compute goes on held-out text (`inspect.analyse`): the histogram
    of routed blocks taken per token against independent coins, the share of each router's takes
    that went to tokens containing a newline (and their share of the text), and Spearman's rho
    of blocks taken against the predictive entropy."""
    import torch

    from .data import eval_batches, load_splits, load_tokenizer
    from .inspect import analyse
    from .runtime.checkpoint import load_model

    model, cfg = load_model(ckpt)
    tokenizer = load_tokenizer(ckpt)
    val = load_splits(data, tokenizer)[1]
    tokens = eval_batches(val, rows, cfg.max_seq_len, 1)[0][0]
    rep = analyse(model, tokens, bootstrap=200)
    newline = torch.tensor(["\n" in tokenizer.decode([int(t)]) for t in rep.tokens.tolist()])
    takes = rep.taken.double()
    T = tokens.shape[1]
    k = cfg.capacity_tokens(T)
    early = (torch.arange(len(rep.tokens)) % T < k).double()  # the first k places of each row
    per_token = takes.sum(1)
    ids, inverse = torch.unique(rep.tokens, return_inverse=True)
    by_id = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inverse, per_token)
    top = by_id.argsort(descending=True)[:8]
    return {
        # a router that takes the first k places of each row is trivially causal (1: all of
        # its takes there; k/T, 12.5%, if position does not matter)
        "takes_in_first_k_places": {
            nm: float((takes[:, j] * early).sum() / takes[:, j].sum().clamp_min(1))
            for j, nm in enumerate(rep.router_names)
        },
        "top_taken_tokens": [
            [tokenizer.decode([int(ids[i])]), float(by_id[i] / per_token.sum().clamp_min(1))]
            for i in top.tolist()
            if by_id[i] > 0
        ],
        "tokens": len(rep.tokens),
        "depth_hist": rep.depth_hist.tolist(),
        "independent_hist": rep.independent_hist.tolist(),
        "newline_share_of_text": float(newline.double().mean()),
        "newline_share_of_takes": {
            nm: float(takes[newline, j].sum() / takes[:, j].sum().clamp_min(1))
            for j, nm in enumerate(rep.router_names)
        },
        "rho_depth_entropy": rep.correlations["depth_vs_entropy"],
    }


def position_buckets(seq_len: int) -> list[int]:
    """Edges of the context's places: [0, T/64, T/16, T/4, T] (the first places, whose tokens see
    almost no context, up to the last three quarters), without empty buckets."""
    inner = {seq_len // d for d in (64, 16, 4)} - {0, seq_len}
    return [0, *sorted(inner), seq_len]


def position_profile(
    ckpt: Path, data: str | None, batch_size: int, seq_len: int, n_batches: int
) -> dict[str, Any]:
    """A trained model's held-out loss (causal routing) by place in the context, on the batches
    training validated on: the mean over the places in each of `position_buckets`. Loss that
    falls with the place is what the model learns from its context (repeats, copying). On the
    CPU in float32, as the study trains, the place-weighted mean of the buckets is the run's
    causal validation loss (the trainer autocasts on a GPU; this runs in float32 on the CPU),
    except under random routing, which draws its decisions anew."""
    import torch
    import torch.nn.functional as F

    from .data import eval_batches, load_splits, load_tokenizer
    from .runtime.checkpoint import load_model

    model, _ = load_model(ckpt)
    model.eval()
    val = load_splits(data, load_tokenizer(ckpt))[1]
    sums = torch.zeros(seq_len, dtype=torch.float64)
    rows = 0
    with torch.no_grad():
        for x, y in eval_batches(val, batch_size, seq_len, n_batches):
            logits = model(x, routing="causal").logits.float()
            nll = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
            sums += nll.view_as(y).double().sum(0)
            rows += len(x)
    per_place = sums / rows
    edges = position_buckets(seq_len)
    return {
        "edges": edges,
        "loss": [float(per_place[a:b].mean()) for a, b in zip(edges, edges[1:], strict=False)],
    }


def position_table(rows: list[dict[str, Any]]) -> list[str]:
    """Per budget of one context's grid, the best dense and the best MoD size's held-out loss by
    place in the context (means over their seeds with a profile; runs from before the profile
    was recorded have none). [] where no budget has both."""
    body: list[str] = []
    edges = None
    for b in findings(rows)["budgets"]:
        cells = []
        for best in (b["best_dense"], b["best_mod"]):
            prof = [
                r["loss_by_position"]
                for r in rows
                if r["budget"] == b["budget"] and r["label"] == best["label"]
                and "loss_by_position" in r
            ]  # fmt: skip
            if not prof:
                break
            edges = prof[0]["edges"]
            means = [sum(v) / len(prof) for v in zip(*(p["loss"] for p in prof), strict=True)]
            cells.append((means, len(prof)))
        if len(cells) < 2:
            continue
        (d, nd), (m, nm) = cells
        body += [
            f"| {b['budget']:.1e} | {a}-{z - 1} | {b['best_dense']['label']} ({nd}): {dv:.3f} | "
            f"{b['best_mod']['label']} ({nm}): {mv:.3f} | {100 * (mv - dv) / dv:+.1f}% |"
            for a, z, dv, mv in zip(edges, edges[1:], d, m, strict=False)
        ]
    if not body:
        return []
    return [
        "Held-out loss by place in the context, the best dense against the best MoD (causal "
        "routing; in parentheses the seeds averaged). Loss that falls with the place is what a "
        "model learns from its context:",
        "",
        "| budget | places | best dense | best MoD | MoD vs dense |",
        "|---|---|---|---|---|",
        *body,
    ]


# -- report ----------------------------------------------------------------------------------------
def _ablation_rows(
    results: list[dict[str, Any]], group: str = "ablation"
) -> list[tuple[str, list[dict[str, Any]]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        if r["group"] == group:
            groups.setdefault(r["label"], []).append(r)
    return list(groups.items())


def _take_rate(r: dict[str, Any]) -> float | None:
    rates = r.get("causal_take_rate") or {}
    return sum(rates.values()) / len(rates) if rates else None


def ablation_table(results: list[dict[str, Any]], group: str = "ablation") -> list[str]:
    groups = _ablation_rows(results, group)
    if not groups:
        return []
    ref = dict(groups).get(LEARNED[0][0] if group == "ablation" else "dense")
    ref_loss = _mean(ref, "val_loss_causal") if ref else None
    vs_what = "aux 0.1" if group == "ablation" else "dense"
    lines = [
        f"| variant | seeds | loss top-k | loss causal | seed spread | vs {vs_what} (causal) | "
        "causal take-rate | routing acc. | tokens taking no block | newline share of takes "
        "(their share of the text) | Spearman's rho, blocks taken vs entropy |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, rows in groups:
        causal = _mean(rows, "val_loss_causal")
        spread = max(r["val_loss_causal"] for r in rows) - min(r["val_loss_causal"] for r in rows)
        vs = "" if ref_loss is None else f"{100 * (causal - ref_loss) / ref_loss:+.2f}%"
        take = [t for t in map(_take_rate, rows) if t is not None]
        acc = [
            r["routing_accuracy_mean"] for r in rows if r.get("routing_accuracy_mean") is not None
        ]
        prof = [r["profile"] for r in rows if "profile" in r]
        none = nl = rho = ""
        if prof:  # each seed's, "seed 0 / seed 1"
            none = " / ".join(f"{p['depth_hist'][0] / p['tokens']:.1%}" for p in prof)
            nl = (
                " / ".join(
                    f"{sum(v) / len(v):.1%}"
                    for v in (list(p["newline_share_of_takes"].values()) for p in prof)
                )
                + f" ({prof[0]['newline_share_of_text']:.1%})"
            )
            rhos = (p["rho_depth_entropy"]["rho"] for p in prof)  # None (NaN): all took alike
            rho = " / ".join("n/a" if v is None or v != v else f"{v:+.3f}" for v in rhos)
        spread_text = f"{spread:.4f}" if len(rows) > 1 else "-"
        lines.append(
            f"| {label} | {len(rows)} | {_mean(rows, 'val_loss_topk'):.4f} | {causal:.4f} | "
            f"{spread_text} | {vs} | {f'{sum(take) / len(take):.1%}' if take else ''} | "
            f"{f'{sum(acc) / len(acc):.1%}' if acc else ''} | {none} | {nl} | {rho} |"
        )
    return lines


def top_tokens(results: list[dict[str, Any]]) -> list[str]:
    """Per routed ablation (its first seed profiled with them), the tokens its blocks take most,
    with their share of all takes, and where in the row the takes fall."""
    lines = []
    for label, rows in _ablation_rows(results):
        prof = next(
            (r["profile"] for r in rows if "top_taken_tokens" in r.get("profile", {})), None
        )
        if prof:
            top = ", ".join(f"{tok!r} {share:.0%}" for tok, share in prof["top_taken_tokens"][:6])
            early = prof.get("takes_in_first_k_places")
            where = ""
            if early:
                shares = "/".join(f"{v:.0%}" for v in early.values())
                where = (
                    f"; takes in each row's first k places: {shares} (12.5% if position is no cue)"
                )
            lines.append(f"- {label}: {top}{where}")
    if lines:
        lines = [
            "The tokens each variant's routed blocks take most (share of all takes):",
            "",
            *lines,
            "",
        ]
    return lines


def _diag_series(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Per diagnostic, (step, mean over routers) at each evaluation; and the training aux loss."""
    series: dict[str, list[tuple[int, float]]] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if "routing_diag" in rec:
            diag = rec["routing_diag"]
            for key in next(iter(diag.values())):
                vals = [v[key] for v in diag.values() if v[key] is not None]
                if vals:
                    series.setdefault(key, []).append((rec["step"], sum(vals) / len(vals)))
        if "aux_loss" in rec and "loss" in rec:
            series.setdefault("aux_loss", []).append((rec["step"], rec["aux_loss"]))
    return series


DIAG_PANELS = (
    ("r_std", "router weight r: std over tokens"),
    ("topk_boundary", "top-k boundary: k-th largest r"),
    ("gate_chosen_mean", "gate g(r) of the chosen tokens"),
    ("topk_flips", "top-k decisions changed since last eval"),
    ("causal_take_rate", "causal take-rate"),
    ("aux_loss", "aux loss (BCE, training)"),
)


def plot_diagnosis(results: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in results if r["group"] == "ablation" and r["seed"] == 0]
    runs = [r for r in runs if r["model"].get("layer_pattern") != "D"]
    if not runs:
        return
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5), dpi=100)
    for i, r in enumerate(runs):
        path = out / "metrics" / f"{r['name']}.jsonl"
        if not path.exists():
            continue
        series = _diag_series(path)
        for ax, (key, title) in zip(axes.flat, DIAG_PANELS, strict=True):
            pts = series.get(key, [])
            if key == "aux_loss" and len(pts) > 20:  # smooth the noisy per-step loss
                w = max(1, len(pts) // 20)
                pts = [(pts[j][0], sum(v for _, v in pts[j : j + w]) / w) for j in
                       range(0, len(pts) - w + 1, w)]  # fmt: skip
            if pts:
                style = "--" if "random" in r["label"] else "-"
                ax.plot(*zip(*pts, strict=True), style, color=f"C{i % 10}", label=r["label"])
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("routing during training (seed 0, mean over routers)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "diagnosis.png")
    plt.close(fig)


def plot_grid(results: list[dict[str, Any]], out: Path, contexts: tuple[tuple[int, int], ...]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    fig, axes = plt.subplots(
        1, len(contexts), figsize=(6 * len(contexts), 5.2), dpi=110, squeeze=False
    )
    for ax, (seq_len, _) in zip(axes[0], contexts, strict=True):
        rows = [r for r in results if r["group"] in ("isoflop", "seed") and r["seq_len"] == seq_len]
        for j, budget in enumerate(sorted({r["budget"] for r in rows})):
            for arch, style in (("dense", "s--"), ("MoD", "o-")):
                pts: dict[float, list[float]] = {}
                for r in rows:
                    if r["budget"] == budget and r["label"].startswith(arch + " "):
                        pts.setdefault(r["params"], []).append(r["val_loss_causal"])
                if pts:
                    xs = sorted(pts)
                    ax.plot(xs, [sum(pts[x]) / len(pts[x]) for x in xs], style, color=f"C{j}",
                            label=f"{arch} @ {budget:.2g}")  # fmt: skip
        ax.set_xscale("log")
        # 1-2-5 ticks labelled in millions: log axes' default minor labels overlap at this span
        ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x / 1e6:g}M"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel("parameters")
        ax.set_ylabel("validation loss (MoD: causal)")
        ax.set_title(f"{seq_len} tokens of context")
        ax.grid(alpha=0.3)
        # under the axes: inside, a legend of six entries hides the points it names
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
    fig.tight_layout()
    fig.savefig(out / "isoflop.png")
    plt.close(fig)


def size_for_size(rows: list[dict[str, Any]], sizes: list[str]) -> list[str]:
    """MoD against the dense model of the same size, per budget (one context's grid rows): the
    causal loss's change and how many more steps MoD's budget buys. [] before any pair."""
    by: dict[tuple[float, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        arch, size = r["label"].split(" ", 1)
        by.setdefault((r["budget"], arch, size), []).append(r)
    budgets = sorted({b for b, _, _ in by})
    body = []
    for b in budgets:
        cells = []
        for size in sizes:
            mod, dense = by.get((b, "MoD", size)), by.get((b, "dense", size))
            if not mod or not dense:
                cells.append("")
                continue
            m, d = _mean(mod, "val_loss_causal"), _mean(dense, "val_loss_causal")
            one_seed = min(len({r["seed"] for r in mod}), len({r["seed"] for r in dense})) < 2
            steps = _mean(mod, "steps") / _mean(dense, "steps")
            cells.append(f"{100 * (m - d) / d:+.1f}%{'¹' if one_seed else ''}, {steps:.2f}x")
        if any(cells):
            body.append(f"| {b:.1e} | " + " | ".join(cells) + " |")
    if not body:
        return []
    return [
        "Size for size: MoD's causal loss against the dense model of the same size, and the "
        "steps MoD's budget buys against dense's (¹ one seed of at least one of the two):",
        "",
        "| budget | " + " | ".join(sizes) + " |",
        "|---|" + "---|" * len(sizes),
        *body,
    ]


def summary_table(results: list[dict[str, Any]], s: Round2Settings) -> list[str]:
    """The headline, one row per budget and context (the README's table); [] before any. A best
    size at the edge of the sizes tried there is marked: its curve's minimum may lie beyond."""
    order = [n for n, _ in s.grid.sizes]
    lines = []
    for budget in s.grid.budgets:
        for seq_len, _ in s.contexts:
            rows = [
                r
                for r in results
                if r["group"] in ("isoflop", "seed")
                and r["seq_len"] == seq_len
                and r["budget"] == budget
            ]
            tried = sorted({r["label"].split(" ", 1)[1] for r in rows}, key=order.index)
            for b in findings(rows)["budgets"]:
                d, m = (
                    {**x, "label": x["label"] + EDGE * (x["label"].split(" ", 1)[1] in
                                                        (tried[0], tried[-1]))}
                    for x in (b["best_dense"], b["best_mod"])
                )  # fmt: skip
                spread = "-" if b["seed_spread"] is None else f"{b['seed_spread']:.3f}"
                lines.append(
                    f"| {seq_len} | {budget:.1e} | {d['label']} ({d['params'] / 1e6:.2f}M): "
                    f"{d['val_loss']:.4f} | {m['label']} ({m['params'] / 1e6:.2f}M): "
                    f"{m['val_loss_causal']:.4f} ({m['val_loss_topk']:.4f}) | "
                    f"{-100 * b['mod_gain']:+.1f}% loss | {spread} | {b['verdict']} |"
                )
    if not lines:
        return []
    return [
        "| context | training FLOPs | best dense: loss | best MoD: loss causal (top-k) | "
        "MoD vs dense | seed spread | verdict |",
        "|---|---|---|---|---|---|---|",
        *lines,
        "",
        f"{EDGE} the smallest or largest size tried there (sizes run from {order[0]} to "
        f"{order[-1]}; the grid adds the next one out while one is left): that curve's minimum "
        "may lie beyond it.",
    ]


EDGE = "\u2020"


def write_report(results: list[dict[str, Any]], out: Path, s: Round2Settings) -> None:
    win = winner(results)
    g = s.grid
    lines = [
        "# The isoFLOP study, second round: fair baselines, BPE tokens, longer context",
        "",
        "BPE tokens (vocabulary 4096, trained once on the training split of the default corpus "
        "and cached), 4096 tokens per step. MoD: every other block routed, capacity 12.5%. "
        "Losses are validation losses in nats per token; MoD runs are judged by the causal loss "
        "(what generation gets). Each run trains for the most steps its budget buys, FLOPs from "
        "`estimate_flops` (a capacity warm-up's extra FLOPs charged). Generated by "
        "`mod study --plan round2`; the first round is `docs/study/report.md`.",
        "",
    ]
    notes = out / "notes.md"
    if notes.exists():
        lines += [notes.read_text().strip(), ""]
    size = dict(g.sizes)[g.ablation_size]
    lines += [
        f"## Routing ablations ({s.ablation_budget:.1e} FLOPs, size {g.ablation_size}: "
        f"d_model {size['d_model']}, {size['n_layers']} layers; {s.contexts[0][0]} tokens of "
        "context)",
        "",
        "Random routing's causal decision takes each token with the capacity's probability (or "
        "the aux-loss model's measured rates), so its compute matches learned routing's in both "
        "modes. Causal take-rate: the share of tokens a routed block takes in causal mode (the "
        f"capacity is {MOD['capacity']:.1%}); routing accuracy: how often that decision agrees "
        "with top-k. The "
        "routing profile (last three columns) is each seed's (seed 0 / seed 1), on held-out "
        "text, in causal mode; rho near 0 means the blocks a token takes say nothing about how "
        "unsure the model is of the next token.",
        "",
        *ablation_table(results),
        "",
        *top_tokens(results),
        "![routing during training](diagnosis.png)",
        "",
    ]
    if win is not None:
        lines += [f"Winning causal router (lowest mean causal loss): **{win[0]}**.", ""]
    arm = mod_arm(results)
    if arm is not None:
        lines += [f"MoD arm of the longer runs and the grid: **{arm[0]}**.", ""]
    longer = ablation_table(results, "longer")
    if longer:
        lines += [
            f"### Trained longer: {s.long_budget:.1e} FLOPs, the same size",
            "",
            "Does learned routing pull away from random routing with more training?",
            "",
            *longer,
            "",
        ]
    summary = summary_table(results, s)
    if summary:
        lines += [
            "## Summary: MoD against dense at equal training FLOPs",
            "",
            "The best of each architecture at each budget and context (MoD by its causal loss; "
            "means over two seeds where a second ran; the seed spread is the largest |seed 0 - "
            "seed 1| there). Details per context below.",
            "",
            *summary,
            "",
            "Throughput (tok/s) in the tables below is each run's own log, on 2 shared CPU "
            "cores with other work at times beside it: indicative only (`mod bench` measures "
            "speed). From `ctx1024-5e13-dense-XXXS-s0` on, the runs kept freed memory for "
            "reuse (`mod`'s malloc setting, see the README's 'CPU training'), which made them up "
            "to 1.8 times faster with the same numbers: speeds on either side of that run do "
            "not compare. From `ctx256-1.5e14-dense-S-s1` and `ctx256-1.5e14-dense-M-s1` on, "
            "two runs trained at once, one thread each (`--workers 2`): each run's speed is "
            "that of half the machine.",
            "",
        ]
    for seq_len, batch in s.contexts:
        rows = [r for r in results if r["group"] in ("isoflop", "seed") and r["seq_len"] == seq_len]
        if not rows:
            continue
        f = findings(rows)
        head = format_findings(f)
        lines += [f"## isoFLOP grid, {seq_len} tokens of context (batch {batch})", ""]
        lines += [ln.replace("## Headline", "### Headline") for ln in head]
        pairs = size_for_size(rows, [n for n, _ in g.sizes])
        if pairs:
            lines += ["", *pairs]
        places = position_table(rows)
        if places:
            lines += ["", *places]
        lines += [
            "",
            "| model | seed | budget | params | FLOPs/fwd token | steps | val loss top-k | "
            "val loss causal | routing acc. | train tok/s |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted(rows, key=lambda r: (r["budget"], r["label"], r["seed"])):
            acc = r.get("routing_accuracy_mean")
            lines.append(
                f"| {r['label']} | {r['seed']} | {r['budget']:.1e} | {r['params'] / 1e6:.2f}M | "
                f"{r['flops_per_forward_token'] / 1e6:.2f}M | {r['steps']} | "
                f"{r['val_loss_topk']:.4f} | {r['val_loss_causal']:.4f} | "
                f"{'' if not acc else f'{acc:.1%}'} | {r['tokens_per_s']:,.0f} |"
            )
        lines.append("")
    if any(r["group"] in ("isoflop", "seed") for r in results):
        lines += ["![isoFLOP curves](isoflop.png)", ""]
    gpu = out / "gpu" / "results.jsonl"
    rows = load_results(gpu) if gpu.exists() else []
    budgets = ", ".join(f"{b:.0e}" for b in sorted({r["budget"] for r in rows})) or "1e16, 3e16"
    lines += [f"## On a GPU ({budgets} FLOPs, bf16)", ""]
    if rows:
        lines += [f"From `benchmarks/gpu_study.py` ({len(rows)} runs):", ""]
        lines += format_findings(findings(rows))[2:]
    else:
        lines.append(
            "Not run yet: no GPU has been lent to this project. `benchmarks/gpu_study.py` runs "
            "the same comparison on one GPU in about ten minutes and writes its results to "
            f"`{out.as_posix()}/gpu/results.jsonl`, which this report then includes."
        )
    planned = plan(s, results)
    left = [sp.name for sp in planned if sp.name not in {r["name"] for r in results}]
    lines += [
        "",
        f"Progress: {len(results)} runs done" + (
            f", {len(left)} planned next (more follow from their results)." if left else "."
        ),
    ]  # fmt: skip
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    try:
        plot_diagnosis(results, out)
        if any(r["group"] in ("isoflop", "seed") for r in results):
            plot_grid(results, out, s.contexts)
    except Exception as exc:  # plots are a convenience; the results are saved
        print(f"note: plots failed: {exc!r}")
