"""A kept model that is gone is trained again from its result row, and stands in for the run
only where its loss is the row's (training repeats itself on one thread)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from experiments.round4 import measure
from experiments.round4 import plan as p
from mixture_of_depths.studies.runner import RunSpec, run_one

GRID = dataclasses.replace(p.QUICK.grid, tokenizer="byte", seq_len=32, eval_batches=1)
SPEC = RunSpec(
    name="r4-tiny-s0", group="round4", label="tiny", budget=2e8, seed=0,
    model=dict(d_model=32, n_layers=2, n_heads=2, max_seq_len=32, layer_pattern="DR",
               routing="mlp", predictor_hidden=8, vocab_size=257),
)  # fmt: skip


@pytest.fixture
def trained(tmp_path):  # noqa: ANN001, ANN201
    data = tmp_path / "data.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    torch.set_num_threads(1)
    row = run_one(SPEC, GRID, tmp_path / "first", str(data))
    (tmp_path / "results.jsonl").write_text(json.dumps(row) + "\n")
    return tmp_path, str(data), row


def test_a_lost_kept_model_is_trained_again_to_the_rows_loss_and_kept(trained):  # noqa: ANN001
    out, data, _ = trained
    kept = out / "kept"
    measure.retrain([SPEC.name], out, kept, out / "again", data, GRID)
    assert (kept / SPEC.name / "model.safetensors").exists()
    assert (kept / SPEC.name / "config.json").exists()


def test_a_retrained_run_whose_loss_is_not_the_rows_is_refused(trained):  # noqa: ANN001
    out, data, row = trained
    row = {**row, "val_loss_causal": row["val_loss_causal"] + 0.01}
    (out / "results.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(SystemExit, match="differs"):
        measure.retrain([SPEC.name], out, out / "kept", out / "again", data, GRID)
    assert not (out / "kept" / SPEC.name).exists()


def test_runs_trained_again_in_worker_processes_come_out_at_their_rows_losses(trained):  # noqa: ANN001
    """Two workers, each process on one thread as the study's were: each run's loss is its own
    row's (the seeds' losses differ, so a result handed to the other run fails)."""
    out, data, row = trained
    other = dataclasses.replace(SPEC, name="r4-tiny-s1", seed=1)
    torch.set_num_threads(1)
    second = run_one(other, GRID, out / "first", data)
    assert abs(row["val_loss_causal"] - second["val_loss_causal"]) > measure.SAME_LOSS
    (out / "results.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(second) + "\n")
    kept = out / "kept"
    measure.retrain([SPEC.name, other.name], out, kept, out / "again", data, GRID, workers=2)
    for name in (SPEC.name, other.name):
        assert (kept / name / "model.safetensors").exists()


def test_an_arms_lowest_kept_seed_stands_in_for_its_lost_seed_0(tmp_path):  # noqa: ANN001
    """Decode timings take each family's best run, or the lowest seed of its arm still kept;
    a family with none kept names its best run (to train again), never another arm's."""
    here = measure.HERE
    (tmp_path / "results.jsonl").write_bytes((here / "results.jsonl").read_bytes())
    best = {"dense": "r4-dense-XS-lr8e-3-s0", "mlp-kv": "r4-mlp-kv-S-lr3e-3-s0"}
    (tmp_path / "findings.json").write_text(json.dumps({"best_runs": best}))
    kept = tmp_path / "kept"
    for name in ("r4-mlp-kv-S-lr3e-3-s1", "r4-dense-XS-lr4e-3-s1", "r4-dense-XXS-lr8e-3-s1"):
        (kept / name).mkdir(parents=True)
        (kept / name / "model.safetensors").write_bytes(b"")
    assert measure.stand_ins(tmp_path, kept) == {
        "dense": "r4-dense-XS-lr8e-3-s0",
        "mlp-kv": "r4-mlp-kv-S-lr3e-3-s1",
    }
    (kept / "r4-dense-XS-lr8e-3-s2").mkdir()
    (kept / "r4-dense-XS-lr8e-3-s2" / "model.safetensors").write_bytes(b"")
    assert measure.stand_ins(tmp_path, kept)["dense"] == "r4-dense-XS-lr8e-3-s2"
