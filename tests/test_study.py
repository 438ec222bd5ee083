"""The isoFLOP study on tiny budgets: every planned run is trained to its budget, resumes after an
interruption without redoing finished runs, and writes the report and plots."""

from __future__ import annotations

import dataclasses
import json

import pytest

import mixture_of_depths.study as st
from mixture_of_depths import MoDConfig
from mixture_of_depths.flops import estimate_flops


@pytest.fixture()
def tiny(monkeypatch: pytest.MonkeyPatch, tmp_path):
    monkeypatch.setenv("MOD_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "data"
    data.mkdir()
    for i in range(6):
        (data / f"f{i}.py").write_text(f"def f(x):\n    return x * {i}\n" * 200)
    settings = dataclasses.replace(
        st.QUICK, budgets=(1e9, 3e9), sizes=st.QUICK.sizes[:1], ablation_size=st.QUICK.sizes[0][0]
    )
    monkeypatch.setattr(st, "QUICK", settings)
    monkeypatch.setattr(st, "ABLATIONS", st.ABLATIONS[:2])
    return settings, str(data)


def test_study_runs_to_budget_resumes_and_reports(tiny, tmp_path, monkeypatch):
    settings, data = tiny
    out, work = tmp_path / "study", tmp_path / "work"
    real = st.run_one
    calls = []

    def flaky(spec, *a, **kw):
        if len(calls) == 3:
            raise KeyboardInterrupt  # the study is interrupted after three runs
        calls.append(spec.name)
        return real(spec, *a, **kw)

    monkeypatch.setattr(st, "run_one", flaky)
    with pytest.raises(KeyboardInterrupt):
        st.study(out, work, quick=True, data=data, progress=False)
    assert len(st.load_results(out / "results.jsonl")) == 3
    monkeypatch.setattr(st, "run_one", real)
    results = st.study(out, work, quick=True, data=data, progress=False)

    names = [r["name"] for r in results]
    planned = st.plan(settings)
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
    report = (out / "report.md").read_text()
    assert "## Headline" in report and "Ablations" in report
    assert (out / "isoflop.png").exists() and (out / "ablations.png").exists()
    lines = (out / "results.jsonl").read_text().splitlines()
    assert all(json.loads(line)["val_loss_causal"] > 0 for line in lines)
    # Rerunning a finished study trains nothing.
    monkeypatch.setattr(st, "run_one", lambda *a, **k: pytest.fail("nothing should rerun"))
    assert len(st.study(out, work, quick=True, data=data, progress=False)) == len(results)
