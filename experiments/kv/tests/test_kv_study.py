"""The KV-strategy study, cut down (slow: `pytest -m slow`)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from experiments.common import measure
from experiments.kv import study as kv
from mixture_of_depths import MoDConfig
from mixture_of_depths.flops import estimate_flops
from mixture_of_depths.studies import runner, verdict

FOLDER = Path(kv.__file__).parent  # the committed results, measurements, report and findings


@pytest.mark.slow
def test_kv_plan_trains_both_lengths_to_budget_and_measures_each_model(
    tiny_corpus, tmp_path, monkeypatch
):
    """`mod study experiments/kv` cut down to one budget and one strategy pair: each run trains
    at its own length and batch for the steps its FLOPs buy (residual charged its extra K/V and
    wider attention, so fewer), the seeds go to each strategy's best, and every trained model is
    measured (decode speed, cache bytes, prefill calibration) into the report."""
    data = tiny_corpus
    settings = dataclasses.replace(kv.QUICK, budgets=(1e9,), eval_batches=1)
    monkeypatch.setattr(kv, "QUICK", settings)
    monkeypatch.setattr(kv, "ARCHS", kv.ARCHS[:3])  # dense, 12.5% none, 12.5% residual
    monkeypatch.setattr(measure, "DECODE_ROUNDS", 1)
    out, work = tmp_path / "kv", tmp_path / "work"
    results = runner.study(kv.PLAN, out, work, quick=True, data=data, progress=False)
    assert len(results) == 2 * 3 + 2 * 2  # two lengths x three models, then two seeds a length
    for r in results:
        cfg = MoDConfig(**r["model"])
        assert cfg.max_seq_len == r["seq_len"] and r["seq_len"] * r["batch_size"] == 128
        per_step = estimate_flops(cfg, r["seq_len"], r["batch_size"]).train
        assert r["steps"] == max(1, int(r["budget"] // per_step))
    by = {(r["seq_len"], r["label"], r["seed"]): r for r in results}
    for T in (32, 64):
        assert by[T, "MoD 12.5%, residual", 0]["steps"] < by[T, "MoD 12.5%, none", 0]["steps"]
        assert {(T, lab, 1) in by for lab in ("MoD 12.5%, none", "MoD 12.5%, residual")} == {True}
    measures = {m["name"]: m for m in runner.load_results(out / "measures.jsonl")}
    assert set(measures) == {r["name"] for r in results}
    for m in runner.load_results(out / "decode.jsonl"):  # one row per model, every cell measured
        measures[m["name"]].update(m)
    for r in results:
        m = measures[r["name"]]
        assert m["decode_tok_s_b1"] > 0 and m["decode_tok_s_b8"] > 0
        assert [s for s, _ in m["train_curve"]][-1] == r["steps"]
        cfg = MoDConfig(**r["model"])
        full = 2 * 2 * cfg.n_kv_heads * cfg.head_dim * cfg.n_layers  # bf16, every layer
        if cfg.is_dense or cfg.skipped_kv == "residual":
            assert m["kv_bytes_per_token_measured"] == pytest.approx(full)
        else:
            assert m["kv_bytes_per_token_measured"] < full
            assert 0 <= m["decisions_differ"] <= 1
    report = (out / "report.md").read_text()
    assert "## Budget 1.0e+09 FLOPs, sequences of 64" in report
    assert "capacity 12.5%: none" in report and (out / "kv.png").exists()
    assert "at the same steps" in report  # the pair's training loss on the same batches
    found = json.loads((out / "findings.json").read_text())
    cells = found["cells"]
    assert [c["seq_len"] for c in cells] == [32, 64] and all(c["pairs"] for c in cells)
    for c in cells:  # each pair's verdict is the verdict module's, quoted in the report
        judged = found["verdicts"][c["pairs"][0]["verdict"]]
        assert judged["verdict"] in verdict.WORDS and judged["text"] in report


def test_the_committed_report_is_what_the_committed_results_make(tmp_path: Path):
    """`mod study experiments/kv --report` from the committed results and measurements, into a
    folder of its own: the report and findings equal the committed ones, byte for byte."""
    for name in ("results.jsonl", "measures.jsonl", "decode.jsonl"):
        shutil.copy(FOLDER / name, tmp_path / name)
    runner.rewrite_report(kv.PLAN, tmp_path)
    for name in ("report.md", "findings.json"):
        assert (tmp_path / name).read_bytes() == (FOLDER / name).read_bytes(), name


def test_a_pair_with_one_shared_seed_is_a_reading_and_the_best_capacities_are_not_bracketed():
    """Only each strategy's best run at the larger budget has a second seed: a capacity's pair
    shares one seed (a reading), and the strategies at their best of two capacities are at an
    end of them (and of the one learning rate): no pair says better or worse."""
    found = kv.findings(runner.load_results(FOLDER / "results.jsonl"))
    words = {k: v["verdict"] for k, v in found["verdicts"].items()}
    pairs = [k for k in words if "-c12.5-" in k or "-c25-" in k]
    assert len(pairs) == 8 and {words[k] for k in pairs} == {verdict.ONE_SEED}
    assert words["residual-vs-none-4e12-t256"] == verdict.UNBRACKETED
    assert words["residual-vs-none-4e12-t1024"] == verdict.WITHIN
    why = found["verdicts"]["residual-vs-none-4e12-t256"]["why"]
    assert "its best capacity, 12.5%, is the lowest tried (12.5%, 25%)" in why
    assert "one learning rate tried (2e-3)" in why
