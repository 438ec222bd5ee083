"""The benchmarks run end to end on a tiny model and end with a line of JSON (no speed asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "script, args, keys",
    [
        (
            "train_step.py",
            [
                "--preset",
                "tiny",
                "--seq-lens",
                "32",
                "--tokens",
                "64",
                "--capacities",
                "1.0,0.125",
                "--repeats",
                "1",
                "--warmup",
                "0",
                "--no-progress",
            ],
            {"train", "bars", "settings"},
        ),  # fmt: skip
        (
            "decode.py",
            ["--preset", "tiny", "--prompt-len", "16", "--new-tokens", "4", "--repeats", "1"],
            {"results", "ratios"},
        ),
        (
            "decode.py",
            [
                "--preset",
                "tiny",
                "--prompt-len",
                "16",
                "--new-tokens",
                "4",
                "--repeats",
                "1",
                "--skipped-kv",
                "residual",
            ],
            {"results", "ratios", "skipped_kv"},
        ),  # fmt: skip
        # The two slowest (subprocesses of their own: torchrun, fresh interpreters) are outside
        # the default set, for CI's time: what they run is tested in tests/runtime.
        pytest.param(
            "distributed.py",
            ["--steps", "4", "--batch-size", "4", "--seq-len", "32", "--parallel", "fsdp"],
            {"rows", "params"},
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "malloc.py",
            "--vocab 300 --d-model 16 --n-heads 2 --seq-len 32 --batch-size 2 --steps 2 "
            "--warmup 1 --rounds 1".split(),
            {"median", "speedup", "applied"},
            marks=pytest.mark.slow,
        ),
    ],
)
def test_benchmark_ends_with_json(script: str, args: list[str], keys: set[str]):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert keys <= set(last), sorted(last)


def test_nccl_estimate_counts_the_bytes_of_ring_collectives():
    """`distributed.py --nccl` is arithmetic: its bytes per rank are the ring all-reduce's
    2 (n-1)/n of the float32 gradients under DDP and 3 (n-1)/n under FSDP2 (two all-gathers and
    a reduce-scatter), of parameters counted here on a real model; its break-even token count
    makes compute take as long as the network transfer."""
    from mixture_of_depths import MoDConfig, MoDTransformer

    args = ["--nccl", "--d-model", "64", "--n-layers", "4", "--n-heads", "4", "--vocab-size",
            "300", "--nccl-seq-len", "32", "--tokens-per-gpu", "128", "--gpus", "4"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "distributed.py"), *args],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    cfg = MoDConfig(vocab_size=300, d_model=64, n_layers=4, n_heads=4, max_seq_len=32)
    s = out["settings"]
    rate = s["peak_tflops"] * 1e12 * s["mfu"]
    for row, model_cfg in zip(out["models"], (cfg, cfg.dense_twin()), strict=True):
        params = sum(p.numel() for p in MoDTransformer(model_cfg).parameters())
        assert row["params"] == params
        assert row["ddp"]["bytes_per_rank"] == pytest.approx(2 * 3 / 4 * params * 4)
        assert row["fsdp"]["bytes_per_rank"] == pytest.approx(3 * 3 / 4 * params * 4)
        even = row["ddp"]["tokens_per_gpu_compute_equals_network"]
        compute_s = even * row["train_flops_per_token"] / rate
        assert compute_s == pytest.approx(row["ddp"]["network_ms"] / 1e3)
    mod, dense = out["models"]
    assert mod["train_flops_per_token"] < dense["train_flops_per_token"]


def test_calibration_benchmark_brings_each_take_rate_to_the_capacity(tmp_path):
    """`calibration.py` on an untrained MoD checkpoint (its predictors take 50-85% at threshold
    0): the thresholds it fits on one half of the held-out windows bring every router's take-rate
    on the other half nearer the capacity, and both models' loss and decode speed are reported."""
    from helpers import make_model, tiny_config

    from mixture_of_depths.data import ByteTokenizer
    from mixture_of_depths.runtime.checkpoint import save_checkpoint

    model = make_model(tiny_config(vocab_size=257, capacity=0.25), dtype=torch.float32)
    ckpt = save_checkpoint(tmp_path / "ck", model, model.config, tokenizer=ByteTokenizer())
    corpus = tmp_path / "corpus"  # enough held-out windows for two halves of 8 batches
    corpus.mkdir()
    rng = torch.Generator().manual_seed(0)
    words = "def return self import class for in if else while x y z ( ) [ ] : = + 1 2".split()
    for i in range(24):
        idx = torch.randint(0, len(words), (1500,), generator=rng).tolist()
        (corpus / f"f{i:02d}.py").write_text(" ".join(words[j] for j in idx) + "\n")
    args = [str(ckpt), "--data", str(corpus), "--eval-batches", "8", "--batch-size", "4",
            "--prompt-len", "16", "--new-tokens", "4", "--batch-sizes", "1,2",
            "--repeats", "1"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "calibration.py"), *args],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(proc.stdout.strip().splitlines()[-1])["calibration"]
    assert len(row["thresholds"]) == model.config.n_routers
    for name, rate in row["calibrated"]["take_rate"].items():
        # fitted on the other half of a tiny corpus: nearer the capacity, not at it
        assert abs(rate - 0.25) < min(0.12, abs(row["trained"]["take_rate"][name] - 0.25))
    for name in ("trained", "calibrated"):
        assert row[name]["decode_tok_s_b2"] > 0
        assert len(row[name]["decode_take_b2"]) == model.config.n_routers
