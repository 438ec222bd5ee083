"""The second round's report: the ablation tables, the summary, the grid per context with its
size-for-size and loss-by-place tables, the GPU section and the progress line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mixture_of_depths.fileio import atomic_write_text, json_text
from mixture_of_depths.studies.runner import budget_tag, load_results
from mixture_of_depths.studies.verdict import Verdict

from ..isoflop.study import findings, format_findings
from .planning import LEARNED, MOD, Round2Settings, mean_of, mod_arm, plan, winner
from .plots import plot_diagnosis, plot_grid
from .verdicts import fill, size_verdicts, tag_of, verdicts


# -- tables ----------------------------------------------------------------------------------------
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


def ablation_table(
    results: list[dict[str, Any]], group: str = "ablation", found: dict[str, Verdict] | None = None
) -> list[str]:
    """A group's table, each variant against the reference (aux loss 0.1 for the ablations,
    dense for the longer runs) with its verdict's word from `found`, then the verdicts' texts
    (the reference's and the pairs the diagnosis compares)."""
    groups = _ablation_rows(results, group)
    if not groups:
        return []
    ref = dict(groups).get(LEARNED[0][0] if group == "ablation" else "dense")
    ref_loss = mean_of(ref, "val_loss_causal") if ref else None
    vs_what = "aux 0.1" if group == "ablation" else "dense"
    prefix = "abl-" if group == "ablation" else "long-"
    found = found or {}
    lines = [
        f"| variant | seeds | loss top-k | loss causal | seed spread | vs {vs_what} (causal) | "
        f"verdict vs {vs_what} | causal take-rate | the paper's routing acc. | "
        "tokens taking no block | "
        "newline share of takes (their share of the text) | Spearman's rho, blocks taken vs "
        "entropy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, rows in groups:
        causal = mean_of(rows, "val_loss_causal")
        spread = max(r["val_loss_causal"] for r in rows) - min(r["val_loss_causal"] for r in rows)
        vs = "" if ref_loss is None else f"{100 * (causal - ref_loss) / ref_loss:+.2f}%"
        word = found[key].word if (key := prefix + tag_of(rows[0])) in found else ""
        take = [t for t in map(_take_rate, rows) if t is not None]
        acc = [
            r["routing_accuracy_mean"] for r in rows if r.get("routing_accuracy_mean") is not None
        ]
        none, nl, rho = _profile_cells([r["profile"] for r in rows if "profile" in r])
        spread_text = f"{spread:.4f}" if len(rows) > 1 else "-"
        lines.append(
            f"| {label} | {len(rows)} | {mean_of(rows, 'val_loss_topk'):.4f} | {causal:.4f} | "
            f"{spread_text} | {vs} | {word} | {f'{sum(take) / len(take):.1%}' if take else ''} | "
            f"{f'{sum(acc) / len(acc):.1%}' if acc else ''} | {none} | {nl} | {rho} |"
        )
    texts = [f"- {v.text()}." for k, v in found.items() if k.startswith(prefix)]
    return [*lines, *([""] + texts if texts else [])]


def _profile_cells(prof: list[dict[str, Any]]) -> tuple[str, str, str]:
    """The routing profile's three cells, each seed's ("seed 0 / seed 1"); blank without one."""
    if not prof:
        return "", "", ""
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
    return none, nl, rho


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


def size_for_size(rows: list[dict[str, Any]], sizes: list[str]) -> list[str]:
    """MoD against the dense model of the same size, per budget (one context's grid rows): the
    causal loss's change, how many more steps MoD's budget buys, and the verdict's word; then
    the verdicts' texts. [] before any pair."""
    by: dict[tuple[float, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        arch, size = r["label"].split(" ", 1)
        by.setdefault((r["budget"], arch, size), []).append(r)
    budgets = sorted({b for b, _, _ in by})
    seq_len = rows[0]["seq_len"] if rows else 0
    found = size_verdicts(rows, seq_len)
    body = []
    for b in budgets:
        cells = []
        for size in sizes:
            mod, dense = by.get((b, "MoD", size)), by.get((b, "dense", size))
            if not mod or not dense:
                cells.append("")
                continue
            m, d = mean_of(mod, "val_loss_causal"), mean_of(dense, "val_loss_causal")
            steps = mean_of(mod, "steps") / mean_of(dense, "steps")
            word = found[f"ctx{seq_len}-{budget_tag(b)}-size-{size}"].word
            cells.append(f"{100 * (m - d) / d:+.1f}%, {steps:.2f}x, {word}")
        if any(cells):
            body.append(f"| {b:.1e} | " + " | ".join(cells) + " |")
    if not body:
        return []
    return [
        "Size for size: MoD's causal loss against the dense model of the same size, the steps "
        "MoD's budget buys against dense's, and the verdict (the size is the pairing's, not a "
        "grid's best: no edge):",
        "",
        "| budget | " + " | ".join(sizes) + " |",
        "|---|" + "---|" * len(sizes),
        *body,
        "",
        *(f"- {key.split('-')[1]} FLOPs: {v.text()}." for key, v in found.items()),
    ]


def summary_table(
    results: list[dict[str, Any]], s: Round2Settings, found: dict[str, Verdict] | None = None
) -> list[str]:
    """The headline, one row per budget and context (the README's table), each with its
    verdict's word, then the verdicts' texts; [] before any. `found`: the round's verdicts
    (default: computed here)."""
    found = verdicts(results, s) if found is None else found
    lines, texts = [], []
    for budget in s.grid.budgets:
        for seq_len, _ in s.contexts:
            rows = [
                r
                for r in results
                if r["group"] in ("isoflop", "seed")
                and r["seq_len"] == seq_len
                and r["budget"] == budget
            ]
            for b in findings(rows)["budgets"]:
                d, m = b["best_dense"], b["best_mod"]
                v = found[f"ctx{seq_len}-{b['verdict']}"]
                spread = "-" if b["seed_spread"] is None else f"{b['seed_spread']:.3f}"
                lines.append(
                    f"| {seq_len} | {budget:.1e} | {d['label']} ({d['params'] / 1e6:.2f}M): "
                    f"{d['val_loss']:.4f} | {m['label']} ({m['params'] / 1e6:.2f}M): "
                    f"{m['val_loss_causal']:.4f} ({m['val_loss_topk']:.4f}) | "
                    f"{-100 * b['mod_gain']:+.1f}% loss | {spread} | {v.word} |"
                )
                texts.append(f"- {seq_len} tokens, {budget:.1e} FLOPs: {v.text()}.")
    if not lines:
        return []
    return [
        "| context | training FLOPs | best dense: loss | best MoD: loss causal (top-k) | "
        "MoD vs dense | seed spread | verdict |",
        "|---|---|---|---|---|---|---|",
        *lines,
        "",
        *texts,
    ]


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


# -- the report ------------------------------------------------------------------------------------
def write_report(results: list[dict[str, Any]], out: Path, s: Round2Settings) -> None:
    """``report.md``, ``findings.json`` (the verdicts by key) and the figures, from the results
    so far (and ``notes.md``, if present, its verdict quotes filled from the results)."""
    found = verdicts(results, s)
    lines = [
        *_intro(out, {k: v.text() for k, v in found.items()}),
        *_ablation_section(results, s, found),
        *_summary_section(results, s, found),
        *_context_sections(results, s),
        *_gpu_section(out, found),
        *_progress(results, s),
    ]
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    win, arm = winner(results), mod_arm(results)
    summary = {
        "winner": None if win is None else win[0],
        "mod_arm": None if arm is None else arm[0],
        "verdicts": {k: v.as_dict() for k, v in found.items()},
    }
    atomic_write_text(out / "findings.json", json_text(summary, indent=1) + "\n")
    try:
        plot_diagnosis(results, out)
        if any(r["group"] in ("isoflop", "seed") for r in results):
            plot_grid(results, out, s.contexts)
    except Exception as exc:  # plots are a convenience; the results are saved
        print(f"note: plots failed: {exc!r}")


def _intro(out: Path, texts: dict[str, str]) -> list[str]:
    lines = [
        "# The isoFLOP study, second round: fair baselines, BPE tokens, longer context",
        "",
        "BPE tokens (vocabulary 4096, trained once on the training split of the default corpus "
        "and cached), 4096 tokens per step. MoD: every other block routed, capacity 12.5%. "
        "Losses are validation losses in nats per token; MoD runs are judged by the causal loss "
        "(what generation gets). Each run trains for the most steps its budget buys, FLOPs from "
        "`estimate_flops` (a capacity warm-up's extra FLOPs charged). Generated by "
        "`mod study experiments/round2`; the first round is `experiments/isoflop/report.md`. "
        "Every verdict is `mixture_of_depths.studies.verdict`'s (findings.json has each by key): "
        "a winner only beyond the seed spread, with both best sizes inside the sizes tried and "
        "the baseline's learning rate bracketed, which no dense model here has (it trained at "
        "2e-3 alone).",
        "",
    ]
    notes = out / "notes.md"
    if notes.exists():
        lines += [fill(notes.read_text().strip(), texts), ""]
    return lines


def _ablation_section(
    results: list[dict[str, Any]], s: Round2Settings, found: dict[str, Verdict]
) -> list[str]:
    """Phase 1: the ablation table, the tokens taken, the winner and the longer runs."""
    g = s.grid
    size = dict(g.sizes)[g.ablation_size]
    lines = [
        f"## Routing ablations ({s.ablation_budget:.1e} FLOPs, size {g.ablation_size}: "
        f"d_model {size['d_model']}, {size['n_layers']} layers; {s.contexts[0][0]} tokens of "
        "context)",
        "",
        "Random routing's causal decision takes each token with the capacity's probability (or "
        "the aux-loss model's measured rates), so its compute matches learned routing's in both "
        "modes. Causal take-rate: the share of tokens a routed block takes in causal mode (the "
        f"capacity is {MOD['capacity']:.1%}); the paper's routing accuracy: how often that "
        "decision agrees with top-k (a router that takes no token scores 1 - capacity; these "
        "runs logged no recall or precision of the top-k set). The "
        "routing profile (last three columns) is each seed's (seed 0 / seed 1), on held-out "
        "text, in causal mode; rho near 0 means the blocks a token takes say nothing about how "
        "unsure the model is of the next token.",
        "",
        *ablation_table(results, "ablation", found),
        "",
        *top_tokens(results),
        "![routing during training](diagnosis.png)",
        "",
    ]
    win = winner(results)
    if win is not None:
        lines += [
            f"The grid's causal router, the learned router with the lowest mean causal loss: "
            f"**{win[0]}**. Against the next lowest: {found['winner'].text()}.",
            "",
        ]
    arm = mod_arm(results)
    if arm is not None:
        kept = "the warm-up kept where its mean causal loss is the lower"
        why = f" ({kept}: {found['mod-arm'].text()})" if "mod-arm" in found else ""
        lines += [f"MoD arm of the longer runs and the grid: **{arm[0]}**{why}.", ""]
    longer = ablation_table(results, "longer", found)
    if longer:
        lines += [
            f"### Trained longer: {s.long_budget:.1e} FLOPs, the same size",
            "",
            "Does learned routing pull away from random routing with more training?",
            "",
            *longer,
            "",
        ]
    if "random-drastically-worse" in found:
        lines += [f"The paper's claim: {found['random-drastically-worse'].text()}.", ""]
    return lines


def _summary_section(
    results: list[dict[str, Any]], s: Round2Settings, found: dict[str, Verdict]
) -> list[str]:
    summary = summary_table(results, s, found)
    if not summary:
        return []
    return [
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


def _context_sections(results: list[dict[str, Any]], s: Round2Settings) -> list[str]:
    """Phase 2, per context: the headline, size for size, loss by place, and every run."""
    lines: list[str] = []
    for seq_len, batch in s.contexts:
        rows = [r for r in results if r["group"] in ("isoflop", "seed") and r["seq_len"] == seq_len]
        if not rows:
            continue
        head = format_findings(findings(rows))
        lines += [f"## isoFLOP grid, {seq_len} tokens of context (batch {batch})", ""]
        lines += [ln.replace("## Headline", "### Headline") for ln in head]
        pairs = size_for_size(rows, [n for n, _ in s.grid.sizes])
        if pairs:
            lines += ["", *pairs]
        places = position_table(rows)
        if places:
            lines += ["", *places]
        lines += [
            "",
            "| model | seed | budget | params | FLOPs/fwd token | steps | val loss top-k | "
            "val loss causal | the paper's routing acc. | train tok/s |",
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
    return lines


def _gpu_section(out: Path, found: dict[str, Verdict]) -> list[str]:
    """The round-2 GPU runs (of the script `studies.gpu` replaced), from
    ``<out>/gpu/results.jsonl``, or why there are none; and the claim about scale."""
    gpu = out / "gpu" / "results.jsonl"
    rows = load_results(gpu) if gpu.exists() else []
    budgets = ", ".join(f"{b:.0e}" for b in sorted({r["budget"] for r in rows})) or "1e16, 3e16"
    lines = [f"## On a GPU ({budgets} FLOPs, bf16)", ""]
    if rows:
        lines += [f"From `mod study experiments/gpu` ({len(rows)} runs):", ""]
        lines += format_findings(findings(rows))[2:]
    else:
        lines.append(
            "Not run, and withdrawn: at 1e16 and 3e16 FLOPs this comparison would read 75-230M "
            "tokens of the default corpus's 9.2M (BPE), many epochs of the same text. "
            "`mod study experiments/gpu` now reruns round 3's deciding arms on one "
            "GPU instead, at most one epoch each, into `experiments/gpu/` (docs/bench.md, "
            "GPU); rows found in `gpu/results.jsonl` beside this report would be shown here."
        )
    if "advantage-grows-with-scale" in found:
        lines += ["", f"Scale: {found['advantage-grows-with-scale'].text()}."]
    return lines


def _progress(results: list[dict[str, Any]], s: Round2Settings) -> list[str]:
    planned = plan(s, results)
    left = [sp.name for sp in planned if sp.name not in {r["name"] for r in results}]
    return [
        "",
        f"Progress: {len(results)} runs done" + (
            f", {len(left)} planned next (more follow from their results)." if left else "."
        ),
    ]  # fmt: skip
