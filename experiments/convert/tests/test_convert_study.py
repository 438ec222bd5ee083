"""The conversion study, cut down (slow, needs the [hf] extra); its committed report rewritten
from its committed results (fast)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from experiments.common import measure
from experiments.convert import STUDY
from experiments.convert import study as convert
from mixture_of_depths.studies import runner, verdict

FOLDER = Path(convert.__file__).parent  # the committed results, report and findings


@pytest.mark.hf
@pytest.mark.slow
def test_convert_plan_trains_each_variant_and_times_it_beside_dense(
    tiny_corpus, tmp_path, monkeypatch
):
    """`mod study experiments/convert` cut down: the dense model goes through the Llama layout
    and back at each capacity; the untrained conversion keeps the dense weights, router tuning
    changes only routers and predictors, the full fine-tune changes the rest; every MoD model is
    timed beside the dense original and the report lists each."""
    pytest.importorskip("transformers", minversion="5")
    from mixture_of_depths.runtime.checkpoint import load_model
    from mixture_of_depths.train.tune import is_router_param

    data = tiny_corpus
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
    found = json.loads((out / "findings.json").read_text())["verdicts"]
    assert len(found) == 12 and all(v["text"] in report for v in found.values())
    assert (out / "convert.png").stat().st_size > 0
    # Resumable: a second call trains nothing and measures nothing again.
    again = convert.run(out, work, quick=True, data=data, progress=False)
    assert again == results


def test_the_committed_report_is_what_the_committed_results_make(tmp_path: Path):
    """`mod study experiments/convert --report` from the committed results, into a folder of its
    own: the report and findings equal the committed ones, byte for byte."""
    shutil.copy(FOLDER / "results.jsonl", tmp_path / "results.jsonl")
    runner.rewrite_report(STUDY, tmp_path)
    for name in ("report.md", "findings.json"):
        assert (tmp_path / name).read_bytes() == (FOLDER / name).read_bytes(), name


def test_each_model_is_judged_against_its_baseline_on_its_one_seed():
    """The untrained conversion against the dense original, a tuned model against dense trained
    as long: one seed each, so every verdict is a reading."""
    results = runner.load_results(FOLDER / "results.jsonl")
    judged = convert.verdicts(results, convert.Settings())
    assert len(judged) == 3 * 4 and {v.word for v in judged.values()} == {verdict.ONE_SEED}
    assert judged["converted-c0500-vs-dense"].b.label == "dense original"
    full = judged["full-c0250-vs-dense-ft"]
    assert full.b.label == "dense + 300 steps"
    assert full.diff == pytest.approx(1.3765 - 1.2579, abs=1e-4)
