"""`mod train` ends calibrated: against `mod calibrate` as the oracle (same windows, same fit),
for MoD, staged MoDE and MoR; a dense model skips with a note; a resumed run trains and
evaluates with the thresholds it had, as the uninterrupted run did, and calibrates again."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import TINY, tc

from mixture_of_depths import MoDConfig
from mixture_of_depths.cli import main
from mixture_of_depths.runtime.checkpoint import load_model, read_json_file
from mixture_of_depths.train import format_summary, resume_config, train

# `mod train --preset tiny` shortened: 6 steps of 4 x 32 tokens, one evaluation.
SHORT = ["--preset", "tiny", "--steps", "6", "--eval-every", "6", "--batch-size", "4",
         "--seq-len", "32", "--eval-batches", "2", "--no-progress", "--json"]  # fmt: skip
MODELS = {
    "mod": [],
    "mode-staged": ["--n-experts", "2"],
    "mor-expert": ["--layer-pattern", "D", "--recursions", "3"],  # its default capacities
}


def same(a: object, b: object) -> bool:
    """Equal, NaN equal to NaN (a router that takes nothing has no precision)."""
    return json.dumps(a) == json.dumps(b)


def _train(corpus: Path, out: Path, capsys: pytest.CaptureFixture, *flags: str) -> dict:
    assert main(["train", *SHORT, "--data", str(corpus), "--out", str(out), *flags]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("model", list(MODELS))
def test_mod_train_stores_the_thresholds_mod_calibrate_fits_on_the_same_windows(
    corpus, tmp_path, capsys, model
):
    """The oracle: the same run with --no-calibrate (the same weights), then `mod calibrate` on
    it with its defaults: the thresholds and the held-out figures before and after are the
    ones `mod train` stored and reported."""
    flags = MODELS[model]
    ended = _train(corpus, tmp_path / "run", capsys, *flags)
    plain = _train(corpus, tmp_path / "plain", capsys, *flags, "--no-calibrate")
    assert "calibration" not in plain
    trained, cfg = load_model(tmp_path / "run")
    untouched, plain_cfg = load_model(tmp_path / "plain")
    assert plain_cfg.causal_thresholds == ()
    for (name, a), (_, b) in zip(
        trained.state_dict().items(), untouched.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name  # calibration moves no weight
    cal = tmp_path / "cal"
    assert main(["calibrate", str(tmp_path / "plain"), "--out", str(cal), "--json"]) == 0
    oracle = json.loads(capsys.readouterr().out)
    _, cal_cfg = load_model(cal)
    assert cfg.causal_thresholds == cal_cfg.causal_thresholds != ()
    got = ended["calibration"]
    assert got["thresholds"] == oracle["thresholds"]
    assert same(got["before"], oracle["before"]) and same(got["after"], oracle["after"])
    names = trained.route_names()
    assert list(got["after"]["take_rate"]) == list(got["target_take_rate"]) == names
    assert got["batches"]["held_out"] >= 2 and got["batches"]["fit"] >= 2
    state = read_json_file(tmp_path / "run" / "checkpoint" / "trainer.json")
    assert state["calibration"] == {"thresholds": list(cfg.causal_thresholds), "uncalibrated": []}
    text = format_summary(ended)  # what `mod train` prints without --json
    for name in names:
        before, after = got["before"]["take_rate"][name], got["after"]["take_rate"][name]
        assert f"router {name}: target " in text
        assert f"causal take-rate {before:.1%} -> {after:.1%}" in text
    assert "held out from the fit" in text


def test_a_dense_model_ends_uncalibrated_with_a_note(corpus, tmp_path, capsys):
    assert main(["train", *SHORT, "--preset", "tiny-dense", "--data", str(corpus),
                 "--out", str(tmp_path / "run")]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    why = "the model is dense: no causal router, nothing to calibrate"
    assert f"note: {why}" in err
    summary = json.loads(out)
    assert summary["calibration"] == {"skipped": why}
    assert f"causal thresholds not calibrated: {why}" in format_summary(summary)
    assert load_model(tmp_path / "run")[1].causal_thresholds == ()


def test_a_resumed_run_evaluates_with_the_thresholds_it_trained_with(corpus, tmp_path):
    """A run calibrated at its end (step 6), resumed with nothing left to train, evaluates as
    it did before calibrating; resumed to step 9, it evaluates there exactly as the same run
    never calibrated and resumed alike (bit for bit on the CPU), then calibrates again. The
    library's `train` calibrates only when asked."""
    cfg = MoDConfig(**TINY, causal_router="predictor")
    keys = ("val_loss_causal", "causal_take_rate", "routing_recall", "routing_precision")
    runs = {}
    for name, calibrate in (("calibrated", True), ("plain", False)):
        out = tmp_path / name
        summary = train(cfg, tc(corpus, out, calibrate=calibrate), progress=False)
        assert ("calibration" in summary) == calibrate
        assert (load_model(out)[1].causal_thresholds != ()) == calibrate
        again = train(None, resume_config(out, {"calibrate": True}), resume=True, progress=False)
        assert same({k: again[k] for k in keys}, {k: summary[k] for k in keys})
        resumed = train(None, resume_config(out, {"steps": 9, "calibrate": True}), resume=True,
                        progress=False)  # fmt: skip
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[name] = ({k: v for k, v in rows[-1].items() if k != "routing_diag"}, resumed)
    (last, end), (plain_last, plain_end) = runs["calibrated"], runs["plain"]
    assert last["step"] == 9 and same(last, plain_last)
    assert same(end["calibration"], plain_end["calibration"])
    assert load_model(tmp_path / "calibrated")[1] == load_model(tmp_path / "plain")[1]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_mod_calibrate_shows_its_progress_on_a_terminal(corpus, tmp_path, monkeypatch, capsys):
    train(MoDConfig(**TINY), tc(corpus, tmp_path / "run", steps=2, eval_every=2), progress=False)
    assert main(["calibrate", str(tmp_path / "run"), "--out", str(tmp_path / "a")]) == 0
    assert "calibrating" not in capsys.readouterr().err  # stderr is no terminal here
    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    assert main(["calibrate", str(tmp_path / "run"), "--out", str(tmp_path / "b")]) == 0
    assert "calibrating" in err.getvalue() and "batch" in err.getvalue()
