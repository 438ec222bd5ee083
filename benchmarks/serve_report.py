"""What benchmarks/serve.py makes of its runs: medians and spreads over the repeats, the ratios
computed per repeat, the issue's targets beside the measured medians (printed, never asserted),
the tables, the plot, and the profile's tables (docs/serving.md, "Measured").

Spreads are min-max over the repeats (with three repeats an interquartile range says nothing).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from serve_profile import DECODE, PREFILL

METRICS = (
    "throughput_tok_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "kv_bytes_mean",
    "kv_bytes_peak",
    "kv_bytes_per_token",
    "client_late_max_s",
)
PAIRS = {
    "mod_over_dense": ("mod/continuous", "dense/continuous"),
    "mod_over_dense_static": ("mod/static", "dense/static"),
    "continuous_over_static": ("mod/continuous", "mod/static"),
    "dense_continuous_over_static": ("dense/continuous", "dense/static"),
}
RATIO_METRICS = ("throughput_tok_s", "ttft_p99_s", "tpot_p50_s", "kv_bytes_per_token")
# The targets (54, item 3): printed beside the medians, never asserted.
THROUGHPUT_TARGET = {"small": 1.3, "base": 1.5}  # MoD / dense, saturated, continuous
KEEP_TARGET = 0.9  # of the model's own decode ratio at the server's batch size
TTFT_TARGET = 1 / 3  # continuous / static TTFT p99 at the highest rate static sustains
KV_TARGET = 0.6  # MoD / dense KV bytes per token held
SUSTAIN = 0.9  # a rate is sustained when the throughput is at least this share of the offered


def spread(values: list[float | None]) -> dict[str, Any]:
    """Median, min and max of the values given (None: not measured), and the values."""
    xs = [v for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0, "values": values}
    return {
        "median": statistics.median(xs),
        "min": min(xs),
        "max": max(xs),
        "n": len(xs),
        "values": values,
    }


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def aggregate(runs: dict[str, dict[str, list[dict]]]) -> dict[str, dict[str, dict]]:
    """Per configuration, rate and metric: the spread over the repeats."""
    return {
        cfg: {rate: {m: spread([r[m] for r in rows]) for m in METRICS} for rate, rows in by.items()}
        for cfg, by in runs.items()
    }


def saturated(by_rate: dict[str, list[dict]], k: int) -> float | None:
    """Repeat k's best throughput over the rates (saturation)."""
    xs = [rows[k]["throughput_tok_s"] for rows in by_rate.values() if k < len(rows)]
    xs = [x for x in xs if x is not None]
    return max(xs) if xs else None


def ratios(runs: dict[str, dict[str, list[dict]]]) -> dict[str, Any]:
    """Each pair's a / b per repeat (the same round's runs), at each rate and saturated."""
    out: dict[str, Any] = {}
    for label, (a, b) in PAIRS.items():
        if a not in runs or b not in runs:
            continue
        ra, rb = runs[a], runs[b]
        n = min(len(rows) for rows in (*ra.values(), *rb.values()))
        per_rate = {
            rate: {
                m: spread([_div(ra[rate][k][m], rb[rate][k][m]) for k in range(n)])
                for m in RATIO_METRICS
            }
            for rate in ra
            if rate in rb
        }
        sat = [_div(saturated(ra, k), saturated(rb, k)) for k in range(n)]
        kv = [
            max(
                (
                    x
                    for x in (per_rate[r]["kv_bytes_per_token"]["values"][k] for r in per_rate)
                    if x is not None
                ),
                default=None,
            )
            for k in range(n)
        ]
        out[label] = {
            "per_rate": per_rate,
            "saturated_throughput": spread(sat),
            "kv_bytes_per_token_worst_rate": spread(kv),
        }
    return out


def model_ratio_at(model: dict | list[dict] | None, k: int, batch: int) -> float | None:
    """The model's own MoD / dense decode ratio at `batch`: round k's, or the file's."""
    if model is None:
        return None
    one = model[min(k, len(model) - 1)] if isinstance(model, list) else model
    return one["ratios"].get(str(batch))


def keeps(runs: dict, model: dict | list[dict] | None, batch: int) -> dict[str, Any] | None:
    """The share of the model's decode ratio at `batch` the server keeps, per repeat: its
    saturated throughput ratio (MoD / dense, continuous), and its decode-step ratio (dense's
    TPOT p50 over MoD's at the highest rate)."""
    a, b = PAIRS["mod_over_dense"]
    if model is None or a not in runs or b not in runs:
        return None
    n = min(len(rows) for rows in (*runs[a].values(), *runs[b].values()))
    top = list(runs[a])[-1]
    thr, tpot = [], []
    for k in range(n):
        m = model_ratio_at(model, k, batch)
        thr.append(_div(_div(saturated(runs[a], k), saturated(runs[b], k)), m))
        step = _div(runs[b][top][k]["tpot_p50_s"], runs[a][top][k]["tpot_p50_s"])
        tpot.append(_div(step, m))
    models = [model_ratio_at(model, k, batch) for k in range(n)]
    return {
        "batch": batch,
        "model_ratio": spread(models),
        "throughput": spread(thr),
        "tpot": spread(tpot),
        "tpot_rate": top,
    }


def sustained(results: dict, cfg: str, offered: dict[str, float]) -> str | None:
    """The highest finite rate at which `cfg`'s median throughput is at least SUSTAIN of the
    offered token rate (the schedule's tokens over its arrival span)."""
    best = None
    for rate, row in results.get(cfg, {}).items():
        thr = row["throughput_tok_s"]["median"]
        if rate != "inf" and thr is not None and thr >= SUSTAIN * offered.get(rate, math.inf):
            if best is None or float(rate) > float(best):
                best = rate
    return best


def _target(what: str, op: str, target: float | None, s: dict | None) -> dict[str, Any]:
    med = None if s is None else s["median"]
    side = None
    if med is not None and target is not None:
        side = med >= target if op == ">=" else med <= target
    return {
        "what": what,
        "op": op,
        "target": target,
        "median": med,
        "min": None if s is None else s["min"],
        "max": None if s is None else s["max"],
        "median_on_target_side": side,
    }


def targets(
    results: dict, rat: dict, keep: dict | None, offered: dict, preset: str | None, max_rows: int
) -> list[dict[str, Any]]:
    """The issue's targets, each beside its measured median and spread."""
    out = []
    if "mod_over_dense" in rat:
        t = THROUGHPUT_TARGET.get(preset or "")
        what = f"MoD/dense saturated throughput, continuous ({preset or 'preset unknown'}"
        what += ", max_rows 64)" if preset == "base" else ")"
        if preset == "base" and max_rows != 64:
            what += f" [the target is for --max-rows 64; this run: {max_rows}]"
        out.append(_target(what, ">=", t, rat["mod_over_dense"]["saturated_throughput"]))
    if keep is not None:
        what = f"server keeps of the model's decode ratio at batch {keep['batch']} (throughput)"
        out.append(_target(what, ">=", KEEP_TARGET, keep["throughput"]))
    for label, model in (
        ("continuous_over_static", "MoD"),
        ("dense_continuous_over_static", "dense"),
    ):
        if label not in rat:
            continue
        for rate, r in rat[label]["per_rate"].items():
            what = f"{model} continuous/static throughput at rate {rate}"
            out.append(_target(what, ">=", 1.0, r["throughput_tok_s"]))
        static = PAIRS[label][1]
        top = sustained(results, static, offered)
        what = f"{model} continuous/static TTFT p99 at the highest rate static sustains"
        if top is None:
            out.append(_target(what + " (none of the rates)", "<=", TTFT_TARGET, None))
        else:
            s = rat[label]["per_rate"][top]["ttft_p99_s"]
            out.append(_target(f"{what} ({top})", "<=", TTFT_TARGET, s))
    if "mod_over_dense" in rat:
        what = "MoD/dense KV bytes per token held, continuous, worst rate"
        out.append(
            _target(what, "<=", KV_TARGET, rat["mod_over_dense"]["kv_bytes_per_token_worst_rate"])
        )
    return out


# -- printing -------------------------------------------------------------------------------------
def _kib(x: float) -> str:
    return f"{x / 1024:.2f}"


# (metric, title, unit, format of one value)
TABLES = (
    ("throughput_tok_s", "throughput", "tok/s", lambda x: f"{x:.1f}"),
    ("ttft_p50_s", "TTFT p50", "ms", lambda x: f"{1e3 * x:.0f}"),
    ("ttft_p99_s", "TTFT p99", "ms", lambda x: f"{1e3 * x:.0f}"),
    ("tpot_p50_s", "TPOT p50", "ms", lambda x: f"{1e3 * x:.1f}"),
    ("tpot_p99_s", "TPOT p99", "ms", lambda x: f"{1e3 * x:.1f}"),
    ("kv_bytes_mean", "KV bytes in use, mean", "KiB", _kib),
    ("kv_bytes_per_token", "KV bytes per token held", "KiB", _kib),
)


def cell(s: dict | None, fmt: Any) -> str:
    """ "median [min-max]", or "-" where nothing was measured."""
    if s is None or s["median"] is None:
        return "-"
    if s["n"] == 1:
        return fmt(s["median"])
    return f"{fmt(s['median'])} [{fmt(s['min'])}-{fmt(s['max'])}]"


def _grid(title: str, rows: dict[str, dict[str, str]], rates: list[str]) -> None:
    width = max([len(c) for r in rows.values() for c in r.values()] + [len(x) for x in rates]) + 2
    label_w = max(len(k) for k in rows) + 2 if rows else 20
    print(f"\n{title}")
    print(f"{'':<{label_w}}" + "".join(f"{r:>{width}}" for r in rates))
    for name, cells in rows.items():
        print(f"{name:<{label_w}}" + "".join(f"{cells.get(r, '-'):>{width}}" for r in rates))


def print_tables(results: dict, rat: dict, rates: list[str], repeats: int) -> None:
    """A table per metric (configurations by rate), then one per ratio."""
    print(f"\nmedian [min-max] over {repeats} repeats, by request rate (req/s; inf: all at once)")
    for metric, title, unit, fmt in TABLES:
        rows = {cfg: {r: cell(by[r][metric], fmt) for r in by} for cfg, by in results.items()}
        _grid(f"{title} ({unit})", rows, rates)
    x = lambda v: f"{v:.2f}"  # noqa: E731
    for metric in RATIO_METRICS:
        rows = {}
        for label, r in rat.items():
            rows[label] = {rate: cell(v[metric], x) for rate, v in r["per_rate"].items()}
            if metric == "throughput_tok_s":
                rows[label]["saturated"] = cell(r["saturated_throughput"], x)
        cols = rates + (["saturated"] if metric == "throughput_tok_s" else [])
        _grid(f"ratio of {metric}, a/b per repeat (x)", rows, cols)


def print_targets(rows: list[dict], keep: dict | None) -> None:
    if keep is not None:
        x = lambda v: f"{v:.2f}"  # noqa: E731
        print(
            f"\nthe model's own decode ratio (MoD/dense tokens/s) at batch {keep['batch']}: "
            f"{cell(keep['model_ratio'], x)}; the server keeps {cell(keep['throughput'], x)} "
            f"of it in saturated throughput, {cell(keep['tpot'], x)} in TPOT p50 at rate "
            f"{keep['tpot_rate']}"
        )
    print("\ntargets (issue 54, item 3), beside the measured median [min-max]; not asserted")
    w = max(len(r["what"]) for r in rows) + 2 if rows else 10
    for r in rows:
        t = "-" if r["target"] is None else f"{r['op']} {r['target']:.2f}"
        got = cell(
            {"median": r["median"], "min": r["min"], "max": r["max"], "n": 2}, lambda v: f"{v:.2f}"
        )
        side = {True: "yes", False: "no", None: "-"}[r["median_on_target_side"]]
        print(
            f"  {r['what']:<{w}} target {t:<8} median {got:<20} median on the target's side: {side}"
        )


def plot(results: dict, path: str) -> None:
    """Throughput, TTFT p50 and TPOT p50 against the rate: medians, min-max bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = (
        ("throughput_tok_s", 1.0, "throughput (tokens/s)"),
        ("ttft_p50_s", 1e3, "time to first token, p50 (ms)"),
        ("tpot_p50_s", 1e3, "time per output token, p50 (ms)"),
    )
    for name, rows in results.items():
        keys = list(rows)
        xs = list(range(len(keys)))
        for ax, (key, scale, label) in zip(axes, panels, strict=True):
            s = [rows[k][key] for k in keys]
            med = [math.nan if v["median"] is None else v["median"] * scale for v in s]
            lo = [0.0 if v["median"] is None else (v["median"] - v["min"]) * scale for v in s]
            hi = [0.0 if v["median"] is None else (v["max"] - v["median"]) * scale for v in s]
            ax.errorbar(
                xs,
                med,
                yerr=[lo, hi],
                marker="o",
                capsize=3,
                label=name,
                linestyle="-" if "mod" in name else "--",
            )
            ax.set_xticks(xs, [k if k != "inf" else "all at once" for k in keys])
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle("mod serve under an open-loop load, median and min-max (benchmarks/serve.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the profile ----------------------------------------------------------------------------------
def profile_head(n: str, p: dict) -> list[str]:
    """What one server's engine did over the profile's window, in three lines."""
    w = p.get("window", {})
    f = lambda k: "-" if w.get(k) is None else f"{w[k]:.2f}"  # noqa: E731
    http = None
    if w.get("process_cpu") is not None and w.get("engine_cpu") is not None:
        http = w["process_cpu"] - w["engine_cpu"]
    share = p.get("stepping_share")
    return [
        f"{n}: {p['clean_steps']} steps timed by phase, {p['profiled_steps']} under cProfile, "
        f"in {p.get('steps_span_s', 0):.2f} s, "
        f"{'-' if share is None else f'{share:.0%}'} of it inside a step",
        f"  a step (timed by phase): {p['step_ms']:.2f} ms wall, {p['step_cpu_ms']:.2f} ms of the "
        f"engine thread's CPU; the difference is waiting for the GIL or for a CPU",
        f"  CPU seconds over the window: the process {f('process_cpu')}, the engine thread "
        f"{f('engine_cpu')}, the rest (HTTP, event loop, /metrics) "
        f"{'-' if http is None else f'{http:.2f}'}",
    ]


def profile_text(profiles: dict[str, dict], head: str, top: int = 25) -> str:
    """The profile's tables: phases side by side, kinds side by side, then each server's
    functions by self time."""
    names = list(profiles)
    lines = [f"# Engine profile: {head}", ""]
    for n, p in profiles.items():
        lines += profile_head(n, p)
    lines += ["", "## Phases of a step: wall ms per step, exclusive of the phases they call"]
    labels = list(dict.fromkeys(ph["label"] for p in profiles.values() for ph in p["phases"]))
    lines.append(f"{'phase':<56}" + "".join(f"{n + ' ms':>22}{'share':>7}" for n in names))
    for label in labels:
        row = f"{label[:56]:<56}"
        for n in names:
            ph = {x["label"]: x for x in profiles[n]["phases"]}.get(label)
            row += f"{'':>29}" if ph is None else f"{ph['ms_per_step']:>22.3f}{ph['share']:>7.1%}"
        lines.append(row)
    lines.append(
        f"{'all (the step)':<56}"
        + "".join(f"{profiles[n]['step_ms']:>22.3f}{'':>7}" for n in names)
    )
    for n in names:
        counted = {x["label"]: x["count_per_step"] for x in profiles[n]["phases"]}
        lines.append(
            f"{n}: per step, {counted.get(DECODE, 0):.1f} decode entries, "
            f"{counted.get(PREFILL, 0):.1f} prompt tokens prefilled"
        )
        if profiles[n]["missing"]:
            lines.append(
                f"{n}: not in this engine (timed with their callers): "
                + ", ".join(profiles[n]["missing"])
            )
    lines += ["", "## Self time by kind (cProfile, its own steps; Python's share is inflated)"]
    kinds = list(dict.fromkeys(k["kind"] for p in profiles.values() for k in p["kinds"]))
    lines.append(f"{'kind':<36}" + "".join(f"{n + ' ms':>22}{'share':>7}" for n in names))
    for kind in kinds:
        row = f"{kind:<36}"
        for n in names:
            k = {x["kind"]: x for x in profiles[n]["kinds"]}.get(kind)
            row += f"{'':>29}" if k is None else f"{k['self_ms_per_step']:>22.3f}{k['share']:>7.1%}"
        lines.append(row)
    for n, p in profiles.items():
        lines += ["", f"## {n}: top functions by self time (cProfile), per step"]
        lines.append(f"{'function':<64}{'ms':>9}{'share':>7}{'calls':>8}  kind")
        for f in p["functions"][:top]:
            lines.append(
                f"{f['name'][:64]:<64}{f['self_ms_per_step']:>9.3f}{f['share']:>7.1%}"
                f"{f['calls_per_step']:>8.1f}  {f['kind']}"
            )
    return "\n".join(lines) + "\n"
