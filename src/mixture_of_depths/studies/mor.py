"""`mod study --plan mor`: Mixture-of-Recursions (arXiv:2507.10524) beside dense and MoD, by the
same code, at equal training FLOPs; and MoR's headline at equal unique parameters.

Arms, each at two widths, on BPE text at 256 and 1024 tokens of context (the same tokens a step),
to two training-FLOP budgets: dense (6 layers); MoD (6 layers, every other block routed at
12.5%); the plain recursive model (4 unique layers, the middle two applied 3 times, every token
every step: no router); MoR with expert choice (steps at 25% and 12.5%) and token choice, each
with recursion-wise KV caching and with recursive KV sharing. A second seed trains at each
arm's best width per budget and length. Apart from the grid ("params"): the vanilla 6-layer
model against a recursive one with a third of its unique layers (2 layers, all shared, applied
3 times, expert choice), at the larger budget.

Each run trains for floor(budget / training FLOPs per step) (`estimate_flops`, as every study).
The report puts loss, unique parameters, FLOPs per token, KV bytes per token (`estimate_flops`
at each step's capacity) beside the paper's claims, each marked supported, contradicted, within
the seed spread, or not testable here; with no results it says "not run yet". Decode speed is
not measured by this plan (the machine must be otherwise idle to time it; see docs/mor.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import MoDConfig
from ..fileio import atomic_write_text, json_text
from ..flops import estimate_flops
from .runner import Folders, Plan, RunSpec, StudySettings, budget_tag, mean_seeds, second_seed

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
# Equal unique parameters: the vanilla model, and a third of its unique layers recursed
PARAMS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("vanilla, 6 layers", "p-vanilla", dict(layer_pattern="D", n_layers=6)),
    (
        "MoR, 2 unique layers x 3",
        "p-mor",
        dict(
            layer_pattern="D",
            n_layers=2,
            recursions=3,
            recursion_sharing="cycle",
            recursion_capacities=(0.5, 0.25),
        ),
    ),  # fmt: skip
)
LENGTHS = ((256, 16), (1024, 4))  # (sequence length, batch size): 4096 tokens a step

FULL = StudySettings(
    budgets=(1.5e13, 5e13),
    sizes=(("S", dict(d_model=96, n_heads=4)), ("M", dict(d_model=128, n_heads=4))),
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


def plan(settings: StudySettings) -> list[RunSpec]:
    """Every arm at every width, length and budget; the equal-parameter pair at the largest."""
    runs = [
        RunSpec(
            name=f"{budget_tag(b)}-{tag}-{size}-T{T}-s0",
            group="isoflop",
            label=label,
            budget=b,
            model={**settings.base, **shape, **over},
            seq_len=T,
            batch_size=bs,
        )
        for b in settings.budgets
        for T, bs in _lengths(settings)
        for label, tag, over in ARMS
        for size, shape in settings.sizes
    ]
    b, (T, bs) = max(settings.budgets), _lengths(settings)[0]
    size, shape = settings.sizes[-1]
    for label, tag, over in PARAMS:
        spec = RunSpec(f"{budget_tag(b)}-{tag}-{size}-T{T}-s0", "params", label, b,
                       {**settings.base, **shape, **over}, seq_len=T, batch_size=bs)  # fmt: skip
        runs += [spec, second_seed(spec.__dict__)]
    return runs


def seed_specs(results: list[dict[str, Any]], budget: float) -> list[RunSpec]:
    """A second seed for each arm's best width at this budget, per length."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for r in results:
        if r["group"] == "isoflop" and r["budget"] == budget and r["seed"] == 0:
            key = (r["label"], r["seq_len"])
            if key not in best or r["val_loss_causal"] < best[key]["val_loss_causal"]:
                best[key] = r
    return [second_seed(r) for r in best.values()]


# -- what the results say -------------------------------------------------------------------------
def cells(results: list[dict[str, Any]]) -> dict[tuple[float, int, str], dict[str, Any]]:
    """Per (budget, length, label): the best width's loss (mean over its seeds), its seed gap,
    unique parameters, FLOPs and KV bytes per token."""
    out: dict[tuple[float, int, str], dict[str, Any]] = {}
    groups: dict[tuple[float, int, str, str], list[dict[str, Any]]] = {}
    for r in results:
        size = r["name"].split("-T")[0].rsplit("-", 1)[-1]
        groups.setdefault((r["budget"], r["seq_len"], r["label"], size), []).append(r)
    for (b, T, label, _), rows in groups.items():
        loss = mean_seeds(rows, "val_loss_causal")[label]
        by_seed = {r["seed"]: r["val_loss_causal"] for r in rows}
        cell = out.get((b, T, label))
        if cell is not None and cell["loss"] <= loss:
            continue
        cfg = MoDConfig(**rows[0]["model"])
        est = estimate_flops(cfg, T, with_dense=False)
        out[(b, T, label)] = {
            "loss": loss,
            "gap": abs(by_seed[0] - by_seed[1]) if {0, 1} <= set(by_seed) else None,
            "params": rows[0]["params"],
            "flops_per_token": est.train / T,
            "kv_bytes_per_token": est.kv_bytes_per_token,
            "seeds": len(rows),
        }
    return out


def _verdict(c: dict, better: str, worse: str, b: float, T: int) -> str:
    x, y = c.get((b, T, better)), c.get((b, T, worse))
    if x is None or y is None:
        return "not run yet"
    if x["gap"] is None or y["gap"] is None:
        return "no second seed for both yet"
    diff, spread = y["loss"] - x["loss"], max(x["gap"], y["gap"])
    if abs(diff) <= spread:
        return f"within the seed spread ({diff:+.4f}, spread {spread:.4f})"
    word = "supported" if diff > 0 else "contradicted"
    return f"{word} ({x['loss']:.4f} against {y['loss']:.4f})"


# (claim, the side the paper says is better, the other side); None: not testable here, and why
CLAIMS: tuple[tuple[str, str | None, str], ...] = (
    ("MoR (expert choice) reaches a lower loss than the vanilla Transformer at equal training "
     "FLOPs, with fewer unique parameters", "MoR expert, recursion KV", "dense"),
    ("MoR beats the plain recursive model (every token every recursion) at equal FLOPs",
     "MoR expert, recursion KV", "recursive"),
    ("Expert-choice routing beats token-choice routing", "MoR expert, recursion KV",
     "MoR token, recursion KV"),
    ("Recursion-wise KV caching beats recursive KV sharing with expert choice",
     "MoR expert, recursion KV", "MoR expert, shared KV"),
    ("Recursive KV sharing helps token choice", "MoR token, shared KV", "MoR token, recursion KV"),
    ("With a third of the unique parameters, MoR matches or beats the vanilla model",
     "MoR, 2 unique layers x 3", "vanilla, 6 layers"),
    ("Middle-cycle sharing is the best sharing strategy", None,
     "this plan trains middle-cycle only in the grid"),
    ("MoR decodes with up to 2.06x the vanilla model's throughput", None,
     "decode speed needs an idle machine and a batched engine; not timed by this plan"),
)  # fmt: skip


def claim_rows(results: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(claim, where, verdict) per claim and each (budget, length) where either side ran."""
    c = cells(results)
    rows = []
    for text, better, worse in CLAIMS:
        if better is None:
            rows.append((text, "-", f"not testable here: {worse}"))
            continue
        where = sorted({(b, T) for b, T, label in c if label in (better, worse)})
        rows += [
            (text, f"{b:.1e} FLOPs, T={T}", _verdict(c, better, worse, b, T)) for b, T in where
        ]
        if not where:
            rows.append((text, "-", "not run yet"))
    return rows


def write_report(results: list[dict[str, Any]], out: Path, settings: StudySettings) -> None:
    lines = [
        "# MoR study: Mixture-of-Recursions beside dense and MoD at equal training FLOPs",
        "",
        "Generated by `mod study --plan mor` (docs/mor.md). Losses: validation, nats per token, "
        "causal routing (what generation gets), mean over seeds, at each arm's best width. "
        "FLOPs per token: a training step's, charged; KV bytes: per token of context at 2 bytes "
        "an element, each step at its capacity (token choice: balanced depths).",
        "",
        "## The paper's claims",
        "",
        "| claim | where | verdict |",
        "|---|---|---|",
        *[f"| {a} | {b} | {v} |" for a, b, v in claim_rows(results)],
        "",
        "## Every arm",
        "",
    ]
    if not results:
        lines.append("Not run yet.")
    else:
        lines += [
            "| budget | T | model | seeds | unique params | train FLOPs/token | KV bytes/token | "
            "val loss causal |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for (b, T, label), x in sorted(cells(results).items(), key=lambda kv: kv[0][:2]):
            lines.append(
                f"| {b:.1e} | {T} | {label} | {x['seeds']} | {x['params'] / 1e6:.2f}M | "
                f"{x['flops_per_token'] / 1e6:.2f}M | {x['kv_bytes_per_token']:,.0f} | "
                f"{x['loss']:.4f} |"
            )
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    claims = [{"claim": a, "where": b, "verdict": v} for a, b, v in claim_rows(results)]
    atomic_write_text(out / "findings.json", json_text({"claims": claims}, indent=1) + "\n")


PLAN = Plan(  # the module's globals are read at call time (tests cut the plan down)
    name="mor",
    settings=lambda quick: QUICK if quick else FULL,
    runs=lambda settings: plan(settings),
    report=lambda results, out, settings: write_report(results, out, settings),
    folders=Folders(out="docs/study/mor", work="runs/study-mor", quick_apart=True),
    seeds=lambda results, budget, settings: seed_specs(results, budget),
)
