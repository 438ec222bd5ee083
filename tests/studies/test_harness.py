"""The study harness's shared parts: results read back as they trained, and decode timings that
flag the load other processes put on the CPUs."""

from __future__ import annotations

import json

import pytest

from mixture_of_depths import MoDConfig
from mixture_of_depths.studies import profiles, runner


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


@pytest.mark.parametrize("layer_pattern", ["DR", "D"])
def test_loss_by_place_averages_to_the_causal_validation_loss(corpus, tmp_path, layer_pattern):
    """The place-weighted mean of `position_profile`'s buckets is the causal validation loss the
    trainer measured on the same batches (a different reduction of the same numbers); a grid row
    carries it, and the report's table shows the best dense against the best MoD."""
    from helpers import TINY, tc

    from mixture_of_depths.train import train

    cfg = MoDConfig(**TINY, layer_pattern=layer_pattern, causal_router="predictor")
    out = tmp_path / "run"
    summary = train(cfg, tc(corpus, out, steps=4, eval_every=4, eval_batches=3), progress=False)
    prof = profiles.position_profile(out / "checkpoint", str(corpus), 4, 32, 3)
    edges = prof["edges"]
    assert edges == profiles.position_buckets(32) == [0, 2, 8, 32]
    widths = [b - a for a, b in zip(edges[:-1], edges[1:], strict=True)]
    mean = sum(w * v for w, v in zip(widths, prof["loss"], strict=True)) / 32
    assert mean == pytest.approx(summary["val_loss_causal"], rel=1e-5)
    assert profiles.position_buckets(1024) == [0, 16, 64, 256, 1024]
    assert profiles.position_buckets(8) == [0, 2, 8] and profiles.position_buckets(1) == [0, 1]
