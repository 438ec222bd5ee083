"""benchmarks/gpu.py, the first GPU's prepared run: without CUDA it measures nothing and says
so; ``--dry-run`` runs every part at tiny sizes on a CPU, so a GPU session finds no crash."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script measures")
def test_without_cuda_the_script_says_so_and_exits_0():
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0
    assert json.loads(run.stdout.strip().splitlines()[-1])["gpu"] is False


@pytest.mark.slow  # ~1-2 min: the fused parts run under Triton's interpreter
def test_the_dry_run_runs_every_part():
    run = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    res = json.loads(run.stdout.strip().splitlines()[-1])
    for part in ("tests", "train", "block", "decode"):
        assert "error" not in res[part], (part, res[part])
    assert res["train"]["speedup_predicted"] > 1
    assert set(res["decode"]) >= {"MoD B=1", "dense B=1", "MoD / dense B=2"}
