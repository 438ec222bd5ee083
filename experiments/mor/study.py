"""`mod study experiments/mor`: Mixture-of-Recursions (arXiv:2507.10524) beside dense and MoD,
by the same code, at equal training FLOPs; and MoR's headline at equal unique parameters.

Arms on BPE text at 256 and 1024 tokens of context (the same tokens a step), to two
training-FLOP budgets, at widths XXXS, XXS and XS at the smaller budget and XXS and XS at the
larger:
dense (6 layers); MoD (6 layers, every other block routed at 12.5%); the plain recursive model
(4 unique layers, the middle two applied 3 times, every token every step: no router); MoR with
expert choice (steps at 25% and 12.5%) and token choice, each with recursion-wise KV caching
and with recursive KV sharing. A second seed trains at each arm's best width per budget and
length. Apart from the grid, two pairs with two seeds each:
"sharing", MoR expert choice with all 4 unique layers cycled against middle-cycle, at width XS
and the smaller budget; "params", the vanilla 6-layer model against a recursive one with a third of
its unique layers (2 layers, all shared, applied 3 times, expert choice), at the larger budget.

Each run trains for floor(budget / training FLOPs per step) (`estimate_flops`, as every study).
The report puts loss, unique parameters, FLOPs per token, KV bytes per token (`estimate_flops`
at each step's capacity) and decode speed beside the paper's claims, each judged by the verdict
module (experiments/mor/report.py); with no results it says "not run yet". Decode speed is
measured once every run has trained (`measure`: the kept checkpoints, side by side, on an
otherwise idle machine), or by calling `measure` at a quiet moment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mixture_of_depths.config import MoDConfig
from mixture_of_depths.fileio import atomic_write_text, json_text
from mixture_of_depths.flops import estimate_flops
from mixture_of_depths.runtime.checkpoint import resolve_checkpoint
from mixture_of_depths.studies.runner import (
    Folders,
    Plan,
    RunSpec,
    StudySettings,
    budget_tag,
    load_results,
    mean_seeds,
    second_seed,
)
from mixture_of_depths.train import CHECKPOINT_NAME, has_checkpoint

from ..common.measure import decode_speeds

RECURSIVE = dict(layer_pattern="D", n_layers=4, recursions=3)
MOR = dict(RECURSIVE, recursion_capacities=(0.25, 0.125))
TOKEN = dict(RECURSIVE, recursion_router="token")
ARMS: tuple[tuple[str, str, dict[str, Any]], ...] = (  # (label, name tag, MoDConfig overrides)
    ("dense", "dense", dict(layer_pattern="D", n_layers=6)),
    ("MoD", "mod", dict(layer_pattern="DR", n_layers=6, capacity=0.125)),
    ("recursive", "rec", dict(RECURSIVE, recursion_capacities=(1.0, 1.0))),
    ("MoR expert, recursion KV", "mor-er", MOR),
    ("MoR expert, shared KV", "mor-es", dict(MOR, recursion_kv="share")),
    ("MoR token, recursion KV", "mor-tr", TOKEN),
    ("MoR token, shared KV", "mor-ts", dict(TOKEN, recursion_kv="share")),
)
# Sharing: MoR expert choice with recursion KV as in ARMS, all 4 unique layers cycled instead of
# middle-cycle (the same unique parameters and step capacities), judged against the grid's
# middle-cycle arm (tag "mor-er") at the same width, smallest budget, both lengths
SHARING = (
    "MoR expert, recursion KV, cycle sharing",
    "mor-ec",
    dict(MOR, recursion_sharing="cycle"),
)
# Equal unique parameters: a third of the vanilla 6-layer model's unique layers (2, all shared,
# applied 3 times, expert choice), judged against the grid's dense model (tag "dense", the
# vanilla model) at the same width, largest budget, first length
PARAMS = (
    "MoR, 2 unique layers x 3",
    "p-mor",
    dict(
        layer_pattern="D",
        n_layers=2,
        recursions=3,
        recursion_sharing="cycle",
        recursion_capacities=(0.5, 0.25),
    ),
)
SHARING_SIZE, PARAMS_SIZE = "XS", "M"  # the pairs' widths (a quick run: its one width)
LENGTHS = ((256, 16), (1024, 4))  # (sequence length, batch size): 4096 tokens a step

FULL = StudySettings(
    budgets=(1.5e13, 5e13),
    sizes=(
        ("XXXS", dict(d_model=32, n_heads=2)),
        ("XXS", dict(d_model=48, n_heads=3)),
        ("XS", dict(d_model=64, n_heads=4)),
        ("S", dict(d_model=96, n_heads=4)),
        ("M", dict(d_model=128, n_heads=4)),
    ),
    # At 1.5e13 the best width kept moving down (S beat M for the first arms, then XS beat S,
    # then XXS beat XS, then XXXS beat XXS for most arms): the small budget tries XXXS, XXS and
    # XS (the S and M runs done before stay in the results); the larger, 3.3x the compute, XXS
    # and XS, around where compute-optimal width (~C^0.5 parameters) puts it from XXXS-XXS; M
    # trains only as the params pair's width (CPU time: each run is 15-60 minutes)
    skip=((1.5e13, ("S", "M")), (5e13, ("XXXS", "S", "M"))),
    seq_len=256,
    batch_size=16,
    eval_every_runs=2,
    eval_batches=8,
    base=dict(max_seq_len=1024),
    ablation_size="M",
    tokenizer="bpe",
)
QUICK = StudySettings(
    budgets=(1e9, 2e9),
    sizes=(("S", dict(d_model=32, n_heads=2)),),
    seq_len=32,
    batch_size=4,
    eval_every_runs=1,
    eval_batches=1,
    base=dict(max_seq_len=64),
    ablation_size="S",
)


def _lengths(settings: StudySettings) -> tuple[tuple[int, int], ...]:
    if settings.seq_len != FULL.seq_len:  # a quick run: its own length, twice as long too
        return ((settings.seq_len, settings.batch_size), (2 * settings.seq_len, 2))
    return LENGTHS


def _pair(
    arm: tuple[str, str, dict[str, Any]],
    ref_tag: str,
    group: str,
    settings: StudySettings,
    b: float,
    lengths: tuple[tuple[int, int], ...],
    size: str,
    grid: dict[str, RunSpec],
) -> list[RunSpec]:
    """`arm` at budget `b`, width `size`, each length, seeds 0 and 1; beside it the grid's run
    of the arm it is judged against (`ref_tag`) at the same width and budget, and that run's
    second seed (a run the grid or its seeds also plan trains once: the names are the same)."""
    label, tag, over = arm
    runs = []
    for T, bs in lengths:
        model = {**settings.base, **dict(settings.sizes)[size], **over}
        name = f"{budget_tag(b)}-{tag}-{size}-T{T}-s0"
        spec = RunSpec(name, group, label, b, model, seq_len=T, batch_size=bs)
        ref_name = f"{budget_tag(b)}-{ref_tag}-{size}-T{T}-s0"
        ref = grid.get(ref_name)
        if ref is None:  # a width the grid does not try at this budget: the pair's own run
            ref_label, _, ref_over = next(a for a in ARMS if a[1] == ref_tag)
            ref_model = {**settings.base, **dict(settings.sizes)[size], **ref_over}
            ref = RunSpec(ref_name, group, ref_label, b, ref_model, seq_len=T, batch_size=bs)
        runs += [spec, second_seed(spec.__dict__), ref, second_seed(ref.__dict__)]
    return runs


def plan(settings: StudySettings) -> list[RunSpec]:
    """Every arm at every width, length and budget, the smallest budget first (each length's
    second seeds join when its grid is done, `runner.study`); then the sharing pair (width XS,
    smallest budget) and the equal-parameter pair (width M, largest budget, first length)
    before the larger budget's grid, so that each claim has its runs early."""
    grids = [
        [
            RunSpec(
                name=f"{budget_tag(b)}-{tag}-{size}-T{T}-s0",
                group="isoflop",
                label=label,
                budget=b,
                model={**settings.base, **shape, **over},
                seq_len=T,
                batch_size=bs,
            )
            for T, bs in _lengths(settings)
            for label, tag, over in ARMS
            for size, shape in settings.sizes_at(b)
        ]
        for b in sorted(settings.budgets)
    ]
    lengths = _lengths(settings)
    first, last = min(settings.budgets), max(settings.budgets)
    sizes = dict(settings.sizes)
    pick = lambda size: size if size in sizes else settings.sizes[0][0]  # noqa: E731
    named = {spec.name: spec for grid in grids for spec in grid}
    extra = _pair(SHARING, "mor-er", "sharing", settings, first, lengths, pick(SHARING_SIZE), named)
    extra += _pair(PARAMS, "dense", "params", settings, last, lengths[:1], pick(PARAMS_SIZE), named)
    return grids[0] + extra + [spec for grid in grids[1:] for spec in grid]


def seed_specs(results: list[dict[str, Any]], budget: float, T: int) -> list[RunSpec]:
    """A second seed for each arm's best width at this budget and length."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for r in results:
        if (r["group"], r["budget"], r["seq_len"], r["seed"]) == ("isoflop", budget, T, 0):
            key = (r["label"], r["seq_len"])
            if key not in best or r["val_loss_causal"] < best[key]["val_loss_causal"]:
                best[key] = r
    return [second_seed(r) for r in best.values()]


# -- what the results say -------------------------------------------------------------------------
def size_of(row: dict[str, Any]) -> str:
    """The width label of a run, from its name (``<budget>-<tag>-<size>-T<len>-s<seed>``)."""
    return row["name"].split("-T")[0].rsplit("-", 1)[-1]


def cells(
    results: list[dict[str, Any]], size: str | None = None, decode: dict[str, dict] | None = None
) -> dict[tuple[float, int, str], dict[str, Any]]:
    """Per (budget, length, label): the best width's loss (mean over its seeds; only width
    `size` if given), its seed gap, unique parameters, FLOPs and KV bytes per token, the seed-0
    run's name ("name") and all its seeds' ("names"), and the decode speeds of the first of them
    that `decode` (by run name) has ("timed": its name). The best width is chosen on the seeds
    every width of the cell trained (seed 0: the one `seed_specs` chose by), never a one-seed
    width against another's two-seed mean."""
    out: dict[tuple[float, int, str], dict[str, Any]] = {}
    groups: dict[tuple[float, int, str], dict[str, list[dict[str, Any]]]] = {}
    for r in results:
        if size is None or size_of(r) == size:
            key = (r["budget"], r["seq_len"], r["label"])
            groups.setdefault(key, {}).setdefault(size_of(r), []).append(r)
    for (b, T, label), widths in groups.items():
        rows = _best_width(widths)
        loss = mean_seeds(rows, "val_loss_causal")[label]
        by_seed = {r["seed"]: r["val_loss_causal"] for r in rows}
        cfg = MoDConfig(**rows[0]["model"])
        est = estimate_flops(cfg, T, with_dense=False)
        takes = routed_takes(rows)
        routed = estimate_flops(cfg, T, with_dense=False, take_rate=takes) if takes else est
        names = [r["name"] for r in sorted(rows, key=lambda r: r["seed"])]
        timed = next(((decode or {})[n] for n in names if n in (decode or {})), None)
        out[(b, T, label)] = {
            "loss": loss,
            "gap": abs(by_seed[0] - by_seed[1]) if {0, 1} <= set(by_seed) else None,
            "params": rows[0]["params"],
            "flops_per_token": est.train / T,
            "kv_bytes_per_token": est.kv_bytes_per_token,
            "kv_bytes_per_token_routed": routed.kv_bytes_per_token,
            "seeds": len(rows),
            "name": names[0],
            "names": names,
            **({} if timed is None else {**timed, "name": names[0], "timed": timed["name"]}),
        }
    return out


def _best_width(widths: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The rows of the width with the lowest mean loss over the seeds all widths share (with no
    seed shared, over each width's own seeds); a tie goes to the width with more seeds."""
    shared = set.intersection(*({r["seed"] for r in rows} for rows in widths.values()))

    def score(rows: list[dict[str, Any]]) -> tuple[float, int]:
        on = [r["val_loss_causal"] for r in rows if not shared or r["seed"] in shared]
        return sum(on) / len(on), -len(rows)

    return min(widths.values(), key=score)


def routed_takes(rows: list[dict[str, Any]]) -> list[float]:
    """The causal take-rate of each routed layer or recursion step (keys "<layer or
    step>.<kind>", in forward order), the mean over `rows`' seeds; [] where a model has no
    router, or more than one per layer (staggered routing: the estimate takes one rate per
    layer), or a row misses one."""
    names = sorted(rows[0].get("causal_take_rate") or {}, key=lambda k: int(k.split(".")[0]))
    layers = [k.split(".")[0] for k in names]
    if len(set(layers)) != len(layers) or any(
        set(r.get("causal_take_rate") or {}) != set(names) for r in rows
    ):
        return []
    return [sum(r["causal_take_rate"][k] for r in rows) / len(rows) for k in names]


def decode_rows(out: Path) -> dict[str, dict[str, Any]]:
    """The decode speeds measured so far (``decode.jsonl``), by run name; the later wins."""
    return {m["name"]: m for m in load_results(out / "decode.jsonl")}


def write_report(results: list[dict[str, Any]], out: Path, settings: StudySettings) -> None:
    """The report, findings and figure (experiments/mor/report.py, imported here, late: it
    reads this module)."""
    from .report import write_report as write

    write(results, out, settings)


# -- decode speed of the trained models ---------------------------------------------------------
def measure(results: list[dict[str, Any]], out: Path, work: Path, data: str | None) -> None:
    """Decode speed, per budget and length, of each arm's model at its best width (grid arms,
    and the sharing and parameter pairs where they ran), side by side
    (`measure.decode_speeds`): the seed-0 model, or the first later seed's where seed 0's
    checkpoint is gone. A budget and length is timed again, all its models together, when one
    of its cells has a kept model and no timing yet; its older rows in ``decode.jsonl`` then go,
    so that every speed of a cell's table comes from one side-by-side timing. Needs the kept
    checkpoints (``--keep-checkpoints``) and an otherwise idle machine. Delete the file to
    measure again."""
    path = out / "decode.jsonl"
    done = set(decode_rows(out))
    c = cells(results)
    for b, T in sorted({(b, T) for b, T, _ in c}):
        group = [x for (b2, T2, _), x in c.items() if (b2, T2) == (b, T)]
        kept: dict[str, Path] = {}
        missing = []  # cells whose every seed's checkpoint is gone
        fresh = False  # a cell with a model to time and no timing yet
        for x in group:
            name = next((n for n in x["names"] if has_checkpoint(work / n)), None)
            if name is None:
                missing.append(x["name"])
            else:
                kept[name] = work / name / CHECKPOINT_NAME
                fresh = fresh or not any(n in done for n in x["names"])
        if not fresh:
            continue
        for name in missing:
            print(f"decode speed: no checkpoint kept for {name} or its other seeds: not timed "
                  "(retrain it to time it)")  # fmt: skip
        print(f"decode speed: budget {b:.1e}, T={T}, {len(kept)} models side by side")
        speeds = decode_speeds({n: resolve_checkpoint(p) for n, p in kept.items()}, T, data)
        stale = {n for x in group for n in x["names"]}
        rows = [r for r in decode_rows(out).values() if r["name"] not in stale]
        rows += [{"name": name, **speeds[name]} for name in kept]
        atomic_write_text(path, "".join(json_text(r) + "\n" for r in rows))
        done = (done - stale) | set(kept)


PLAN = Plan(  # the module's globals are read at call time (tests cut the plan down)
    name="mor",
    settings=lambda quick: QUICK if quick else FULL,
    runs=lambda settings: plan(settings),
    report=lambda results, out, settings: write_report(results, out, settings),
    folders=Folders(str(Path(__file__).resolve().parent)),
    # per budget and length: a length's verdicts need not wait for the other's grid
    seeds=lambda results, group, settings: seed_specs(results, *group),
    seed_group=lambda spec: (spec.budget, spec.seq_len),
    finish=lambda results, out, work, data: measure(results, out, work, data),
)
