"""Round 1, the isoFLOP study, on tiny budgets: every planned run is trained to its budget,
resumes after an interruption without redoing finished runs, and writes the report and plots;
its findings from hand-made rows."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from experiments.isoflop import study as isoflop
from mixture_of_depths import MoDConfig
from mixture_of_depths.flops import estimate_flops
from mixture_of_depths.studies import runner, verdict

HERE = Path(__file__).resolve().parent


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
    """Best per architecture (MoD by causal loss, seeds averaged), its verdict through the
    verdict module (dense's one learning rate named), the cheapest matching MoD forward and its
    verdict, the causal gap and the ablation deltas."""
    rows = [
        _row("dense A", 0, 1.05, 1.05, params=1e5, fpt=1e6),
        _row("dense B", 0, 1.00, 1.00, params=2e5, fpt=2e6),
        _row("dense B", 1, 1.02, 1.02, params=2e5, fpt=2e6, group="seed"),  # mean 1.01
        _row("dense C", 0, 1.06, 1.06, params=3e5, fpt=4e6),
        _row("MoD A", 0, 0.95, 1.00, params=1e5, fpt=1e6),  # causal 1.00 is within 0.02 of 1.01
        _row("MoD B", 0, 0.90, 0.99, params=2e5, fpt=3e6, d=64),  # best by causal, not by top-k
        _row("MoD B", 1, 0.91, 0.99, params=2e5, fpt=3e6, d=64, group="seed"),
        _row("MoD C", 0, 1.04, 1.04, params=3e5, fpt=4e6),
        _row("MoD B, random routing", 0, 1.10, 1.188, group="ablation", d=64),
    ]
    f = isoflop.findings(rows)
    (b,) = f["budgets"]
    assert b["best_dense"]["label"] == "dense B" and b["best_dense"]["val_loss"] == 1.01
    assert b["best_dense"]["seeds"] == 2
    assert b["best_mod"]["label"] == "MoD B" and b["best_mod"]["val_loss_causal"] == 0.99
    assert b["seed_spread"] == pytest.approx(0.02)
    assert b["mod_gain"] == pytest.approx((1.01 - 0.99) / 1.01)
    # paired -0.01 and -0.03 on seeds 0 and 1: a mean of -0.02, no more than dense B's range
    v = f["verdicts"][b["verdict"]]
    assert b["verdict"] == "mod-vs-dense-1e12" and v["verdict"] == verdict.WITHIN
    assert v["paired"] == pytest.approx({"0": -0.01, "1": -0.03})
    assert v["caveats"] == [f"dense B: {isoflop.DENSE_RATE}"]  # both best sizes interior
    mm = b["mod_matching"]
    assert mm["label"] == "MoD A"  # cheaper forward than MoD B, also matches
    assert mm["flops_ratio_vs_best_dense"] == pytest.approx(0.5)
    assert f["verdicts"][mm["verdict"]]["verdict"] == verdict.ONE_SEED  # MoD A: seed 0 alone
    mods = [r for r in rows if r["label"] in ("MoD A", "MoD B", "MoD C")]
    gaps = [(r["val_loss_causal"] - r["val_loss_topk"]) / r["val_loss_topk"] for r in mods]
    assert f["causal_gap"]["mean"] == pytest.approx(sum(gaps) / len(gaps))
    base, rnd = f["ablations"]
    assert rnd["vs_baseline_causal"] == pytest.approx(0.2)
    assert f["verdicts"][rnd["verdict"]]["verdict"] == verdict.ONE_SEED
    report = "\n".join(isoflop.format_findings(f))
    assert "| within the spread |" in report and "0.50x the best dense" in report
    assert v["text"] in report  # the sentence beside the table: means and pairs
    assert not any(w in report for w in ("dense better", "MoD better", "within the seed spread"))


def test_a_gap_beyond_the_spread_names_dense_s_one_rate_not_a_winner():
    rows = [
        _row("dense A", 0, 1.05, 1.05, params=1e5),
        _row("dense B", 0, 1.00, 1.00, params=2e5),
        _row("dense B", 1, 1.02, 1.02, params=2e5, group="seed"),
        _row("dense C", 0, 1.06, 1.06, params=3e5),
        _row("MoD A", 0, 1.00, 1.00, params=1e5),
        _row("MoD B", 0, 0.95, 0.95, params=2e5),
        _row("MoD B", 1, 0.96, 0.96, params=2e5, group="seed"),
        _row("MoD C", 0, 1.04, 1.04, params=3e5),
    ]
    (key,) = [k for k in isoflop.findings(rows)["verdicts"] if k.startswith("mod-vs-dense")]
    assert isoflop.findings(rows)["verdicts"][key]["verdict"] == verdict.UNBRACKETED
    assert isoflop.findings(rows, dense_rate=None)["verdicts"][key]["verdict"] == verdict.BETTER
    # without dense C, dense's best is the largest it tried: its optimum was not measured
    edge = isoflop.findings([r for r in rows if r["label"] != "dense C"], dense_rate=None)
    assert edge["verdicts"][key]["verdict"] == verdict.EDGE
    assert "its best size, B, is the largest tried (A, B)" in edge["verdicts"][key]["why"]


def test_the_edge_reads_both_the_headline_s_best_and_the_seeds_every_size_trained():
    # B is best on the mean of its own seeds; on seed 0, the one every size trained, A is
    grid = [("A", {0: 1.00}), ("B", {0: 1.01, 1: 0.97}), ("C", {0: 1.10})]
    assert isoflop.grid_edge(grid, "B") == (
        "its best size, A, is the smallest tried (A, B, C) on seed 0, the one every size trained"
    )
    # the reverse: seed 0 puts the best inside, the headline's best (its own mean) is an edge
    grid = [("A", {0: 1.02, 1: 0.96}), ("B", {0: 1.00, 1: 1.00}), ("C", {0: 1.10})]
    assert isoflop.grid_edge(grid, "A") == "its best size, A, is the smallest tried (A, B, C)"
    assert isoflop.grid_edge([("A", {0: 2.0}), ("B", {0: 1.0}), ("C", {0: 3.0})], "B") is None


def test_the_dense_rate_caveat_says_what_round_3_measured():
    """DENSE_RATE's 0.19 nats: dense XS at 4e-3 against 2e-3 at 1.5e14 FLOPs, 1024 tokens, the
    mean over the seeds of each (experiments/round3/results.jsonl)."""
    rows = runner.load_results(HERE.parents[1] / "round3" / "results.jsonl")

    def mean(name: str) -> float:
        got = [r["val_loss_causal"] for r in rows if r["name"].rsplit("-s", 1)[0] == name]
        assert len(got) >= 2
        return sum(got) / len(got)

    gain = mean("r3-1.5e14-dense") - mean("r3-1.5e14-dense-lr4e-3")
    assert f"{gain:.2f} nats lower at 4e-3" in isoflop.DENSE_RATE


def test_the_committed_report_is_the_one_its_results_make(tmp_path, monkeypatch):
    """report.md and findings.json rewritten from the committed results.jsonl, byte for byte
    (the plots are left out: they are slow, and no verdict is in them)."""
    monkeypatch.setattr(isoflop, "plots", lambda results, out: None)
    shutil.copy(HERE.parent / "results.jsonl", tmp_path / "results.jsonl")
    runner.rewrite_report(isoflop.ISOFLOP, tmp_path)
    for name in ("report.md", "findings.json"):
        assert (tmp_path / name).read_bytes() == (HERE.parent / name).read_bytes(), name


def test_the_round_1_verdicts_say_no_more_than_the_data():
    """The committed verdicts: at 5e12 dense's best size is the smallest tried and its rate one;
    at 5e13 MoD's best size has one seed; the ablations are one seed each."""
    v = json.loads((HERE.parent / "findings.json").read_text())["verdicts"]
    assert v["mod-vs-dense-5e12"]["verdict"] == verdict.UNBRACKETED
    assert "XXS, is the smallest tried" in " ".join(v["mod-vs-dense-5e12"]["caveats"])
    assert v["mod-vs-dense-1.6e13"]["verdict"] == verdict.WITHIN
    assert v["mod-vs-dense-5e13"]["verdict"] == verdict.ONE_SEED
    assert v["matching-1.6e13"]["verdict"] == verdict.WITHIN
    ablations = [k for k in v if k.startswith("ablation-")] + ["capacity-best"]
    assert len(ablations) == 7 and all(v[k]["verdict"] == verdict.ONE_SEED for k in ablations)
    assert v["capacity-best"]["a"] == "MoD M, capacity 12.5%"
