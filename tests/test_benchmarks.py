"""The benchmarks run end to end on a tiny model and end with a line of JSON (no speed asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


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
        (
            "distributed.py",
            ["--steps", "4", "--batch-size", "4", "--seq-len", "32", "--parallel", "fsdp"],
            {"rows", "params"},
        ),
        (
            "gpu.py",
            ["--preset", "tiny", "--seq-lens", "32", "--tokens", "64", "--repeats", "1"],
            {"gpu"} if not torch.cuda.is_available() else {"train", "bars"},
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
