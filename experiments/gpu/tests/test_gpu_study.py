"""The round-3 GPU plan (`studies.gpu`): its arms and seeds, the budget from the timing pass and
the corpus's one-epoch cap (pure functions, against `runner.steps_for_budget`), and, slow, the
dry run of every part on the CPU, resumed."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from experiments.gpu import STUDY, running
from experiments.gpu import planning as gp
from experiments.round3 import planning as r3
from mixture_of_depths.config import MoDConfig
from mixture_of_depths.studies import verdict as vd
from mixture_of_depths.studies.runner import budget_tag, rewrite_report, steps_for_budget

CORPUS = 9_227_312  # the default corpus's BPE training tokens under Python 3.11 (docs/bench.md)
TAGS = ("dense", "mod", "residual", "mlp", "st", "bare", "dense-lr4e-3", "mod-lr1e-3", "mod-lr4e-3")


def _timings(step_s: float, concurrency: int = 16) -> dict[str, gp.Timing]:
    return {t: gp.Timing(step_s, step_s / 3, 12.0, concurrency) for t in TAGS}


def _per_arm(runs):  # an arm's seeds train the same steps
    return list({gp.tag_of(sp): sp for sp in runs}.values())


def _tokens(spec) -> int:  # the oracle: the runner's own step count
    g = gp.FULL.round3.grid
    cfg = MoDConfig(**spec.model)
    steps = steps_for_budget(cfg, g.seq_len, g.batch_size, spec.budget, spec.capacity_warmup)[0]
    return steps * g.batch_size * g.seq_len


def test_the_deciding_arms_come_first_with_three_seeds_each_as_round_3_builds_them():
    runs = gp.specs(gp.FULL, 5e13, 4096)
    first = gp.specs(gp.FULL, 5e13, 4096, tiers=1)
    assert [(gp.tag_of(sp), sp.seed) for sp in first] == [
        (t, sd) for t in ("dense", "mod", "residual", "mlp") for sd in (0, 1, 2)
    ]
    assert runs[: len(first)] == first  # the extras after them
    extras = {gp.tag_of(sp) for sp in runs[len(first) :]}
    assert extras == {"st", "bare", "dense-lr4e-3", "mod-lr1e-3", "mod-lr4e-3"}
    assert len({sp.name for sp in runs}) == len(runs) == 23
    for sp in runs:
        cpu = r3.spec_of(r3.FULL, gp.arm(gp.tag_of(sp)), sp.seed)  # round 3's run on the CPU
        assert sp.name == f"gpu-{cpu.name}".replace(budget_tag(1.5e14), budget_tag(5e13))
        assert sp.model == {**cpu.model, "vocab_size": 4096}
        assert (sp.seq_len, sp.batch_size, sp.evaluations) == (1024, 4, 10)
        assert (sp.lr, sp.capacity_warmup, sp.label) == (cpu.lr, cpu.capacity_warmup, cpu.label)
    assert MoDConfig(**first[6].model).skipped_kv == "residual"
    with pytest.raises(ValueError, match="no round-3 arm 'nope'"):
        gp.arm("nope")


def test_the_corpus_cap_lets_no_run_read_more_than_the_training_split():
    runs = gp.specs(gp.FULL, 1.0, 4096)
    cap = gp.corpus_budget(gp.FULL, runs, CORPUS)
    at_cap = gp.specs(gp.FULL, cap, 4096)
    assert all(_tokens(sp) <= CORPUS for sp in _per_arm(at_cap))
    # the cheapest run per token (dense XS) reads the whole split's worth at the cap, less than
    # one batch, and one step more would be over it
    dense = at_cap[0]
    assert CORPUS - 4 * 1024 < _tokens(dense) <= CORPUS
    more = gp.specs(gp.FULL, cap + gp.step_flops(gp.FULL, dense), 4096)[0]
    assert _tokens(more) > CORPUS
    with pytest.raises(ValueError, match="fewer than one batch"):
        gp.corpus_budget(gp.FULL, runs, 4000)


@pytest.mark.parametrize("x, want", [(5.47e13, 5.4e13), (5.5e13, 5.5e13), (9.99e12, 9.9e12),
                                     (1e13, 1e13), (4e9, 4e9)])  # fmt: skip
def test_budgets_round_down_to_what_their_run_names_say(x, want):
    assert gp.round_down(x) == want <= x
    assert float(budget_tag(want).replace("e", "e+")) == want


def test_a_fast_gpu_trains_every_arm_to_one_epoch_and_a_slow_one_fits_its_time():
    fast = gp.choose(gp.FULL, _timings(0.02), CORPUS, 4096, 360)
    assert (fast.limit, fast.tiers, len(fast.specs)) == ("corpus", 3, 23)
    assert fast.budget == fast.corpus_budget and fast.predicted_s <= 360
    assert all(_tokens(sp) <= CORPUS for sp in _per_arm(fast.specs))
    assert len({sp.budget for sp in fast.specs}) == 1  # the same FLOPs for every run
    for step_s in (0.12, 0.2, 0.4):
        c = gp.choose(gp.FULL, _timings(step_s), CORPUS, 4096, 360)
        assert c.limit == "time" and c.budget < c.corpus_budget
        assert c.predicted_s <= 360  # the slowest run, by the plan's own prediction
        # the extras stay while they cost the deciding runs at most a fifth of their budget
        alone = dataclasses.replace(gp.FULL, tiers=gp.FULL.tiers[:1])
        first = gp.choose(alone, _timings(step_s), CORPUS, 4096, 360).budget
        assert c.budget >= 0.8 * first * 0.98  # (both rounded down to two digits)
        if c.tiers < 3:
            more = dataclasses.replace(gp.FULL, tiers=gp.FULL.tiers[: c.tiers + 1], keep_share=0)
            assert gp.choose(more, _timings(step_s), CORPUS, 4096, 360).budget < 0.8 * first
    slow = gp.choose(gp.FULL, _timings(0.4), CORPUS, 4096, 360)
    assert slow.tiers == 1 and len(slow.specs) == 12
    with pytest.raises(ValueError, match="give more --minutes"):
        gp.choose(gp.FULL, _timings(5.0), CORPUS, 4096, 60)


def test_an_arm_the_timing_pass_missed_drops_its_tier_and_the_ones_after():
    timings = _timings(0.02)
    del timings["st"]
    c = gp.choose(gp.FULL, timings, CORPUS, 4096, 360)
    assert c.tiers == 1 and {gp.tag_of(sp) for sp in c.specs} == {"dense", "mod", "residual", "mlp"}
    for tag in ("residual", "mlp"):
        del timings[tag]
    with pytest.raises(ValueError, match="measured none of the deciding arms"):
        gp.choose(gp.FULL, timings, CORPUS, 4096, 360)


def test_a_part_past_its_timeout_gets_a_sigterm_then_a_sigkill(tmp_path):
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, lambda *a: None); time.sleep(60)"
    cmds = {"ok": [sys.executable, "-c", "pass"], "bad": [sys.executable, "-c", "exit(3)"],
            "slow": [sys.executable, "-c", stubborn]}  # fmt: skip
    status = running.run_all(cmds, tmp_path, 1.5, 0.5, dict(os.environ), running.Stopped())
    assert status == {"ok": "ok", "bad": "exit 3", "slow": "timed out"}


def test_the_report_words_every_comparison_by_the_verdict_module_and_rewrites_from_its_plan(
    tmp_path,
):
    """Each arm against dense and each rate against round 2's is a verdict (the GPU's rows are
    measured on the GPU: testable), rewritten from plan.json and the results by `--report`."""
    runs = gp.specs(gp.FULL, 5e13, 4096)
    base = {"dense": 2.70, "mod": 3.10, "residual": 3.00, "mlp": 2.65, "st": 3.08, "bare": 3.05,
            "dense-lr4e-3": 2.50, "mod-lr1e-3": 3.15, "mod-lr4e-3": 3.12}  # fmt: skip
    rows = []
    for sp in runs:
        loss = base[gp.tag_of(sp)] + 0.01 * sp.seed  # every arm's seeds spread 0.01-0.02
        rows.append({**dataclasses.asdict(sp), "val_loss_causal": loss, "val_loss_topk": loss,
                     "tokens": 1, "steps": 1, "params": 1, "tokens_per_s": 1.0,
                     "device": "a GPU", "dtype": "bfloat16"})  # fmt: skip
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = {"data": "stdlib", "python": "3.11", "train_tokens": CORPUS, "val_tokens": 1}
    plan = {"runs": [sp.name for sp in runs], "corpus": corpus, "device": "a GPU",
            "limit": "time", "seq_len": 1024, "batch_size": 4, "budget": 5e13,
            "cpu_round_epochs": 2.0}  # fmt: skip
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    rewrite_report(STUDY, tmp_path)  # `mod study experiments/gpu --report`
    found = json.loads((tmp_path / "findings.json").read_text())["verdicts"]
    text = (tmp_path / "report.md").read_text()
    assert all(v["text"] in text for v in found.values())
    mlp = found["mlp-vs-dense"]  # beyond the spread, but dense's best rate is the top tried
    assert mlp["verdict"] == vd.UNBRACKETED and "is the highest tried (2e-3, 4e-3)" in mlp["why"]
    assert "dense XS: one size tried (XS)" in mlp["caveats"]
    assert found["mod-lr4e-3-vs-mod"]["verdict"] == vd.WITHIN  # +0.02, the spread
    assert found["mod-vs-dense-best-rates"]["b"] == "dense XS, lr 4e-3"
    assert "better" not in text and "worse" not in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the plan runs")
def test_without_cuda_the_plan_says_so_and_exits_0(capsys):
    assert running.main([]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {
        "gpu": False, "torch": torch.__version__}  # fmt: skip


@pytest.mark.slow  # ~1 min on 2 busy cores: 11 processes start torch
def test_the_dry_run_runs_every_part_and_a_rerun_resumes_it(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(6):
        body = "".join(f"def f{j}(x):\n    return x * {j} + {i}  # n{j}\n" for j in range(400))
        (data / f"f{i}.py").write_text(body)
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, "-m", "experiments.gpu", "--dry-run", "--data",
           str(data), "--out", str(out), "--work", str(work)]  # fmt: skip
    env = {**os.environ, "MOD_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads(run.stdout.strip().splitlines()[-1])
    assert res["runs_done"] == res["runs_planned"] == 5 and res["not_finished"] == {}
    assert res["limit"] == "ceiling" and res["arms"]["dense XS"]["seeds"] == 2
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and len({r["budget"] for r in rows}) == 1
    for r in rows:
        assert {"device", "dtype", "wall_s", "copy_probe", "loss_by_position"} <= set(r)
        assert r["device"] == "cpu" and r["dtype"] == "float32" and 0 < r["epochs"] <= 1
        assert (out / "metrics" / f"{r['name']}.jsonl").exists()
    report = (out / "report.md").read_text()
    assert "Compared only with each other" in report and "| dense XS | 2 |" in report
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming" in again.stdout and "0 runs at once (5 done before)" in again.stdout
    assert len((out / "results.jsonl").read_text().splitlines()) == 5
