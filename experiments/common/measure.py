"""Measurements of trained models, shared by the studies that time them (`kv`, `convert`): the
KV bytes a decode's cache held, the prefill calibration, and decode speed side by side.

Decode is timed on the CPU with one thread, a held-out prompt of half the sequence and up to
`DECODE_NEW` greedy tokens, the median of `DECODE_ROUNDS` interleaved rounds; only the decode
steps are timed (`bench.decode.decode_run`).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch

from mixture_of_depths.bench.common import cpu_snapshot, others_busy
from mixture_of_depths.bench.decode import decode_run
from mixture_of_depths.data import eval_batches, load_splits, load_tokenizer
from mixture_of_depths.generate import prefill_calibration
from mixture_of_depths.runtime.checkpoint import load_model

DECODE_NEW = 128
DECODE_BATCHES = (1, 8)
DECODE_ROUNDS = 15
# Above this share of the CPUs kept busy by other processes, a timing is flagged as skewed.
BUSY_WARN = 0.1


def val_tokens(ckpt: Path, data: str | None) -> torch.Tensor:
    """The held-out split of `data`, in the tokens of the model saved in `ckpt`."""
    return load_splits(data, load_tokenizer(ckpt))[1]


def prompts(val: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, int]:
    """Held-out prompts of half the sequence (as many rows as the largest batch), and the
    decode steps that fit after them."""
    prompt_len = seq_len // 2
    rows = eval_batches(val, max(DECODE_BATCHES), prompt_len, 1)[0][0]
    return rows, min(DECODE_NEW, seq_len - prompt_len)


def fed_prompts(val: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out prompts of half the sequence (as many rows as the largest batch) and the tokens
    that follow each in the text, as many as decode steps fit: fed to the decode in place of
    the model's greedy tokens, so its routers decide on text rather than on the model's own
    output."""
    prompt_len = seq_len // 2
    new = min(DECODE_NEW, seq_len - prompt_len)
    rows = eval_batches(val, max(DECODE_BATCHES), prompt_len + new, 1)[0][0]
    return rows[:, :prompt_len], rows[:, prompt_len:]


def measure_run(ckpt: Path, seq_len: int, data: str | None) -> dict[str, Any]:
    """The KV bytes per token the cache held in a greedy decode at batch 8 (had it been bf16),
    the take-rates of that decode, and the prefill calibration of the model saved in `ckpt`."""
    model, cfg = load_model(ckpt)
    model.eval()
    val = val_tokens(ckpt, data)
    rows, new = prompts(val, seq_len)
    run = decode_run(model, rows, new, lambda: None)
    kv_entry = 2 * cfg.n_kv_heads * cfg.head_dim  # elements a token stores in one layer
    out: dict[str, Any] = {
        "kv_bytes_per_token_measured": 2 * kv_entry * sum(run["cached_share"]),
        "take_decode": run["take_decode"],
    }
    if not cfg.is_dense:
        idx = eval_batches(val, 8, seq_len, 1)[0][0]
        out.update(prefill_calibration(model, idx, seq_len // 2))
    return out


def decode_speeds(
    ckpts: dict[str, Path], seq_len: int, data: str | None, fed: bool = False
) -> dict[str, dict[str, Any]]:
    """Decode tokens/s at batch 1 and 8 of the models of one cell (one budget and length),
    measured side by side: every round decodes once with each model, in an order that rotates
    every round, so drift and stray load hit all alike; the median over `DECODE_ROUNDS` rounds
    after a warm-up, and the spread (interquartile range / median). CPU, one thread; only the decode
    steps are timed (`bench.decode.decode_run`). Each row also holds `others_busy`, the share of
    the CPUs other processes used meanwhile (Linux; absent elsewhere), with a warning above
    `BUSY_WARN`: a study training beside the timing skews it. `fed`: each step is fed the
    held-out text's next token instead of the greedy one (`fed_prompts`; the same work per
    step): a small model's greedy text repeats itself, and its routers can take far fewer of
    those tokens than of text. ``take_b{b}``: each routed layer's take-rate while decoding."""
    models = {name: load_model(c)[0].eval() for name, c in ckpts.items()}
    val = val_tokens(next(iter(ckpts.values())), data)
    feed: torch.Tensor | None = None
    if fed:
        rows, feed = fed_prompts(val, seq_len)
        new = feed.shape[1]
    else:
        rows, new = prompts(val, seq_len)
    names = list(models)
    taken: dict[tuple[str, int], list[float]] = {}
    secs: dict[tuple[str, int], list[float]] = {(n, b): [] for n in names for b in DECODE_BATCHES}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # decode ops are too small to share between threads
    snapshot = cpu_snapshot()
    try:
        for b in DECODE_BATCHES:
            for rnd in range(DECODE_ROUNDS + 1):
                k = rnd % len(names)
                for name in names[k:] + names[:k]:
                    fed_b = None if feed is None else feed[:b]
                    run = decode_run(models[name], rows[:b], new, lambda: None, fed_b)
                    taken[name, b] = run["take_decode"]
                    if rnd:  # round 0 warms up
                        secs[name, b].append(run["seconds"])
    finally:
        torch.set_num_threads(threads)
    busy = others_busy(snapshot, cpu_snapshot())
    if busy is not None and busy > BUSY_WARN:
        print(f"decode speed: other processes kept {busy:.0%} of the CPUs busy during the timing; "
              "the speeds are skewed: time again on an idle machine")  # fmt: skip
    out: dict[str, dict[str, Any]] = {n: {} for n in names}
    for (name, b), ts in secs.items():
        med = statistics.median(ts)
        q1, _, q3 = statistics.quantiles(ts, n=4) if len(ts) > 1 else (med, med, med)
        out[name][f"decode_tok_s_b{b}"] = b * new / med
        # the interquartile range: robust to the odd round a shared machine stalls
        out[name][f"decode_spread_b{b}"] = (q3 - q1) / med
        out[name][f"take_b{b}"] = taken[name, b]
        if busy is not None:
            out[name]["others_busy"] = busy
    return out
