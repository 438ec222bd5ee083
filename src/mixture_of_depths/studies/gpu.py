"""The second-round isoFLOP comparison on one CUDA GPU: dense against MoD (the MoD arm of
`mod study --plan round2`: its winning causal router, with the capacity warm-up where that
helped; the library's defaults, predictor and a 10% warm-up, where the CPU study has not picked
one yet) at 1e16 and 3e16 training FLOPs, bf16 autocast, BPE tokens, 1024 tokens of
context. About ten minutes on one H100/H200-class GPU.

    python -m mixture_of_depths.studies.gpu         # into docs/study/round2/gpu/
    python -m mixture_of_depths.studies.gpu --budgets 1e16 --out /tmp/gpu

Rows are written in the study's format (`results.jsonl`, one per run, resumable: finished runs are
skipped) and the round-2 report (`docs/study/round2/report.md`) includes them as its GPU section
when rewritten. The corpus is the default one, the running Python's standard library, so its
numbers compare with each other, not digit for digit with the CPU study's. Without a CUDA device
it says so, runs nothing, and exits 0. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from ..fileio import json_text
from .round2 import DENSE, FOLDERS, FULL, MOD, WARMUP, mod_arm, write_report
from .runner import Folders, RunSpec, StudySettings, budget_tag, load_results, run_one

GPU_FOLDERS = Folders(out=f"{FOLDERS.out}/gpu", work="runs/gpu-study")  # the report reads out
SIZES = (
    ("GPU-S", dict(d_model=384, n_layers=8, n_heads=6)),
    ("GPU-M", dict(d_model=512, n_layers=8, n_heads=8)),
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", default="1e16,3e16", help="training FLOPs, comma-separated")
    ap.add_argument("--out", default=GPU_FOLDERS.out, help="results folder")
    ap.add_argument("--work", default=GPU_FOLDERS.work, help="run folders (deleted per run)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--data", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU here (torch.cuda.is_available() is False): nothing was run")
        print(json.dumps({"gpu": False, "torch": torch.__version__}))
        return 0
    budgets = tuple(float(b) for b in args.budgets.split(","))
    cpu_results = load_results(Path(FOLDERS.out) / "results.jsonl")
    arm = mod_arm(cpu_results)
    if arm is None:  # the library's defaults
        label, over, warmup = "defaults (predictor, 10% warm-up)", {"causal_router": "predictor",
                              "aux_loss_weight": 0.1}, WARMUP  # fmt: skip
    else:
        label, _, over, warmup = arm
    print(f"GPU: {torch.cuda.get_device_name()}; MoD arm: {label}")
    settings = StudySettings(
        budgets=budgets, sizes=SIZES, seq_len=args.seq_len, batch_size=args.batch_size,
        eval_every_runs=2, eval_batches=8, base={}, ablation_size=SIZES[0][0], tokenizer="bpe",
    )  # fmt: skip
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.jsonl"
    done = {r["name"] for r in load_results(path)}
    t0 = time.perf_counter()
    for budget in budgets:
        for size, shape in SIZES:
            for arch, arch_over in (("dense", DENSE), ("MoD", {**MOD, **over})):
                spec = RunSpec(
                    name=f"gpu-{budget_tag(budget)}-{arch}-{size}-s0",
                    group="isoflop",
                    label=f"{arch} {size}",
                    budget=budget,
                    model={"max_seq_len": args.seq_len, **shape, **arch_over},
                    seq_len=args.seq_len,
                    batch_size=args.batch_size,
                    capacity_warmup=warmup if arch == "MoD" else 0.0,
                )
                if spec.name in done:
                    continue
                row = run_one(spec, settings, work, args.data)
                row["device"] = torch.cuda.get_device_name()
                with path.open("a") as fh:
                    fh.write(json_text(row) + "\n")
                shutil.rmtree(work / spec.name, ignore_errors=True)
                print(
                    f"{spec.name}: causal {row['val_loss_causal']:.4f}, "
                    f"{row['tokens_per_s']:,.0f} tok/s, {row['wall_s']:.0f} s"
                )
    rows = load_results(path)
    if out.resolve() == Path(GPU_FOLDERS.out).resolve():  # the report reads its GPU section there
        write_report(cpu_results, Path(FOLDERS.out), FULL)
    else:
        print(f"results in {path}; the round-2 report reads {GPU_FOLDERS.out}/results.jsonl")
    print(json.dumps({"gpu": True, "runs": len(rows), "wall_s": time.perf_counter() - t0,
                      "out": str(path)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
