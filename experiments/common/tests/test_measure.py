"""Decode timings of trained models side by side flag the load other processes put on the CPUs."""

from __future__ import annotations

import pytest

from experiments.common import measure
from mixture_of_depths import MoDConfig
from mixture_of_depths.train import TrainConfig, train


@pytest.fixture()
def finished_run(corpus, tmp_path):
    out = tmp_path / "run"
    cfg = MoDConfig(d_model=32, n_layers=2, n_heads=2, max_seq_len=32, predictor_hidden=8)
    tc = TrainConfig(out=str(out), data=str(corpus), batch_size=4, steps=3, eval_every=3,
                     eval_batches=1, log_every=1, warmup_steps=1)  # fmt: skip
    train(cfg, tc, progress=False)
    return corpus, out


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
