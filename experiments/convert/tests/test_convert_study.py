"""The conversion study, cut down (slow, needs the [hf] extra)."""

from __future__ import annotations

import pytest
import torch

from experiments.convert import study as convert
from mixture_of_depths.studies import measure


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
    assert (out / "convert.png").stat().st_size > 0
    # Resumable: a second call trains nothing and measures nothing again.
    again = convert.run(out, work, quick=True, data=data, progress=False)
    assert again == results
