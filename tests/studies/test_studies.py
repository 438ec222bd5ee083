"""The isoFLOP study on tiny budgets: every planned run is trained to its budget, resumes after an
interruption without redoing finished runs, and writes the report and plots."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mixture_of_depths import MoDConfig
from mixture_of_depths.flops import estimate_flops
from mixture_of_depths.studies import convert, isoflop, kv, measure, mode, runner


@pytest.fixture()
def tiny(monkeypatch: pytest.MonkeyPatch, tmp_path):
    monkeypatch.setenv("MOD_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "data"
    data.mkdir()
    for i in range(6):
        (data / f"f{i}.py").write_text(f"def f(x):\n    return x * {i}\n" * 200)
    quick = isoflop.QUICK
    settings = dataclasses.replace(
        quick, budgets=(1e9, 3e9), sizes=quick.sizes[:1], ablation_size=quick.sizes[0][0]
    )
    monkeypatch.setattr(isoflop, "QUICK", settings)
    monkeypatch.setattr(isoflop, "ABLATIONS", isoflop.ABLATIONS[:2])
    return settings, str(data)


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


def test_rows_written_before_the_predictor_default_rebuild_as_they_trained(tmp_path):
    """A row that names no causal router trained with the aux loss at 0.1 (the default then);
    rows that name their routing, and lines with no model (a metrics log), are read as written."""
    rows = [
        {"name": "old", "model": {"layer_pattern": "DR", "d_model": 32}},
        {"name": "pred", "model": {"layer_pattern": "DR", "causal_router": "predictor"}},
        {"name": "aux", "model": {"causal_router": "aux_loss", "aux_loss_weight": 0.5}},
        {"step": 10, "loss": 3.0},
    ]
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = {r.get("name", "log"): r for r in runner.load_results(path)}
    assert got["old"]["model"] == {"layer_pattern": "DR", "d_model": 32, **runner.LEGACY_ROUTING}
    assert MoDConfig(**got["old"]["model"]).aux_loss_weight == 0.1
    assert got["pred"]["model"] == rows[1]["model"] and got["aux"]["model"] == rows[2]["model"]
    assert got["log"] == rows[3]


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


def test_mode_plan_charges_the_bound_reports_what_ran_and_judges_the_claims(
    tiny, tmp_path, monkeypatch
):
    """`mod study --plan mode` on a cut-down plan: each run gets the steps its bound buys, spends
    at most that, reports its experts' shares, and the report judges both claims."""
    _, data = tiny
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


# The KV and conversion studies are complete (docs/study/kv, docs/convert); their plans' long
# smoke tests run with `pytest -m slow`; the shared runner is tested here by the mode plan's.
@pytest.mark.slow
def test_kv_plan_trains_both_lengths_to_budget_and_measures_each_model(tiny, tmp_path, monkeypatch):
    """`mod study --plan kv` cut down to one budget and one strategy pair: each run trains at its
    own length and batch for the steps its FLOPs buy (residual charged its extra K/V and wider
    attention, so fewer), the seeds go to each strategy's best, and every trained model is
    measured (decode speed, cache bytes, prefill calibration) into the report."""
    _, data = tiny
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
    cells = json.loads((out / "findings.json").read_text())["cells"]
    assert [c["seq_len"] for c in cells] == [32, 64] and all(c["pairs"] for c in cells)


@pytest.mark.hf
@pytest.mark.slow
def test_convert_plan_trains_each_variant_and_times_it_beside_dense(tiny, tmp_path, monkeypatch):
    """`mod study --plan convert` cut down: the dense model goes through the Llama layout and
    back at each capacity; the untrained conversion keeps the dense weights, router tuning
    changes only routers and predictors, the full fine-tune changes the rest; every MoD model is
    timed beside the dense original and the report lists each."""
    pytest.importorskip("transformers", minversion="5")
    from mixture_of_depths.runtime.checkpoint import load_model
    from mixture_of_depths.train.tune import is_router_param

    _, data = tiny
    monkeypatch.setattr(convert, "QUICK", convert.Settings("tiny-dense", 3, 2, 2, 1))
    monkeypatch.setattr(measure, "DECODE_ROUNDS", 1)
    out, work = tmp_path / "convert", tmp_path / "work"
    results = convert.run(out, work, quick=True, data=data, progress=False)
    names = {r["name"] for r in results}
    want = {f"{v}-{convert._tag(c)}" for v in convert.VARIANTS for c in convert.CAPACITIES}
    assert names == want | {"dense", "dense+ft"}
    dense = load_model(work / "dense" / "checkpoint")[0].state_dict()
    for c in convert.CAPACITIES:
        tag = convert._tag(c)
        conv = load_model(work / f"converted-{tag}")[0]
        assert conv.config.capacity == c and conv.config.router_gate == "straight_through"
        states = {
            v: load_model(convert._ckpt(work, f"{v}-{tag}"))[0].state_dict()
            for v in convert.VARIANTS
        }
        for k, v in dense.items():  # the conversion kept every dense weight, bit for bit
            assert torch.equal(states["converted"][k], v), k
            assert torch.equal(states["routers"][k], v), k
        assert any(not torch.equal(states["full"][k], v) for k, v in dense.items())
        assert any(
            not torch.equal(states["routers"][k], states["converted"][k])
            for k in states["converted"] if is_router_param(k)
        )  # fmt: skip
    for r in results:
        if r["name"] not in ("dense", "dense+ft"):
            assert r["decode_tok_s_b1"] > 0 and r["speedup_b8"] > 0
    report = (out / "report.md").read_text()
    assert report.count("| 0.125 |") == 4 and "dense original" in report
    assert (out / "convert.png").stat().st_size > 0
    # Resumable: a second call trains nothing and measures nothing again.
    again = convert.run(out, work, quick=True, data=data, progress=False)
    assert again == results


@pytest.mark.parametrize("busy, warned", [(0.5, True), (0.05, False)])
def test_a_decode_timing_records_and_flags_the_load_other_processes_put_on_the_cpus(
    finished_run, monkeypatch: pytest.MonkeyPatch, capsys, busy: float, warned: bool
):
    corpus, run = finished_run
    monkeypatch.setattr(measure, "DECODE_ROUNDS", 1)
    monkeypatch.setattr(measure, "DECODE_NEW", 2)
    # /proc/stat before and after: 10 CPU-seconds pass, this process uses 1 of them
    snaps = iter([(0.0, 0.0, 0.0), (10.0, 1.0 + 10 * busy, 1.0)])
    monkeypatch.setattr(measure, "cpu_snapshot", lambda: next(snaps))
    speeds = measure.decode_speeds({"a": run / "checkpoint"}, 16, str(corpus))
    assert speeds["a"]["others_busy"] == pytest.approx(busy)
    assert ("skewed" in capsys.readouterr().out) is warned
