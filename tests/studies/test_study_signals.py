"""SIGTERM during `mod study`: the run in training stops with its checkpoint, the study exits 143
saying that a rerun resumes, and the rerun does; `--workers N` passes a SIGTERM on to its
workers at once and exits 143 too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from mixture_of_depths import cli
from mixture_of_depths.studies import loader, runner, workers
from mixture_of_depths.train import MetricsLog

# A user's study outside this repository: a folder whose __init__.py defines STUDY.
TINY_STUDY = """
from pathlib import Path

from mixture_of_depths.studies.runner import Folders, Plan, RunSpec, StudySettings

SHAPE = dict(d_model=32, n_layers=2, n_heads=2, max_seq_len=32)
SETTINGS = StudySettings(budgets=(1e9,), sizes=(("S", SHAPE),), seq_len=32, batch_size=4,
                         eval_every_runs=1, eval_batches=1, base={}, ablation_size="S")


def runs(s):
    return [RunSpec(name="tiny-s0", group="ablation", label="dense S", budget=1e9,
                    model={**SHAPE, "layer_pattern": "D"})]


STUDY = Plan(name="tiny", settings=lambda quick: SETTINGS, runs=runs,
             report=lambda results, out, s: None, folders=Folders(str(Path(__file__).parent)))
"""


def test_sigterm_stops_the_study_with_the_runs_checkpoint_and_a_rerun_resumes(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("MOD_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "data"
    data.mkdir()
    for i in range(6):
        (data / f"f{i}.py").write_text(f"def f(x):\n    return x * {i}\n" * 200)
    study_dir = tmp_path / "tiny_study"
    study_dir.mkdir()
    (study_dir / "__init__.py").write_text(TINY_STUDY)
    real_write = MetricsLog.write

    def write(self, record):  # noqa: ANN001, ANN202
        real_write(self, record)
        if "lm_loss" in record:  # the first run's first log step
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # or the test dies
            monkeypatch.setattr(MetricsLog, "write", real_write)
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(MetricsLog, "write", write)
    out, work = tmp_path / "study", tmp_path / "work"
    args = ["study", str(study_dir), "--quick", "--out", str(out), "--work", str(work), "--data",
            str(data), "--no-progress"]  # fmt: skip
    assert cli.main(args) == 143
    err = capsys.readouterr().err
    assert err.startswith("tiny: 1 runs to train, 0 done")  # said before any work
    assert "mod study: stopped by SIGTERM after step" in err
    assert "the study stopped: rerun the same command to resume it" in err
    assert runner.load_results(out / "results.jsonl") == []
    (folder,) = [p for p in work.iterdir() if (p / "checkpoint").exists()]
    stopped_at = json.loads((folder / "checkpoint" / "trainer.json").read_text())["step"]
    assert f"after step {stopped_at}: checkpoint in {folder / 'checkpoint'}" in err
    # The rerun resumes that run from its checkpoint (stopped again once it is done).
    real_train, resumed = runner.train, []

    def train(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        resumed.append(kw["resume"])
        real_train(*a, **kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "train", train)
    with pytest.raises(KeyboardInterrupt):
        study = loader.load_study(study_dir)
        runner.study(study, out, work, quick=True, data=str(data), progress=False)
    assert resumed == [True]
    rows = [json.loads(s) for s in (folder / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "lm_loss" in r]
    assert steps == sorted(set(steps)) and steps[0] <= stopped_at < steps[-1]


CHILD = """
import pathlib, signal, sys, time
def stop(signum, frame):
    pathlib.Path(sys.argv[1]).write_text(signal.Signals(signum).name)
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
pathlib.Path(sys.argv[1]).write_text("ready")
time.sleep(60)
sys.exit(1)
"""


def test_workers_pass_a_sigterm_on_at_once_and_exit_143(tmp_path, monkeypatch, capsys):
    files = [tmp_path / f"worker{i}" for i in range(2)]
    real_popen = subprocess.Popen

    def popen(cmd, env):  # noqa: ANN001, ANN202
        index = int(cmd[cmd.index("--worker-index") + 1])
        return real_popen([sys.executable, "-c", CHILD, str(files[index])])

    def kill_when_ready() -> None:
        deadline = time.monotonic() + 60
        while not all(f.exists() and f.read_text() == "ready" for f in files):
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    before = signal.getsignal(signal.SIGTERM)
    killer = threading.Thread(target=kill_when_ready)
    killer.start()
    try:
        t0 = time.monotonic()
        assert workers.launch(2, None, None, None, None, True, str(tmp_path), ["x"]) == 143
    except KeyboardInterrupt:  # what a SIGTERM became before: the workers got SIGINT, late
        pytest.fail("the SIGTERM was not passed on to the workers")
    finally:
        killer.join()
    assert time.monotonic() - t0 < 30  # the workers got it at once, not after a wait
    assert [f.read_text() for f in files] == ["SIGTERM", "SIGTERM"]
    assert "rerun the same command to resume the study" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before
