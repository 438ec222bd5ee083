"""benchmarks/serve.py: servers and load generator in processes of their own, repeats with
medians and spreads, one schedule for every configuration, the profile (no speed asserted).

The end-to-end run is slow (a fresh `mod serve` process per configuration and round); the rest
checks the arithmetic on made-up runs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
CONFIGS = {"mod/continuous", "dense/continuous", "mod/static", "dense/static"}


def _module(name: str):
    """A module of benchmarks/ (they import each other by their bare names)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_the_serving_benchmark_measures_servers_from_load_processes_of_their_own(tmp_path):
    png, prof = tmp_path / "serve.png", tmp_path / "profile.txt"
    args = ["--quick", "--repeats", "2", "--requests", "4", "--rates", "8,inf",
            "--output-lens", "3:5", "--plot", str(png), "--profile", str(prof)]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(BENCH / "serve.py"), *args], capture_output=True, text=True,
        timeout=900, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out["runs"]) == CONFIGS
    servers = set()
    for cfg, by_rate in out["runs"].items():
        assert set(by_rate) == {"8", "inf"}
        for rate, rows in by_rate.items():
            want = out["schedule"][rate]
            assert [r["round"] for r in rows] == [0, 1]
            for r in rows:
                # every request ran, to its drawn length (ignore_eos), from the same schedule
                assert r["completed"] == 4 and r["rejected"] == 0
                assert r["tokens_per_request"] == want["output_lens"]
                assert r["schedule_digest"] == want["digest"]
                # the load ran in processes other than the server's and the benchmark's
                assert r["server_pid"] != r["bench_pid"]
                assert not {r["server_pid"], r["bench_pid"]} & set(r["load_pids"])
                assert r["server_exit"] == 0
                servers.add((cfg, r["round"], r["server_pid"]))
        # medians and min-max spreads over the two repeats
        s = out["results"][cfg]["inf"]["throughput_tok_s"]
        assert s["n"] == 2 and s["min"] <= s["median"] <= s["max"]
    assert len({pid for _, _, pid in servers}) == len(servers) == 8  # a fresh server each round
    sat = out["ratios"]["mod_over_dense"]["saturated_throughput"]
    assert len(sat["values"]) == 2 and sat["min"] <= sat["median"] <= sat["max"]
    assert {"mod_over_dense", "continuous_over_static"} <= set(out["ratios"])
    assert [len(m["ratios"]) for m in out["model_decode"]] == [2, 2]  # batch 1 and 16, per round
    assert out["keeps"]["batch"] == 16 and out["keeps"]["throughput"]["n"] == 2
    assert any("server keeps" in t["what"] for t in out["targets"])
    assert "others_busy_share" in out and all("others_busy" in r for r in out["rounds"])
    assert "server keeps" in proc.stdout and "targets (issue 54" in proc.stdout
    text = prof.read_text()
    assert "## Phases of a step" in text and "## Self time by kind" in text
    for cfg in ("mod/continuous", "dense/continuous"):
        p = out["profile"][cfg]
        assert p["server_exit"] == 0 and p["clean_steps"] > 0 and p["profiled_steps"] > 0
        assert sum(ph["ms_per_step"] for ph in p["phases"]) == pytest.approx(p["step_ms"])
        assert f"## {cfg}: top functions" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_schedule_is_fixed_by_the_seed_and_the_rate():
    serve = _module("serve")
    load = _module("serve_load")
    args = serve.parse_args(["--quick"])
    a = serve.workload(args, 4.0, 256, None)
    assert a == serve.workload(args, 4.0, 256, None)
    assert a != serve.workload(serve.parse_args(["--quick", "--seed", "1"]), 4.0, 256, None)
    assert all(x["at"] == 0 for x in serve.workload(args, float("inf"), 256, None))
    # what a load process reports it sent digests to the schedule's own digest
    keys = [load.request_key(x) for x in reversed(a)]
    assert load.schedule_digest(keys) == serve.describe(a)["digest"]


def _row(thr: float, ttft: float = 1.0, kv: float = 1.0) -> dict:
    report = _module("serve_report")
    row = dict.fromkeys(report.METRICS, 1.0)
    row.update(throughput_tok_s=thr, ttft_p99_s=ttft, kv_bytes_per_token=kv)
    return row


def test_ratios_are_taken_per_repeat_then_summarised():
    report = _module("serve_report")
    runs = {
        "mod/continuous": {"4": [_row(40, 0.1, 6), _row(41, 0.2, 6)],
                           "inf": [_row(300, kv=3), _row(100, kv=3)]},
        "dense/continuous": {"4": [_row(40, 0.3, 10), _row(40, 0.3, 12)],
                             "inf": [_row(150, kv=10), _row(100, kv=10)]},
        "mod/static": {"4": [_row(39, 0.9), _row(40, 0.9)], "inf": [_row(200), _row(100)]},
        "dense/static": {"4": [_row(38), _row(38)], "inf": [_row(100), _row(100)]},
    }  # fmt: skip
    rat = report.ratios(runs)
    sat = rat["mod_over_dense"]["saturated_throughput"]
    assert (
        sat["values"] == [2.0, 1.0] and sat["median"] == 1.5 and (sat["min"], sat["max"]) == (1, 2)
    )
    kv = rat["mod_over_dense"]["kv_bytes_per_token_worst_rate"]
    assert kv["values"] == [pytest.approx(0.6), pytest.approx(0.5)]
    model = [{"ratios": {"16": 1.25}}, {"ratios": {"16": 1.0}}]
    keep = report.keeps(runs, model, 16)
    assert keep["throughput"]["values"] == [1.6, 1.0]
    results = report.aggregate(runs)
    offered = {"4": 40.0}  # static keeps up with 4 req/s: 39-40 tok/s of 40 offered
    assert report.sustained(results, "mod/static", offered) == "4"
    rows = report.targets(results, rat, keep, offered, "small", 16)
    ttft = next(r for r in rows if r["what"].startswith("MoD continuous/static TTFT p99"))
    assert "(4)" in ttft["what"] and ttft["median"] == pytest.approx(0.5 * (0.1 + 0.2) / 0.9)
    assert ttft["median_on_target_side"] is True
    first = rows[0]
    assert first["target"] == 1.3 and first["median"] == 1.5


def test_the_model_ratio_is_read_from_a_mod_bench_output(tmp_path):
    servers = _module("serve_servers")
    bench = {"decode": {"prompt_len": 512, "new_tokens": 64, "ratios": [
        {"batch_size": 1, "speedup": 1.5}, {"batch_size": 16, "speedup": 1.2}]}}  # fmt: skip
    path = tmp_path / "bench.txt"
    path.write_text("## Bars\nsome table\n" + json.dumps(bench) + "\n")
    got = servers.read_model_ratio(str(path))
    assert got["ratios"] == {"1": 1.5, "16": 1.2} and "512 + 64" in got["source"]


def test_profile_names_are_stable_and_grouped():
    profile = _module("serve_profile")
    assert profile.name_and_kind("~", "<method 'tolist' of 'torch._C.TensorBase' objects>") == (
        "method 'tolist' of 'torch._C.TensorBase'",
        "host reads (a sync on a GPU)",
    )
    assert profile.name_and_kind("~", "<built-in method torch._C._nn.linear>")[1] == "torch ops"
    where = "/x/site-packages/mixture_of_depths/serve/paged.py"
    assert profile.name_and_kind(where, "_gather") == ("serve/paged.py:_gather",
                                                       "engine Python (serve/)")  # fmt: skip
    assert profile.name_and_kind("/x/src/mixture_of_depths/model.py", "forward")[1].startswith(
        "model Python"
    )
