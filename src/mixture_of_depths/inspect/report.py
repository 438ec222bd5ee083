"""The numbers of `mod inspect` as markdown (report.md), and the one self-contained page
(index.html) that shows the text coloured by the routed blocks each token took."""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path
from typing import Any

from ..probes import REACH_FAR
from .analysis import (
    Report,
    interval_text,
    loss_by,
    loss_by_run,
    rho_text,
    variance_ratio_text,
)
from .stats import mean_interval


def report_md(
    report: Report,
    classes: dict | None,
    extreme: dict | None,
    decode: Any = None,
    copy: dict | None = None,
    reach: list[dict] | None = None,
) -> str:
    """The numbers, as markdown (with `copy`, a `probes.copy_probe` result, and `reach`, a
    `probes.attention_reach` result: their sections)."""
    lines = [
        "# Where the compute went",
        "",
        f"{len(report.tokens)} held-out tokens, {len(report.router_names)} routers.",
        "",
        *_routing_tables(report),
        *_loss_tables(report),
        "",
        *_correlations(report),
    ]
    if classes:
        lines += _class_table(report, classes)
    if copy is not None:
        lines += _copy_section(copy)
    if reach:
        lines += _reach_section(reach)
    if extreme:
        for side in ("most", "least"):
            lines += [
                "",
                f"{side} routed tokens (id, mean blocks taken, count): "
                + ", ".join(
                    f"{decode(i) if decode else repr(i)} {m:.2f} ({n})" for i, m, n in extreme[side]
                ),
            ]
    return "\n".join(lines) + "\n"


def _routing_tables(report: Report) -> list[str]:
    """Take-rates, recall and precision of the top-k set and the paper's agreement per router;
    blocks taken against independent coins."""
    lines = [
        "| router | take-rate (causal) | recall of top-k | precision | causal agrees with top-k "
        "(the paper's accuracy) |",
        "|---|---|---|---|---|",
    ]
    for nm in report.router_names:
        sc = report.scores[nm]
        recall, precision = (  # NaN: no token in the top-k set, or none taken
            "n/a" if v != v else f"{v:.3f}" for v in (sc["recall"], sc["precision"])
        )
        lines.append(
            f"| {nm} | {report.take_rate[nm]:.3f} | {recall} | {precision} | "
            f"{report.agreement[nm]:.3f} |"
        )
    lines += ["", "| blocks taken | tokens | independent coins |", "|---|---|---|"]
    lines += [
        f"| {k} | {int(report.depth_hist[k])} | {float(report.independent_hist[k]):.1f} |"
        for k in range(len(report.depth_hist))
    ]
    ind = report.independence
    if ind:
        lines += [
            "",
            f"Against independent coins at the same per-router rates: variance of blocks taken "
            f"{variance_ratio_text(report)} (1: independent; above 1: "
            f"routers pick the same tokens; below: they share them out); total variation distance "
            f"{ind['total_variation']:.3f}; permutation test p = {ind['p_value']:.4f} "
            f"({ind['permutations']} shuffles of each router's decisions).",
        ]
    return lines


def _loss_tables(report: Report) -> list[str]:
    """Loss by longest skip run and by blocks taken (with a baseline: its loss and the excess)."""
    lines: list[str] = []
    excess = report.baseline_loss is not None
    for title, table in (
        ("longest skip run", loss_by_run(report)),
        ("blocks taken", loss_by(report, report.depth)),
    ):
        head = f"| {title} | tokens | mean loss |"
        if excess:
            head += " baseline's loss | excess (95% interval) |"
        lines += ["", head, "|---|---|---|" + ("---|---|" if excess else "")]
        for k, v in table.items():
            row = f"| {k} | {v['tokens']} | {v['mean_loss']:.4f} |"
            if excess:
                row += (
                    f" {v['mean_baseline_loss']:.4f} | {v['mean_excess']:+.4f} "
                    f"{_half_width(v['excess_half_width'])} |"
                )
            lines.append(row)
    if excess:
        ok = ~report.loss.isnan()
        mean, half = mean_interval(report.excess[ok], report.row[ok])
        lines += [
            "",
            f"All tokens: excess loss over the baseline {mean:+.4f} {_half_width(half)}. Intervals "
            "are 95%, clustered by row (tokens of one row are not independent).",
        ]
    return lines


def _half_width(half: float) -> str:
    """An interval's half-width in brackets, or why there is none (one row: no spread of rows)."""
    return f"(±{half:.4f})" if half == half else "(no interval: one row)"


def _correlations(report: Report) -> list[str]:
    lines = []
    for key in ("depth_vs_entropy", "depth_vs_loss", "depth_vs_baseline_loss"):
        if key not in report.correlations:
            continue
        v = report.correlations[key]
        name = key.replace("_", " ")
        if v["rho"] != v["rho"]:  # NaN: say why, with no interval of NaNs
            lines.append(f"- {name}: Spearman rho {rho_text(report, key)} (n = {v['n']})")
            continue
        interval = interval_text(report, key)
        lines.append(f"- {name}: Spearman rho {v['rho']:+.4f} ({interval}, n = {v['n']})")
    return lines


def _copy_section(copy: dict) -> list[str]:
    """The copy probe: the score, both copies' losses, and each router's take-rate on each."""
    lines = [
        "",
        "## In-context copying (the copy probe)",
        "",
        f"Random tokens, then the same again: loss on the first copy {copy['loss_first']:.4f}, "
        f"on the second {copy['loss_second']:.4f}, score {copy['score']:+.4f} nats (0: the "
        "model does not copy from its context; up to ln V when it copies perfectly).",
    ]
    if copy.get("take_first"):
        lines += ["", "| router | take-rate, first copy | second copy |", "|---|---|---|"]
        lines += [
            f"| {k} | {copy['take_first'][k]:.3f} | {copy['take_second'][k]:.3f} |"
            for k in copy["take_first"]
        ]
    return lines


def _reach_section(reach: list[dict]) -> list[str]:
    """How far back each attention call looks on the inspected text."""
    lines = [
        "",
        "## How far back attention looks",
        "",
        "On the inspected text, causal routing; per attention call, averaged over the queries at "
        f"places >= {REACH_FAR} (a routed layer: its takers): the mean distance back of the "
        f"attention weight, and its share on keys {REACH_FAR} or more places back. A recursive "
        "model's shared layers appear once per application (`layer.n`: its n-th after the first).",
        "",
        f"| layer | routed | queries | mean distance back | share >= {REACH_FAR} back | per head |",
        "|---|---|---|---|---|---|",
    ]
    for r in reach:
        name = f"{r['layer']}" + (f".{r['call']}" if r["call"] else "")
        if r["far_share"] is None:
            lines.append(f"| {name} | {'yes' if r['routed'] else 'no'} | 0 | | | |")
            continue
        heads = " / ".join(f"{h:.2f}" for h in r["far_share_heads"])
        lines.append(
            f"| {name} | {'yes' if r['routed'] else 'no'} | {r['queries']} | "
            f"{r['mean_distance']:.1f} | {r['far_share']:.3f} | {heads} |"
        )
    return lines


def report_json(
    report: Report, copy: dict | None = None, reach: list[dict] | None = None
) -> dict[str, Any]:
    """The numbers of report.md that are not per token, as one JSON-ready dict (report.json)."""
    return {
        "tool": "mod inspect",  # first, so a later run recognises the file as its own
        "tokens": len(report.tokens),
        "routers": list(report.router_names),
        "take_rate": dict(report.take_rate),
        "agreement": dict(report.agreement),
        "recall": {k: v["recall"] for k, v in report.scores.items()},
        "precision": {k: v["precision"] for k, v in report.scores.items()},
        "blocks_taken": [int(n) for n in report.depth_hist],
        "independent_coins": [float(n) for n in report.independent_hist],
        "independence": dict(report.independence),
        "correlations": {k: dict(v) for k, v in report.correlations.items()},
        "copy_probe": copy,
        "attention_reach": reach,
    }


def _class_table(report: Report, classes: dict) -> list[str]:
    lines = [
        "",
        "| class | tokens | " + " | ".join(f"L{n}" for n in report.router_names) + " |",
        "|---|---|" + "---|" * len(report.router_names),
    ]
    for name, row in classes.items():
        lines.append(
            f"| {name} | {row['tokens']} | "
            + " | ".join(f"{row[n]:.3f}" for n in report.router_names)
            + " |"
        )
    return lines


# -- the page --------------------------------------------------------------------------------------
_DEPTH_COLORS = ("#ffffff", "#e5f5e0", "#a1d99b", "#41ab5d", "#006d2c", "#00441b")


def _depth_color(depth: int, routers: int) -> str:
    top = len(_DEPTH_COLORS) - 1
    return _DEPTH_COLORS[min(top, round(depth * top / max(routers, 1)))]


def html_page(
    report: Report, decode: Any, images: dict[str, Path], numbers: str, show: int = 4096
) -> str:
    """One self-contained page (no network): the text coloured by routed blocks taken (causal),
    each token's per-router decisions and weights on hover (the first `show` tokens: the
    numbers cover them all), the pictures inlined, the numbers."""

    R = len(report.router_names)
    spans = []
    shown_tokens = report.tokens.tolist()[:show]
    for i, tok in enumerate(shown_tokens):
        depth = int(report.taken[i].sum())
        color = _depth_color(depth, R)
        hover = []
        for j, nm in enumerate(report.router_names):
            act = "take" if report.taken[i, j] else "skip"
            topk = ", top-k takes" if report.taken_topk[i, j] else ""
            hover.append(f"L{nm}: {act} (r = {float(report.weights[i, j]):+.2f}{topk})")
        hover.append(f"entropy {float(report.entropy[i]):.2f}, loss {float(report.loss[i]):.2f}")
        text = decode(tok)
        shown = html.escape(text).replace("\n", "&#8629;<br>").replace(" ", "&nbsp;")
        spans.append(
            f'<span class="tok" data-depth="{depth}" style="background:{color}" '
            f'title="{html.escape(chr(10).join(hover))}">{shown or "&#9633;"}</span>'
        )
    pictures = "".join(
        f'<figure><img alt="{name}" src="data:image/png;base64,'
        f'{base64.b64encode(path.read_bytes()).decode()}"><figcaption>{name}</figcaption></figure>'
        for name, path in images.items()
    )
    legend = "".join(
        f'<span class="key" style="background:{_depth_color(d, R)}">{d}</span>'
        for d in range(R + 1)
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>mod inspect</title><style>"
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto}"
        ".text{font-family:monospace;line-height:1.7;border:1px solid #ccc;padding:1em}"
        ".tok{border-radius:2px}.key{display:inline-block;width:2em;text-align:center;"
        "border:1px solid #999;margin-right:2px}img{max-width:100%}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;"
        "padding:2px 8px;text-align:right}th{background:#f3f3f3}"
        "</style></head><body><h1>Where the compute went</h1>"
        f"<p>Routed blocks each token took (causal routing), 0 to {R}: {legend}. "
        "Hover a token for each router's decision and weight."
        + (
            f" The first {len(shown_tokens)} of {len(report.tokens)} tokens."
            if len(shown_tokens) < len(report.tokens)
            else ""
        )
        + "</p>"
        f'<div class="text">{"".join(spans)}</div>{pictures}'
        f'<div class="numbers">{markdown_html(numbers)}</div></body></html>\n'
    )


def markdown_html(text: str) -> str:
    """The markdown `report_md` writes (headings, tables, bullets, paragraphs, code spans) as
    HTML, so the page shows its tables as tables (no markdown library: the page needs none)."""
    out: list[str] = []
    inline = lambda t: re.sub(r"`([^`]*)`", r"<code>\1</code>", html.escape(t))  # noqa: E731
    for block in re.split(r"\n\s*\n", text.strip()):
        lines = block.splitlines()
        if all(ln.startswith("|") for ln in lines):
            cells = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines]
            body = [r for r in cells[1:] if not all(set(c) <= set("-: ") for c in r)]
            row = lambda r, tag: "<tr>" + "".join(f"<{tag}>{inline(c)}</{tag}>" for c in r)  # noqa: E731
            out.append(f"<table>{row(cells[0], 'th')}{''.join(row(r, 'td') for r in body)}</table>")
        elif lines[0].startswith("#"):
            level = min(len(lines[0]) - len(lines[0].lstrip("#")) + 1, 6)  # the page's h1 is above
            out.append(f"<h{level}>{inline(lines[0].lstrip('# '))}</h{level}>")
            if lines[1:]:
                out.append(markdown_html("\n".join(lines[1:])))
        elif all(ln.startswith("- ") for ln in lines):
            out.append("<ul>" + "".join(f"<li>{inline(ln[2:])}</li>" for ln in lines) + "</ul>")
        else:
            out.append(f"<p>{inline(' '.join(lines))}</p>")
    return "\n".join(out)
