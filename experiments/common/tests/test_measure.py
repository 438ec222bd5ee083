"""Decode timings of trained models side by side flag the load other processes put on the CPUs."""

from __future__ import annotations

import pytest
import torch

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


def test_fed_prompts_are_the_text_and_the_tokens_that_follow_it():
    val = torch.arange(5000) % 977  # no window repeats within 977 tokens
    prompt, feed = measure.fed_prompts(val, 64)
    assert prompt.shape == (max(measure.DECODE_BATCHES), 32) and feed.shape[1] == 32
    for row in torch.cat([prompt, feed], 1):
        start = int((val == row[0]).nonzero()[0])
        assert torch.equal(row, val[start : start + 64])


def test_a_fed_decode_times_the_same_steps_and_records_each_routed_layers_take_rate(
    finished_run, monkeypatch: pytest.MonkeyPatch
):
    corpus, run = finished_run
    monkeypatch.setattr(measure, "DECODE_ROUNDS", 1)
    monkeypatch.setattr(measure, "DECODE_NEW", 4)
    for fed in (False, True):
        speeds = measure.decode_speeds({"a": run / "checkpoint"}, 16, str(corpus), fed=fed)["a"]
        assert all(len(speeds[f"take_b{b}"]) == 1 for b in measure.DECODE_BATCHES)  # 1 routed
        assert all(0.0 <= t <= 1.0 for b in measure.DECODE_BATCHES for t in speeds[f"take_b{b}"])
