"""`GET /metrics`: the engine's counters (`Engine.metrics()`) and the HTTP layer's error counts in
Prometheus' text exposition format (version 0.0.4), with HELP and TYPE lines.

Per-layer values (a dict {layer: value}) become one sample per layer with a `layer` label.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (engine metrics key, metric name, type, help)
METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("requests_total", "mod_requests_total", "counter", "Requests admitted by the engine."),
    ("requests_running", "mod_requests_running", "gauge", "Requests in the running batch."),
    ("queue_depth", "mod_queue_depth", "gauge", "Requests waiting for a row or for pages."),
    ("tokens_prompt_total", "mod_tokens_prompt_total", "counter", "Prompt tokens prefilled."),
    ("tokens_generated_total", "mod_tokens_generated_total", "counter", "Tokens generated."),
    ("active_rows", "mod_active_rows", "gauge", "Rows of the batch holding a request."),
    ("kv_pages_in_use", "mod_kv_pages_in_use", "gauge", "KV cache pages in use, per layer."),
    ("kv_pages_total", "mod_kv_pages_total", "gauge", "KV cache pages in the pool, per layer."),
    ("kv_bytes_in_use", "mod_kv_bytes_in_use", "gauge", "Bytes of the KV pages in use."),
    (
        "take_rate",
        "mod_take_rate",
        "gauge",
        "Share of the tokens decoded that took each routed layer.",
    ),
    ("kv_bytes_allocated", "mod_kv_bytes_allocated", "gauge", "Bytes of the KV page pools."),
    ("steps_total", "mod_steps_total", "counter", "Scheduler steps (model forwards) run."),
    ("tokens_decoded_total", "mod_tokens_decoded_total", "counter", "Tokens fed in decode."),
    (
        "preemptions_total",
        "mod_preemptions_total",
        "counter",
        "Requests preempted (their pages freed, recomputed later) when the pool ran dry.",
    ),
)


def _number(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    x = float(value)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(x)


def _label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _family(name: str, kind: str, doc: str, value: Any, label: str = "layer") -> list[str]:
    lines = [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
    if isinstance(value, Mapping):
        for key in sorted(value, key=_sort_key):
            lines.append(f'{name}{{{label}="{_label(key)}"}} {_number(value[key])}')
    else:
        lines.append(f"{name} {_number(value)}")
    return lines


def _sort_key(key: Any) -> tuple[int, int, str]:
    """Layers in numeric order ("2" before "10"), names after them."""
    text = str(key)
    return (0, int(text), "") if text.isdigit() else (1, 0, text)


def prometheus_text(engine_metrics: Mapping[str, Any], http_errors: Mapping[int, int]) -> str:
    """The exposition text: each known engine metric present in `engine_metrics` (others are
    left out rather than guessed), then `mod_http_errors_total{code=...}`."""
    lines: list[str] = []
    for key, name, kind, doc in METRICS:
        if key in engine_metrics and engine_metrics[key] is not None:
            lines += _family(name, kind, doc, engine_metrics[key])
    lines += _family(
        "mod_http_errors_total",
        "counter",
        "Error responses sent, by HTTP status.",
        {str(code): n for code, n in http_errors.items()},
        label="code",
    )
    return "\n".join(lines) + "\n"


def take_rate_text(engine_metrics: Mapping[str, Any], config: Any = None) -> str | None:
    """The engine's take-rates as one line (what `mod serve` says when it stops), with the
    capacity and whether the thresholds were calibrated when the model's `config` is given;
    None for a model with no router."""
    rates = engine_metrics.get("take_rate") or {}
    if not rates:
        return None
    per = ", ".join(f"L{k} {v:.1%}" for k, v in rates.items())
    text = f"take-rates over the {engine_metrics['tokens_decoded_total']} tokens decoded: {per}"
    if config is not None:
        fitted = "calibrated" if config.causal_thresholds else "0, uncalibrated"
        text += f" (capacity {config.capacity:.1%}; causal thresholds {fitted})"
    return text


def parse_prometheus(text: str) -> dict[str, float | dict[str, float]]:
    """The samples of `prometheus_text`'s output, {name: value} or {name: {label value: value}}
    (for clients: the benchmark and the tests read /metrics with it)."""
    out: dict[str, Any] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if "{" in head:
            name, _, rest = head.partition("{")
            label = rest.rstrip("}").partition("=")[2].strip('"')
            out.setdefault(name, {})[label] = float(value)
        else:
            out[head] = float(value)
    return out
