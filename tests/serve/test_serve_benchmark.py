"""benchmarks/serve.py --quick runs end to end against live servers and ends with a line of JSON
(no speed asserted: only that every request of every configuration completed, with its tokens)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_quick_serving_benchmark_ends_with_json(tmp_path):
    png = tmp_path / "serve.png"
    args = ["--quick", "--requests", "4", "--rates", "8,inf", "--output-lens", "3:5",
            "--plot", str(png)]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "serve.py"), *args],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out["results"]) == {"mod/continuous", "dense/continuous", "mod/static",
                                   "dense/static"}  # fmt: skip
    for rows in out["results"].values():
        assert set(rows) == {"8", "inf"}
        for row in rows.values():
            assert row["completed"] == 4 and row["rejected"] == 0
            assert 4 * 3 <= row["tokens"] <= 4 * 5  # ignore_eos: each its drawn output length
    assert {"mod_over_dense", "continuous_over_static"} <= set(out["ratios"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
