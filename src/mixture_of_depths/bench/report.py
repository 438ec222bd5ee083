"""What `mod bench` prints: the settings line, a table per section, the profile, the bars
(docs/semantics.md, "Figures") and, last, one line of JSON with every number."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from ..fileio import json_text
from .common import fmt_bytes
from .moe import bars as expert_bars

EFFICIENCY_BAR = 0.95  # measured speed-up / FLOP-predicted speed-up, at seq_len >= 1024
EFFICIENCY_MIN_LEN = 1024
CAP1_OVERHEAD_BAR = 0.03  # capacity 1.0 may cost at most this much over dense


def print_settings(args: argparse.Namespace, device: torch.device) -> None:
    """The first line: what is measured, where, and how often."""
    print(
        f"mod bench: preset={args.preset} pattern={args.layer_pattern} "
        f"skipped_kv={args.skipped_kv} "
        f"capacities={args.capacities} seq_lens={args.seq_lens} tokens/step={args.tokens} "
        f"device={device.type} dtype={args.dtype} threads={torch.get_num_threads()} "
        f"repeats={args.repeats} warmup={args.warmup} torch={torch.__version__}"
    )


def print_profile(p: dict[str, Any]) -> None:
    """The profiled ops of the two models side by side, training step and one block."""
    for part, what in (("models", "training step"), ("blocks", "one block, forward")):
        print(
            f"\n## Profile, {what}: self CPU time per op and call, T={p['seq_len']}, "
            f"batch {p['batch_size']}"
        )
        runs = p[part]
        names = list(runs)
        ops = {n: {o["op"]: o for o in runs[n]["ops"]} for n in names}
        keys = list(dict.fromkeys(k for n in names for k in ops[n]))
        head = f"{'op':<56}" + "".join(f"{n + ' ms':>12} {'share':>6}" for n in names)
        print(head)
        print("-" * len(head))
        for k in keys:
            cells = ""
            for n in names:
                o = ops[n].get(k)
                cells += (
                    f"{'':>12} {'':>6}"
                    if o is None
                    else f"{o['ms_per_step']:>12.3f} {100 * o['share']:>5.1f}%"
                )
            print(f"{k[:56]:<56}{cells}")
        for label, key in (("all ops (profiled)", "total_ms_per_step"), ("wall time", "wall_ms")):
            print(f"{label:<56}" + "".join(f"{runs[n][key]:>12.3f} {'':>6}" for n in names))
        a, b = names
        print(
            f"{a}/{b}: ops {runs[a]['total_ms_per_step'] / runs[b]['total_ms_per_step']:.2f}x, "
            f"wall {runs[a]['wall_ms'] / runs[b]['wall_ms']:.2f}x"
        )


def _x(v: float) -> str:
    return f"{v:.3f}x"


def _pct(v: float) -> str:
    return f"{100 * v:.1f}%"


# A speed-up over dense beside the FLOP-predicted one, their quotient, and the timing spread.
_SPEED_COLUMNS = [
    ("speed-up", 9, lambda r: _x(r["speedup"])),
    ("FLOP pred.", 10, lambda r: _x(r["speedup_flop_predicted"])),
    ("effic.", 7, lambda r: _pct(r["efficiency"])),
    ("range", 6, lambda r: _pct(r["range_rel"])),
]

# Each table: its title, then (header, width, cell) per column; a cell is a row's key or a
# function of the row. Widths are right-aligned; a negative width left-aligns.
_TABLES: dict[str, tuple[str, list[tuple[str, int, Any]]]] = {
    "train": (
        "Training step (forward + backward), routed model vs its dense twin",
        [
            ("T", 5, "seq_len"),
            ("batch", 5, "batch_size"),
            ("model", -8, "model"),
            ("k", 5, lambda r: "" if r["capacity_tokens"] is None else r["capacity_tokens"]),
            ("ms/step", 9, lambda r: f"{r['ms_per_step']:.1f}"),
            ("tokens/s", 9, lambda r: f"{r['tokens_per_s']:,.0f}"),
            ("GFLOP/s", 8, lambda r: f"{r['gflop_per_s']:.1f}"),
            *_SPEED_COLUMNS,
        ],
    ),
    "block": (
        "One block: routed vs dense, same input",
        [
            ("T", 5, "seq_len"),
            ("mode", -17, "mode"),
            ("model", -8, "model"),
            ("ms", 8, lambda r: f"{r['ms']:.2f}"),
            *_SPEED_COLUMNS,
        ],
    ),
    "memory": (
        "Training-step memory: peak above the parameters, and activations saved",
        [
            ("T", 5, "seq_len"),
            ("batch", 5, "batch_size"),
            ("model", -8, "model"),
            ("peak", 10, lambda r: fmt_bytes(r["peak_bytes"], 1)),
            ("vs dense", 9, lambda r: "-" if r["peak_ratio"] is None else _x(r["peak_ratio"])),
            ("saved", 10, lambda r: fmt_bytes(r["saved_bytes"], 1)),
            ("vs dense", 9, lambda r: _x(r["saved_ratio"])),
        ],
    ),
    "experts_layer": (
        "Expert layer (forward + backward) vs the dense MLP of the same active size, same input",
        [
            ("T", 5, "seq_len"),
            ("layer", -21, "model"),
            ("path", -10, "path"),
            ("real", 6, lambda r: "" if r["expert_share"] is None else _pct(r["expert_share"])),
            ("ms", 8, lambda r: f"{r['ms']:.2f}"),
            *_SPEED_COLUMNS,
        ],
    ),
    "experts_model": (
        "MoE and MoDE training steps vs the dense twin (equal active parameters)",
        [
            ("T", 5, "seq_len"),
            ("batch", 5, "batch_size"),
            ("model", -13, "model"),
            ("real", 6, lambda r: "" if r["expert_share"] is None else _pct(r["expert_share"])),
            ("ms/step", 9, lambda r: f"{r['ms_per_step']:.1f}"),
            ("tokens/s", 9, lambda r: f"{r['tokens_per_s']:,.0f}"),
            *_SPEED_COLUMNS,
        ],
    ),
    "compile": (
        "Eager vs torch.compile(fullgraph=True), training step",
        [
            ("T", 5, "seq_len"),
            ("model", -6, "model"),
            ("mode", -9, "mode"),
            ("ms/step", 9, lambda r: f"{r['ms_per_step']:.1f}"),
            ("tokens/s", 9, lambda r: f"{r['tokens_per_s']:,.0f}"),
            ("vs eager", 9, lambda r: _x(r["compiled_speedup"])),
            ("MoD/dense", 9, lambda r: _x(r["mod_speedup"])),
            ("FLOP pred.", 10, lambda r: _x(r["speedup_flop_predicted"])),
            ("compile s", 9, lambda r: "" if r["compile_s"] is None else f"{r['compile_s']:.0f}"),
        ],
    ),
}


def print_table(section: str, rows: list) -> None:
    """One of `_TABLES`, a line per row."""
    title, columns = _TABLES[section]

    def cell(text: Any, width: int) -> str:
        return f"{text!s:<{-width}}" if width < 0 else f"{text!s:>{width}}"

    print(f"\n## {title}")
    head = " ".join(cell(name, width) for name, width, _ in columns)
    print(head)
    print("-" * len(head))
    for r in rows:
        values = (get(r) if callable(get) else r[get] for _, _, get in columns)
        print(" ".join(cell(v, w) for v, (_, w, _) in zip(values, columns, strict=True)))


def bars(result: dict) -> dict:
    """The bars (docs/semantics.md, "Figures"), each with its measured value and verdict."""
    out: dict[str, Any] = {}
    train = result.get("train") or []
    cap1 = [r for r in train if r["capacity"] == 1.0]
    if cap1:
        worst = max(1 / r["speedup"] - 1 for r in cap1)
        out["cap1_overhead"] = {
            "value": worst,
            "bar": CAP1_OVERHEAD_BAR,
            "pass": worst <= CAP1_OVERHEAD_BAR,
        }
    long = [
        r for r in train if r["capacity"] not in (None, 1.0) and r["seq_len"] >= EFFICIENCY_MIN_LEN
    ]
    if long:
        worst = min(r["efficiency"] for r in long)
        out["efficiency_long"] = {
            "value": worst,
            "bar": EFFICIENCY_BAR,
            "pass": worst >= EFFICIENCY_BAR,
        }
    mem = [r for r in result.get("memory") or [] if r["capacity"] not in (None, 1.0)]
    peaks = [r["peak_ratio"] for r in mem if r["peak_ratio"] is not None]
    if peaks:  # the peak where it could be measured; saved activations always
        out["memory_peak_ratio"] = {"value": max(peaks), "bar": 1.0, "pass": max(peaks) < 1.0}
    if mem:
        worst = max(r["saved_ratio"] for r in mem)
        out["memory_saved_ratio"] = {"value": worst, "bar": 1.0, "pass": worst < 1.0}
    out.update(expert_bars(result.get("experts_layer") or [], EFFICIENCY_MIN_LEN))
    return out


def print_report(result: dict[str, Any], device: torch.device) -> None:
    """Every section's table, the profile, the bars, the CPU-sharing note and the JSON line."""
    for section in _TABLES:
        if section in result:
            print_table(section, result[section])
    if "profile" in result:
        print_profile(result["profile"])
    if result["bars"]:
        print("\n## Bars")
        for name, b in result["bars"].items():
            print(
                f"{name:<20} {b['value']:.3f} (bar {b['bar']:g}) {'PASS' if b['pass'] else 'FAIL'}"
            )
    busy = result["cpu_busy_others"]
    if device.type == "cpu" and busy is not None and busy > 0.1:
        print(
            f"note: other processes kept {100 * busy:.0f}% of the CPUs busy during the run; "
            "absolute numbers are noisy, ratios less so"
        )
    print(f"({result['wall_s']:.0f} s)")
    print(json_text(result))
