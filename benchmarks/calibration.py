"""Calibrated causal thresholds, before and after, on trained MoD checkpoints: per routed layer
the causal take-rate, the causal validation loss, and decode tokens/s, the checkpoint as trained
(threshold 0, or the thresholds it trained with where `mod train` calibrated it at its end)
beside the same weights with thresholds fitted by `mod calibrate`'s code
(`mixture_of_depths.calibrate.fit_thresholds`) on every other batch of the run's validation
windows (`calibrate.fit_and_held`); loss and take-rates are measured on the others.

    python benchmarks/calibration.py runs/study-round3-kept/r3-1.5e14-mod-s0 [more checkpoints]

Decoding feeds both models the same held-out tokens (the greedy token is still computed), so
they decode the same sequences and only the routing differs; the two are timed in interleaved
rounds (`bench.common.interleaved`). What else ran on the machine is printed with the figures.
The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from mixture_of_depths.bench.common import cpu_snapshot, interleaved, others_busy
from mixture_of_depths.bench.decode import decode_run
from mixture_of_depths.calibrate import causal_take_rates, fit_and_held, fit_thresholds
from mixture_of_depths.data import load_tokenizer
from mixture_of_depths.runtime.checkpoint import load_model, read_json_file, resolve_checkpoint
from mixture_of_depths.train import evaluate
from mixture_of_depths.train.calibrate import restore_uncalibrated
from mixture_of_depths.train.evaluate import run_batches


def measure(ckpt: Path, args: argparse.Namespace) -> dict:
    """One checkpoint: take-rates and causal loss on the held-out half, then decode speed, as
    trained and calibrated."""
    trained, cfg = load_model(ckpt)
    if cfg.is_dense:
        raise SystemExit(f"{ckpt} is a dense model: nothing to calibrate")
    # `mod train` ends calibrated: "as trained" is the thresholds the run trained with
    state = ckpt / "trainer.json"
    cfg = restore_uncalibrated(trained, cfg, read_json_file(state) if state.exists() else None)
    calibrated = load_model(ckpt)[0]
    for m in (trained, calibrated):
        m.eval()
    batches, _ = run_batches(
        ckpt, load_tokenizer(ckpt), cfg.max_seq_len, args.data, args.eval_batches, args.batch_size
    )
    fit, held = fit_and_held(batches)
    thresholds = fit_thresholds(calibrated, [x for x, _ in fit])
    models = {"trained": trained, "calibrated": calibrated}
    row: dict = {"checkpoint": str(ckpt), "capacity": cfg.capacity, "thresholds": thresholds}
    for name, m in models.items():
        row[name] = {
            "take_rate": causal_take_rates(m, [x for x, _ in held]),
            "val_loss_causal": evaluate(m, held, torch.device("cpu"))["val_loss_causal"],
        }
    tokens = torch.cat([x for x, _ in held])  # (N, T) held-out windows
    P, N = args.prompt_len, args.new_tokens
    if P + N > tokens.shape[1]:
        raise SystemExit(f"--prompt-len + --new-tokens = {P + N} is more than {tokens.shape[1]}")
    for B in args.batch_sizes:
        prompt, feed = tokens[:B, :P], tokens[:B, P : P + N]
        last: dict = {}

        def run(name: str, prompt=prompt, feed=feed, last=last) -> None:
            last[name] = decode_run(models[name], prompt, N, lambda: None, feed=feed)

        fns = {name: (lambda name=name: run(name)) for name in models}
        times = interleaved(fns, warmup=1, repeats=args.repeats, sync=lambda: None)
        for name in models:
            row[name][f"decode_tok_s_b{B}"] = B * N / statistics.median(times[name])
            row[name][f"decode_take_b{B}"] = last[name]["take_decode"]
    return row


def report(rows: list[dict], batch_sizes: list[int]) -> None:
    for r in rows:
        t, c = r["trained"], r["calibrated"]
        print(f"\n{r['checkpoint']} (capacity {r['capacity']:.3f})")
        print("| | take-rate per routed layer | causal loss | " + " | ".join(
            f"decode tok/s, batch {b}" for b in batch_sizes) + " |")  # fmt: skip
        print("|---|---|---|" + "---|" * len(batch_sizes))
        for name, m in (("as trained", t), ("calibrated", c)):
            takes = ", ".join(f"{v:.1%}" for v in m["take_rate"].values())
            speeds = " | ".join(f"{m[f'decode_tok_s_b{b}']:,.0f}" for b in batch_sizes)
            print(f"| {name} | {takes} | {m['val_loss_causal']:.4f} | {speeds} |")
        ratios = ", ".join(
            f"batch {b} {c[f'decode_tok_s_b{b}'] / t[f'decode_tok_s_b{b}']:.3f}x"
            for b in batch_sizes
        )
        print(
            f"calibrated/trained: loss {c['val_loss_causal'] - t['val_loss_causal']:+.4f} nats, "
            f"decode speed {ratios}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoints", nargs="+", help="MoD checkpoint folders")
    ap.add_argument("--data", default=None, help="text file or folder (default: the run's)")
    ap.add_argument(
        "--eval-batches",
        type=int,
        default=32,
        help="validation batches (default: 32, as mod calibrate)",
    )
    ap.add_argument("--batch-size", type=int, default=None, help="(default: the run's)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,4", help="comma-separated (default: 1,4)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (default: 3)")
    args = ap.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    before = cpu_snapshot()
    rows = [measure(resolve_checkpoint(c), args) for c in args.checkpoints]
    busy = others_busy(before, cpu_snapshot())
    report(rows, args.batch_sizes)
    if busy is not None:
        print(f"\nother processes kept {busy:.0%} of the CPUs busy while this ran")
    print(json.dumps({"calibration": rows, "others_busy_share": busy}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
