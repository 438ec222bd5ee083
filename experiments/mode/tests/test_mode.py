"""The MoDE study on a cut-down plan."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from experiments.mode import study as mode
from mixture_of_depths import MoDConfig
from mixture_of_depths.flops import estimate_flops
from mixture_of_depths.studies import runner, verdict

FOLDER = Path(mode.__file__).parent  # the committed results, report and findings


def test_mode_plan_charges_the_bound_reports_what_ran_and_judges_the_claims(
    tiny_corpus, tmp_path, monkeypatch
):
    """`mod study experiments/mode` on a cut-down plan: each run gets the steps its bound buys,
    spends at most that, reports its experts' shares, and the report judges both claims."""
    data = tiny_corpus
    settings = dataclasses.replace(mode.QUICK, budgets=(1e9,))
    monkeypatch.setattr(mode, "QUICK", settings)
    keep = ("MoE", "MoE, capacity 0.5 (drops)", "integrated MoDE, capacity 0.5")
    monkeypatch.setattr(mode, "ARCHS", tuple(a for a in mode.ARCHS if a[0] in keep))
    out, work = tmp_path / "mode", tmp_path / "work"
    results = runner.study(mode.PLAN, out, work, quick=True, data=data, progress=False)
    assert len(results) == 3 + 2  # and second seeds for the two best
    for r in results:
        cfg = MoDConfig(**r["model"])
        bound = estimate_flops(cfg, settings.seq_len, settings.batch_size).train
        assert r["steps"] == max(1, int(r["budget"] // bound))
        assert r["flops_spent"] <= r["flops_budget_used"] * (1 + 1e-9)
        assert set(r["train_expert_share"]) == {"0", "1"}
        if cfg.expert_capacity_factor is None:  # nothing drops, no no-ops: every slot ran
            assert r["flops_spent"] == pytest.approx(r["flops_budget_used"])
            assert r["expert_take_rate"] == {"0": 1.0, "1": 1.0}
        else:
            assert all(v <= 0.5 + 1e-9 for v in r["train_expert_share"].values())
    report = (out / "report.md").read_text()
    assert "integrated MoDE beats MoE that drops" in report
    found = json.loads((out / "findings.json").read_text())
    claims = found["budgets"][0]["claims"]
    # Only the claim whose runs are in the plan: no staged or plain integrated MoDE here.
    assert [c["baseline"] for c in claims] == ["MoE, capacity 0.5 (drops)"]
    assert claims[0]["best"] == "integrated MoDE, capacity 0.5"
    judged = found["verdicts"][claims[0]["verdict"]]  # the verdict module's, by key
    assert judged["verdict"] in verdict.WORDS and judged["text"] in report


def test_the_committed_report_is_what_the_committed_results_make(tmp_path: Path):
    """`mod study experiments/mode --report` from the committed results, into a folder of its
    own: the report and findings equal the committed ones, byte for byte."""
    shutil.copy(FOLDER / "results.jsonl", tmp_path / "results.jsonl")
    runner.rewrite_report(mode.PLAN, tmp_path)
    for name in ("report.md", "findings.json"):
        assert (tmp_path / name).read_bytes() == (FOLDER / name).read_bytes(), name


def test_the_committed_verdicts_count_the_seeds_and_name_the_one_size_and_rate():
    """Plain MoD trained two seeds at each budget (the report counts them from the results);
    every model ran at one size and one learning rate, so no claim is a win."""
    found = mode.findings(runner.load_results(FOLDER / "results.jsonl"))
    assert all(b["seeds"]["MoD"] == [0, 1] for b in found["budgets"])
    words = {k: v["verdict"] for k, v in found["verdicts"].items()}
    assert words == {
        "mode-vs-moe-5e12": verdict.UNBRACKETED, "integrated-vs-dropping-5e12": verdict.UNBRACKETED,
        "mode-vs-mod-5e12": verdict.WITHIN, "mode-vs-moe-1e13": verdict.UNBRACKETED,
        "integrated-vs-dropping-1e13": verdict.UNBRACKETED, "mode-vs-mod-1e13": verdict.UNBRACKETED,
    }  # fmt: skip
    held = found["verdicts"]["mode-vs-moe-1e13"]
    assert "one learning rate tried (2e-3)" in held["why"]
    assert "MoE (XS): one size tried (XS)" in held["caveats"]
