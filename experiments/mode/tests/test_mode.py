"""The MoDE study on a cut-down plan."""

from __future__ import annotations

import dataclasses
import json

import pytest

from experiments.mode import study as mode
from mixture_of_depths import MoDConfig
from mixture_of_depths.flops import estimate_flops
from mixture_of_depths.studies import runner


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
    claims = json.loads((out / "findings.json").read_text())["budgets"][0]["claims"]
    # Only the claim whose runs are in the plan: no staged or plain integrated MoDE here.
    assert [c["baseline"] for c in claims] == ["MoE, capacity 0.5 (drops)"]
    assert claims[0]["best"] == "integrated MoDE, capacity 0.5"
