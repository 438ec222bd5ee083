"""Round 4's measures of its trained models, taken once training is done and nothing else runs
(items 4 and 5): ``python -m experiments.round4.measure --kept DIR`` (from the repository root;
DIR: the kept checkpoints, ``<work>-kept``).

- ``probes.jsonl``: the look-back probes (`lookback`) of every kept checkpoint.
- ``decode.jsonl``: each MoD family's best model (seed 0) decoded beside dense's best
  (`experiments.common.measure.decode_speeds`: CPU, one thread, interleaved rounds, the
  median; batch 1 and 8) and the KV bytes per token its cache held.

Both are resumable (a finished row is kept) and rewrite the report at the end.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from mixture_of_depths.fileio import json_text
from mixture_of_depths.runtime.checkpoint import load_model
from mixture_of_depths.studies.runner import load_results

from ..common import measure
from . import STUDY, lookback

HERE = Path(__file__).resolve().parent


def probe_all(kept: Path, out: Path, data: str | None) -> None:
    """The look-back probes of every checkpoint in `kept` not yet in ``probes.jsonl``."""
    path = out / "probes.jsonl"
    done = {r["name"] for r in load_results(path)}
    for ckpt in sorted(p for p in kept.iterdir() if (p / "model.safetensors").exists()):
        if ckpt.name in done:
            continue
        model, _ = load_model(ckpt)
        row = {"name": ckpt.name, **lookback.lookback(model, measure.val_tokens(ckpt, data))}
        with path.open("a") as fh:
            fh.write(json_text(row) + "\n")
        print(f"{ckpt.name}: repeat {row['repeat_score']:+.3f}, recall {row['recall_score']:+.3f}")


def decode_all(kept: Path, out: Path, data: str | None) -> None:
    """Decode speed and KV bytes of each family's best run beside dense's (findings.json's
    ``best_runs``), unless ``decode.jsonl`` has them."""
    path = out / "decode.jsonl"
    if load_results(path):
        return
    best: dict[str, str | None] = json.loads((out / "findings.json").read_text())["best_runs"]
    ckpts = {fam: kept / n for fam, n in best.items() if n is not None and (kept / n).exists()}
    missing = sorted(set(best) - set(ckpts))
    if missing or "dense" not in ckpts:
        raise SystemExit(f"no kept checkpoint for {missing}: train (or rerun) them first")
    seq_len = load_model(ckpts["dense"])[1].max_seq_len
    speeds = measure.decode_speeds(ckpts, seq_len, data)
    rows = []
    for fam, ckpt in ckpts.items():
        row: dict[str, Any] = {"name": fam, "run": ckpt.name, **speeds[fam]}
        row.update(measure.measure_run(ckpt, seq_len, data))
        for b in measure.DECODE_BATCHES:
            row[f"speedup_b{b}"] = (
                speeds[fam][f"decode_tok_s_b{b}"] / (speeds["dense"][f"decode_tok_s_b{b}"])
            )
        rows.append(row)
    path.write_text("".join(json_text(r) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.round4.measure", description=__doc__)
    ap.add_argument("--kept", required=True, help="the kept checkpoints (<work>-kept)")
    ap.add_argument("--out", default=str(HERE), help="the study's results (default: its folder)")
    ap.add_argument("--data", default=None, help="the corpus the runs trained on (default: stdlib)")
    ap.add_argument("--skip-decode", action="store_true", help="the probes only")
    args = ap.parse_args(argv)
    out, kept = Path(args.out), Path(args.kept)
    probe_all(kept, out, args.data)
    if not args.skip_decode:
        decode_all(kept, out, args.data)
    results = load_results(out / "results.jsonl")
    STUDY.report(results, out, STUDY.settings(False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
