"""`mod study --plan mor --quick` on a cut-down plan: every run trains to its budget (charged by
`estimate_flops`, MoR priced per recursion step), each arm's best width gets a second seed, and
the report judges the paper's claims from the results (and says "not run yet" without them)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mixture_of_depths import MoDConfig
from mixture_of_depths.flops import estimate_flops
from mixture_of_depths.studies import mor, runner


def test_quick_mor_plan_trains_to_budget_and_judges_the_claims(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(mor, "QUICK", dataclasses.replace(mor.QUICK, budgets=(1e9,)))
    keep = {"dense", "MoR expert, recursion KV", "MoR token, shared KV"}
    monkeypatch.setattr(mor, "ARMS", tuple(a for a in mor.ARMS if a[0] in keep))
    monkeypatch.setattr(mor, "_lengths", lambda settings: ((32, 4),))
    out, work = tmp_path / "mor", tmp_path / "work"
    results = runner.study(mor.PLAN, out, work, quick=True, data=str(corpus), progress=False)
    grid = [r for r in results if r["group"] == "isoflop"]
    assert len(grid) == 3 and len(results) == 3 + 4 + 3  # grid, the pair (two seeds), seeds
    for r in results:
        cfg = MoDConfig(**r["model"])
        step = estimate_flops(cfg, r["seq_len"], r["batch_size"]).train
        assert r["steps"] == int(r["budget"] // step) and r["flops_budget_used"] <= r["budget"]
    rec = next(r for r in grid if r["label"] == "MoR expert, recursion KV")
    assert set(rec["routing_accuracy"]) == {"1.recursion", "2.recursion"}
    text = (out / "report.md").read_text()
    assert "MoR (expert choice) reaches a lower loss" in text
    rows = dict((c, v) for c, _, v in mor.claim_rows(results))
    first = rows[mor.CLAIMS[0][0]]
    assert first.split(" ")[0] in ("supported", "contradicted", "within"), first
    assert rows[mor.CLAIMS[1][0]] == "not run yet"  # no plain recursive arm ran
    assert rows[mor.CLAIMS[-1][0]].startswith("not testable here")
    mor.write_report([], tmp_path / "empty", mor.QUICK)
    assert "Not run yet." in (tmp_path / "empty" / "report.md").read_text()
