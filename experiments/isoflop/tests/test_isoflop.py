"""Round 1, the isoFLOP study, on tiny budgets: every planned run is trained to its budget,
resumes after an interruption without redoing finished runs, and writes the report and plots;
its findings from hand-made rows."""

from __future__ import annotations

import dataclasses
import json

import pytest

from experiments.isoflop import study as isoflop
from mixture_of_depths import MoDConfig
from mixture_of_depths.flops import estimate_flops
from mixture_of_depths.studies import runner


@pytest.fixture()
def tiny(monkeypatch: pytest.MonkeyPatch, tiny_corpus):
    quick = isoflop.QUICK
    settings = dataclasses.replace(
        quick, budgets=(1e9, 3e9), sizes=quick.sizes[:1], ablation_size=quick.sizes[0][0]
    )
    monkeypatch.setattr(isoflop, "QUICK", settings)
    monkeypatch.setattr(isoflop, "ABLATIONS", isoflop.ABLATIONS[:2])
    return settings, tiny_corpus


def test_study_runs_to_budget_resumes_and_reports(tiny, tmp_path, monkeypatch):
    settings, data = tiny
    out, work = tmp_path / "study", tmp_path / "work"
    real = runner.run_one
    calls = []

    def flaky(spec, *a, **kw):
        if len(calls) == 3:
            raise KeyboardInterrupt  # the study is interrupted after three runs
        calls.append(spec.name)
        return real(spec, *a, **kw)

    monkeypatch.setattr(runner, "run_one", flaky)
    with pytest.raises(KeyboardInterrupt):
        runner.study(isoflop.ISOFLOP, out, work, quick=True, data=data, progress=False)
    assert len(runner.load_results(out / "results.jsonl")) == 3
    monkeypatch.setattr(runner, "run_one", real)
    results = runner.study(isoflop.ISOFLOP, out, work, quick=True, data=data, progress=False)

    names = [r["name"] for r in results]
    planned = isoflop.plan(settings)
    assert len(names) == len(set(names)) == len(planned) + 2 * len(settings.budgets)
    assert {s.name for s in planned} <= set(names)
    for r in results:  # exactly the steps the budget buys, counted by estimate_flops
        per_step = estimate_flops(
            MoDConfig(**r["model"]), settings.seq_len, settings.batch_size
        ).train
        assert r["steps"] == max(1, int(r["budget"] // per_step))
        assert r["flops_budget_used"] <= r["budget"] or r["steps"] == 1
    seeds = [r for r in results if r["group"] == "seed"]
    assert len(seeds) == 4 and all(r["seed"] == 1 for r in seeds)
    # a budget's second seeds train before the next budget's runs: each budget completes in turn
    budgets = [r["budget"] for r in results]
    assert budgets == sorted(budgets), budgets
    report = (out / "report.md").read_text()
    assert "## Headline" in report and "Ablations" in report
    assert (out / "isoflop.png").exists() and (out / "ablations.png").exists()
    lines = (out / "results.jsonl").read_text().splitlines()
    assert all(json.loads(line)["val_loss_causal"] > 0 for line in lines)
    for line in lines:  # each row says the routing it was built with, defaults never implied
        model = json.loads(line)["model"]
        cfg = MoDConfig(**model)
        assert (model["causal_router"], model["aux_loss_weight"]) == (
            cfg.causal_router,
            cfg.aux_loss_weight,
        )
    # Rerunning a finished study trains nothing.
    monkeypatch.setattr(runner, "run_one", lambda *a, **k: pytest.fail("nothing should rerun"))
    again = runner.study(isoflop.ISOFLOP, out, work, quick=True, data=data, progress=False)
    assert len(again) == len(results)


def _row(label, seed, topk, causal, params=1e5, fpt=1e6, group="isoflop", budget=1e12, d=32):
    pattern = "D" if label.startswith("dense") else "DR"
    return {
        "name": f"{label}-{seed}", "group": group, "label": label, "budget": budget, "seed": seed,
        "model": {"layer_pattern": pattern, "d_model": d}, "params": params,
        "flops_per_forward_token": fpt, "tokens_per_s": 1000.0, "val_loss_topk": topk,
        "val_loss_causal": causal, "routing_accuracy_mean": None if pattern == "D" else 0.97,
    }  # fmt: skip


def test_findings_from_hand_made_results():
    """Best per architecture (MoD by causal loss, seeds averaged), verdict against the seed spread,
    the cheapest matching MoD forward, the causal gap and the ablation deltas."""
    rows = [
        _row("dense A", 0, 1.00, 1.00, fpt=2e6),
        _row("dense A", 1, 1.02, 1.02, fpt=2e6, group="seed"),  # mean 1.01, spread 0.02
        _row("dense B", 0, 1.05, 1.05, fpt=4e6),
        _row("MoD A", 0, 0.95, 1.00, fpt=1e6),  # causal 1.00 is within 0.02 of 1.01
        _row("MoD B", 0, 0.90, 0.99, fpt=3e6, d=64),  # best MoD by causal, not by top-k
        _row("MoD B, random routing", 0, 1.10, 1.188, group="ablation", d=64),
    ]
    f = isoflop.findings(rows)
    (b,) = f["budgets"]
    assert b["best_dense"]["label"] == "dense A" and b["best_dense"]["val_loss"] == 1.01
    assert b["best_dense"]["seeds"] == 2
    assert b["best_mod"]["label"] == "MoD B" and b["best_mod"]["val_loss_causal"] == 0.99
    assert b["seed_spread"] == pytest.approx(0.02)
    assert b["mod_gain"] == pytest.approx((1.01 - 0.99) / 1.01)
    assert b["verdict"] == "within the seed spread"
    assert b["mod_matching"]["label"] == "MoD A"  # cheaper forward than MoD B, also matches
    assert b["mod_matching"]["flops_ratio_vs_best_dense"] == pytest.approx(0.5)
    gaps = [0.05 / 0.95, 0.09 / 0.90]
    assert f["causal_gap"]["mean"] == pytest.approx(sum(gaps) / 2)
    base, rnd = f["ablations"]
    assert rnd["vs_baseline_causal"] == pytest.approx(0.2)
    report = "\n".join(isoflop.format_findings(f))
    assert "within the seed spread" in report and "0.50x the best dense" in report
