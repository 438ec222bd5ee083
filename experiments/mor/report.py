"""The MoR study's report (`mod study experiments/mor --report` rewrites it from the results):
the paper's claims, each judged by the verdict module (`mixture_of_depths.studies.verdict`),
never by a word of this file's own, and every arm's numbers.

Each claim sets the side the paper says is better (`a`) against the other (`b`) at each budget
and length where both trained: an `Arm` per side with its seeds' losses, its best width's edge
(`best_of` over the widths that side trained there), and its learning rate's (every arm
trained at one rate, so none is bracketed: both sides say so). A claim about GPU throughput at
large batches is not testable on one CPU thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixture_of_depths.fileio import atomic_write_text, json_text
from mixture_of_depths.studies.plots import pyplot
from mixture_of_depths.studies.runner import StudySettings, budget_tag
from mixture_of_depths.studies.verdict import Arm, Verdict, best_of, compare

from ..common.measure import BUSY_WARN
from .study import ARMS, cells, decode_rows, size_of

# TrainConfig's peak learning rate when these runs trained (their rows name none: the default),
# pinned so that a later default does not rewrite the report
DEFAULT_LR = 2e-3
SPEED_UNTESTABLE = (
    "the paper's throughput is GPU decoding at large batches (up to 2.06x); this machine times "
    "one CPU thread at batch 1 and 8"
)


@dataclass(frozen=True)
class Claim:
    """A claim of the paper: `a`, the label it says is better, against `b`; `width` None
    judges each side at its best width, "pair" both at the width the pair's own side (the one
    not in the grid) trained at; `speed` judges decoding, not loss."""

    key: str  # the verdict's key in findings.json, before its budget and length
    text: str
    a: str
    b: str
    width: str | None = None
    speed: bool = False


MOR_EC, TOKEN_RC = "MoR expert, recursion KV", "MoR token, recursion KV"
CLAIMS: tuple[Claim, ...] = (
    Claim("mor-vs-dense", "MoR (expert choice) reaches a lower loss than the vanilla "
          "Transformer at equal training FLOPs, with fewer unique parameters", MOR_EC, "dense"),
    Claim("mor-vs-recursive", "MoR beats the plain recursive model (every token every "
          "recursion) at equal FLOPs", MOR_EC, "recursive"),
    Claim("expert-vs-token", "Expert-choice routing beats token-choice routing (here token "
          "choice computes every token at every step, masked, and is charged so: docs/mor.md)",
          MOR_EC, TOKEN_RC),
    Claim("recursion-kv-vs-shared-kv", "Recursion-wise KV caching beats recursive KV sharing "
          "with expert choice", MOR_EC, "MoR expert, shared KV"),
    Claim("token-shared-kv-vs-recursion-kv", "Recursive KV sharing helps token choice",
          "MoR token, shared KV", TOKEN_RC),
    Claim("params-vs-dense-best", "With a third of the unique parameters, MoR matches or beats "
          "the vanilla model (dense, 6 layers, at its best width)", "MoR, 2 unique layers x 3",
          "dense"),
    Claim("params-vs-dense-same-width", "With a third of the unique parameters, MoR matches or "
          "beats the vanilla model (dense, 6 layers, at the pair's width)",
          "MoR, 2 unique layers x 3", "dense", "pair"),
    Claim("middle-cycle-vs-cycle", "Middle-cycle sharing beats cycle sharing (same unique "
          "layers and capacities, at the pair's width)", MOR_EC,
          "MoR expert, recursion KV, cycle sharing", "pair"),
    Claim("decode-speed", "MoR decodes faster than the vanilla model (paper: up to 2.06x "
          "throughput)", MOR_EC, "dense", speed=True),
)  # fmt: skip


@dataclass(frozen=True)
class Row:
    """A claim at one budget and length: the sides' numbers and the verdict (None: `status`)."""

    claim: Claim
    where: str
    sides: str
    key: str | None
    verdict: Verdict | None
    status: str = "not run yet"  # what the verdict column says where there is no verdict


def rate_text(lr: float) -> str:
    """A learning rate as the report writes it: 0.002 -> "2e-3"."""
    return f"{lr:.0e}".replace("e-0", "e-").replace("e+0", "e")


def _grid(rows: list[dict[str, Any]], by: str) -> list[tuple[str, dict[int, float]]]:
    """`rows` as a grid for `best_of`: per width ("width", narrowest first) or learning rate
    ("lr", lowest first), the loss per seed."""
    points: dict[str, tuple[float, dict[int, float]]] = {}
    for r in rows:
        if by == "width":
            name, order = size_of(r), float(r["model"]["d_model"])
        else:
            order = r.get("lr") or DEFAULT_LR
            name = rate_text(order)
        points.setdefault(name, (order, {}))[1][r["seed"]] = r["val_loss_causal"]
    return [(name, seeds) for name, (_, seeds) in sorted(points.items(), key=lambda p: p[1][0])]


def arm(
    results: list[dict[str, Any]], b: float, T: int, label: str, width: str | None = None
) -> Arm | None:
    """`label`'s arm at budget `b` and length `T`: at its best width over every width it trained
    there (`best_of`, its edge), or at `width` (where that is not its best, the arm says so);
    unbracketed where its best learning rate at that width is an end of those tried (one rate
    tried: every arm here)."""
    rows = [r for r in results if (r["budget"], r["seq_len"], r["label"]) == (b, T, label)]
    widths = _grid(rows, "width")
    if not widths or (width is not None and width not in dict(widths)):
        return None
    best, edge = best_of(widths, "width")
    if width is not None and width != best:
        edge = f"the pair's width, {width}, is not its best width here ({best})"
    chosen = width or best
    lrs = _grid([r for r in rows if size_of(r) == chosen], "lr")
    _, open_end = best_of(lrs, "learning rate", ("lowest", "highest"))
    # its seeds at the learning rate it did best at (the only one every arm here tried)
    seeds = min((s for _, s in lrs), key=lambda s: sum(s.values()) / len(s))
    return Arm(f"{label} ({chosen})", seeds, edge, open_end)


def _speed_arm(side: Arm, cell: dict[str, Any]) -> Arm:
    """`side` as decoding: the timed model's milliseconds per token at batch 8, by its seed."""
    seed = int(cell["timed"].rsplit("-s", 1)[1])
    label = side.label + " decoding"
    return Arm(label, {seed: 1000 / cell["decode_tok_s_b8"]}, side.edge, side.unbracketed)


def _speed_sides(x: dict[str, Any], y: dict[str, Any]) -> str:
    """MoR's decode speed over dense's, at batch 1 and 8, and whether a study ran beside."""
    ratios = [f"{x[f'decode_tok_s_b{n}'] / y[f'decode_tok_s_b{n}']:.2f}x at batch {n}"
              for n in (1, 8)]  # fmt: skip
    busy = max(x.get("others_busy", 0.0), y.get("others_busy", 0.0))
    skew = f"; timed while other processes used {busy:.0%} of the CPUs" if busy > BUSY_WARN else ""
    return f"{', '.join(ratios)} (CPU, one thread{skew})"


def _pair_width(results: list[dict[str, Any]], claim: Claim) -> str | None:
    """The width the pair's own side (the one that is not a grid arm) trained at."""
    own = claim.b if claim.a in {label for label, _, _ in ARMS} else claim.a
    return next((size_of(r) for r in results if r["label"] == own), None)


def claim_rows(results: list[dict[str, Any]], decode: dict[str, dict] | None = None) -> list[Row]:
    """Each claim at every budget and length where both its sides trained ("not run yet" where
    none), judged by `compare`."""
    rows: list[Row] = []
    for claim in CLAIMS:
        width = _pair_width(results, claim) if claim.width == "pair" else None
        where = sorted({(r["budget"], r["seq_len"]) for r in results})
        found = 0
        for b, T in where:
            a, base = (arm(results, b, T, side, width) for side in (claim.a, claim.b))
            if a is None or base is None:
                continue
            found += 1
            key = f"{claim.key}-{budget_tag(b)}-t{T}"
            place = f"{b:.1e} FLOPs, T={T}"
            if not claim.speed:
                sides = f"{a.mean:.4f} / {base.mean:.4f}"
                rows.append(Row(claim, place, sides, key, compare(a, base)))
                continue
            c = cells(results, None, decode)
            x, y = c[(b, T, claim.a)], c[(b, T, claim.b)]
            if "decode_tok_s_b8" not in x or "decode_tok_s_b8" not in y:
                rows.append(Row(claim, place, "", None, None, "not measured yet"))
                continue
            a, base = _speed_arm(a, x), _speed_arm(base, y)
            verdict = compare(a, base, untestable=SPEED_UNTESTABLE)
            rows.append(Row(claim, place, _speed_sides(x, y), key, verdict))
        if not found:
            rows.append(Row(claim, "-", "", None, None))
    return rows


def learning_rates(results: list[dict[str, Any]]) -> list[str]:
    """The peak learning rates the runs trained at, lowest first."""
    return [rate_text(x) for x in sorted({r.get("lr") or DEFAULT_LR for r in results})]


def _claim_lines(results: list[dict[str, Any]], rows: list[Row]) -> list[str]:
    rates = ", ".join(learning_rates(results)) or "none yet"
    return [
        f"Every arm trained at the same peak learning rate ({rates}; warm-up a tenth of the "
        "steps, at most 50): no arm's rate was tuned, so none is bracketed, and each verdict "
        "names it for both sides (a better rate for either could change the order).",
        "",
        "Each verdict is the verdict module's (`mixture_of_depths.studies.verdict`): the "
        "claim's side against the other, the mean difference of their losses over the seeds "
        "both trained (negative: the claim's side is lower) with each seed's, and one word: "
        "better or worse only beyond the seed spread (the larger range of either side's "
        "seeds), with both sides' best widths inside the widths tried and every tuned value "
        "bracketed. Decode rows: the sides' ms per token at batch 8 (the timed model's seed).",
        "",
        "| claim | where | claim's side / other (loss; decode: speed ratio) | verdict |",
        "|---|---|---|---|",
        *[
            f"| {r.claim.text} | {r.where} | {r.sides} | "
            f"{r.status if r.verdict is None else r.verdict.text()} |"
            for r in rows
        ],
    ]


def _arm_lines(
    results: list[dict[str, Any]], decode: dict[str, dict], settings: StudySettings
) -> list[str]:
    if not results:
        return ["Not run yet."]
    lines = [
        "| budget | T | model | width | seeds | unique params | train FLOPs/token | "
        "KV bytes/token, at capacity / as routed | val loss causal | "
        "decode tok/s, batch 1 / 8 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    tried: dict[tuple[float, int, str], set[str]] = {}
    for r in results:
        tried.setdefault((r["budget"], r["seq_len"], r["label"]), set()).add(size_of(r))
    order = [size for size, _ in settings.sizes]
    edge = False
    ends = {k: (min(v, key=order.index), max(v, key=order.index)) for k, v in tried.items()}
    for (b, T, label), x in sorted(cells(results, None, decode).items(), key=lambda kv: kv[0][:2]):
        speed = (f"{x['decode_tok_s_b1']:,.0f} / {x['decode_tok_s_b8']:,.0f}"
                 if "decode_tok_s_b8" in x else "")  # fmt: skip
        width = size_of({"name": x["name"]})
        # the best of two or more widths is the smallest or largest tried: a better one may
        # lie beyond it
        mark = "†" if len(tried[b, T, label]) > 1 and width in ends[b, T, label] else ""
        edge = edge or bool(mark)
        lines.append(
            f"| {b:.1e} | {T} | {label} | {width}{mark} | {x['seeds']} | "
            f"{x['params'] / 1e6:.2f}M | "
            f"{x['flops_per_token'] / 1e6:.2f}M | {x['kv_bytes_per_token']:,.0f} / "
            f"{x['kv_bytes_per_token_routed']:,.0f} | "
            f"{x['loss']:.4f} | {speed} |"
        )
    if edge:
        lines += ["", "† the best of the widths tried there is the smallest or largest of them "
                  f"(widths {', '.join(order)}): the arm's best may lie beyond."]  # fmt: skip
    return lines


def findings(rows: list[Row]) -> dict[str, Any]:
    """The claims (each with its verdict's key, None: not run yet) and the verdicts by key."""
    claims = [{"claim": r.claim.text, "where": r.where, "key": r.key} for r in rows]
    verdicts = {r.key: r.verdict.as_dict() for r in rows if r.key and r.verdict}
    return {"claims": claims, "verdicts": verdicts}


def write_report(results: list[dict[str, Any]], out: Path, settings: StudySettings) -> None:
    """report.md, findings.json and mor.png in `out`, from `results` and ``decode.jsonl``."""
    decode = decode_rows(out)
    rows = claim_rows(results, decode)
    lines = [
        "# MoR study: Mixture-of-Recursions beside dense and MoD at equal training FLOPs",
        "",
        "Generated by `mod study experiments/mor` (docs/mor.md; `--report` rewrites it from "
        "the results). Losses: validation, nats per "
        "token, causal routing (what generation gets), mean over seeds, at each arm's best width. "
        "FLOPs per token: a training step's, charged; KV bytes: per token of context at 2 bytes "
        "an element, each step at its capacity (token choice: balanced depths), and as routed: "
        "at the causal take-rates the run measured on its validation text (what generation "
        "caches; the mean over seeds). Decode: greedy "
        "tokens/s after a prompt of half the context, the seed-0 model of each arm's best width "
        "(seed 1's where seed 0's checkpoint was lost), "
        "the models of a budget and length side by side (CPU, one thread, median of "
        "interleaved rounds), measured once training is done with nothing else running. "
        "Plot: `mor.png`.",
        "",
        "## The paper's claims",
        "",
        *_claim_lines(results, rows),
        "",
        "## Every arm",
        "",
        *_arm_lines(results, decode, settings),
    ]
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    atomic_write_text(out / "findings.json", json_text(findings(rows), indent=1) + "\n")
    if results:
        plot(results, out / "mor.png")


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Per length, each grid arm's loss (best width, seed mean, the seed gap as a whisker)
    against the training budget; and loss against KV bytes per token at each length's largest
    budget run."""
    c = cells([r for r in results if r["group"] in ("isoflop", "seed")])
    lengths = sorted({T for _, T, _ in c})
    plt = pyplot()
    fig, axes = plt.subplots(
        1, len(lengths) + 1, figsize=(5 * (len(lengths) + 1), 4.2), dpi=110, squeeze=False
    )
    axes = axes[0]
    labels = [label for label, _, _ in ARMS]
    for ax, T in zip(axes, lengths, strict=False):
        for i, label in enumerate(labels):
            pts = sorted((b, x) for (b, t, lab), x in c.items() if t == T and lab == label)
            if pts:
                ax.errorbar([b for b, _ in pts], [x["loss"] for _, x in pts],
                            yerr=[x["gap"] or 0.0 for _, x in pts], marker="o", ms=4,
                            capsize=2, color=f"C{i}", label=label)  # fmt: skip
        ax.set_xscale("log")
        ax.set(title=f"{T} tokens of context", xlabel="training FLOPs",
               ylabel="validation loss, causal (nats)")  # fmt: skip
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    ax = axes[-1]
    for j, T in enumerate(lengths):
        top = max(b for b, t, _ in c if t == T)
        for i, label in enumerate(labels):
            x = c.get((top, T, label))
            if x is not None:
                ax.scatter(x["kv_bytes_per_token"], x["loss"], color=f"C{i}",
                           marker="os"[j % 2], label=f"T={T}" if i == 0 else None)  # fmt: skip
    ax.set(title="loss against KV cache (largest budget run)", xlabel="KV bytes per token",
           ylabel="validation loss, causal (nats)")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
