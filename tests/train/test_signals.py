"""SIGTERM and SIGINT during training (train/signals.py): the run stops after a step with a
checkpoint, releases its lock, says where it stopped and how to resume, exits 128 + the signal's
number, and the resumed run is the uninterrupted one, bit for bit (CPU).

The subprocess runs go through tests/crash.py's ``slow`` point (a sleep after each log line) so
that a real signal, sent from here once the log shows a few steps, lands mid-run; the oracle is
an uninterrupted run with the same arguments.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import CRASH, TINY, tc, write_corpus
from safetensors.torch import load_file

import mixture_of_depths.train.loop as loop
from mixture_of_depths import MoDConfig
from mixture_of_depths.cli import main
from mixture_of_depths.runtime.runlock import LOCK_NAME
from mixture_of_depths.train import MetricsLog, TrainingStopped, train

# 12 steps, checkpoints at 4, 8 and 12, a log line every step (tests/train/test_faults.py's).
RUN_ARGS = [
    "--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--max-seq-len", "32",
    "--predictor-hidden", "8", "--batch-size", "4", "--steps", "12", "--eval-every", "4",
    "--eval-batches", "2", "--log-every", "1", "--warmup-steps", "2", "--no-progress",
]  # fmt: skip
VOLATILE = {"tokens_per_s"}  # wall-clock figures: everything else in the log must match
SLOW_MS = "200"  # per log line: 12 steps take seconds, so a signal lands mid-run


def _env(cache: Path) -> dict[str, str]:
    # Same threads in every run (conftest sets 1 here), so float sums add up in the same order.
    src = str(Path(__file__).resolve().parents[2] / "src")
    return {**os.environ, "MOD_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1", "PYTHONPATH": src}


def records(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in rows]


def logged_steps(out: Path) -> list[int]:
    return [r["step"] for r in records(out) if "lm_loss" in r]


def trainer_step(out: Path) -> int:
    return json.loads((out / "checkpoint" / "trainer.json").read_text())["step"]


def assert_same_run(got: Path, want: Path) -> None:
    assert records(got) == records(want)
    for name in ("model", "optimizer"):
        a = load_file(got / "checkpoint" / f"{name}.safetensors")
        b = load_file(want / "checkpoint" / f"{name}.safetensors")
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in b), name


def signal_mid_run(
    cmd: list[str], env: dict[str, str], out: Path, sig: int, after: int
) -> subprocess.CompletedProcess:
    """Start `cmd`, send it `sig` once `out`'s log shows `after` training steps, and wait for it
    (every wait bounded)."""
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # a shell's background job inherits SIGINT ignored, and `mod train` leaves an ignored
        # signal alone on purpose: give the child the default a terminal would
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        log = out / "metrics.jsonl"
        while not (log.exists() and log.read_text().count('"lm_loss"') >= after):
            if proc.poll() is not None or time.monotonic() > deadline:
                stdout, stderr = proc.communicate(timeout=60)
                pytest.fail(f"the run ended (rc {proc.returncode}) or stalled: {stderr[-3000:]}")
            time.sleep(0.02)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """A corpus and the uninterrupted run, in this process (one thread, as the subprocesses)."""
    root = tmp_path_factory.mktemp("signals")
    corpus = write_corpus(root / "corpus")
    ref = root / "reference"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOD_CACHE_DIR", str(root / "cache"))
        assert torch.get_num_threads() == 1  # conftest
        assert main(["train", *RUN_ARGS, "--data", str(corpus), "--out", str(ref)]) == 0
        yield {"corpus": corpus, "reference": ref, "root": root}


@pytest.mark.parametrize(
    "sig,code",
    [
        pytest.param(signal.SIGTERM, 143, id="SIGTERM"),
        pytest.param(signal.SIGINT, 130, id="SIGINT"),
    ],
)
def test_a_signal_stops_mod_train_with_a_checkpoint_and_the_resume_is_exact(
    shared, monkeypatch, sig: int, code: int
):
    corpus, out = shared["corpus"], shared["root"] / f"stopped-{sig}"
    cmd = [sys.executable, str(CRASH), "slow", SLOW_MS, "train", *RUN_ARGS, "--data", str(corpus)]
    proc = signal_mid_run([*cmd, "--out", str(out)], _env(corpus.parent / "cache"), out, sig, 3)
    assert proc.returncode == code, proc.stderr[-3000:]
    step = max(r["step"] for r in records(out))
    assert 3 <= step < 12 and trainer_step(out) == step == logged_steps(out)[-1]
    name = signal.Signals(sig).name
    assert (
        f"mod train: stopped by {name} after step {step}: checkpoint in {out / 'checkpoint'}; "
        f"resume with: mod train --out {out} --resume"
    ) in proc.stderr
    assert not (out / LOCK_NAME).exists() and not list(out.glob(".*.tmp"))
    # The lock is gone, so the resume is not refused; it ends as the uninterrupted run.
    monkeypatch.setenv("MOD_CACHE_DIR", str(corpus.parent / "cache"))
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert_same_run(out, shared["reference"])


def _signal_at_log_step(monkeypatch: pytest.MonkeyPatch, step: int, sig: int) -> dict:
    """This process sends itself `sig` right after the log line of `step`, once our handler
    is in place (the default one would end the test session); returns what the hook saw."""
    real_write = MetricsLog.write
    seen = {}

    def write(self, record):  # noqa: ANN001, ANN202
        real_write(self, record)
        if "lm_loss" in record and record["step"] == step:
            seen["handler"] = signal.getsignal(sig)
            assert seen["handler"] not in (signal.SIG_DFL, signal.default_int_handler)
            os.kill(os.getpid(), sig)

    monkeypatch.setattr(MetricsLog, "write", write)
    return seen


def _signal_in_set_up(monkeypatch: pytest.MonkeyPatch) -> None:
    real_start = loop.start

    def start(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # ours, or the test dies
        os.kill(os.getpid(), signal.SIGTERM)
        return real_start(*a, **kw)

    monkeypatch.setattr(loop, "start", start)


def test_train_raises_training_stopped_restores_the_handlers_and_resumes_exactly(
    corpus, tmp_path, monkeypatch
):
    """In the library: a SIGTERM after step 2 raises `TrainingStopped` after the step-2
    checkpoint; one during a resume's set-up stops before any step and changes nothing; the
    resume to the end is the uninterrupted run; every `train` leaves the handlers it found."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    ref, out = tmp_path / "reference", tmp_path / "run"
    train(MoDConfig(**TINY), tc(corpus, ref), progress=False)
    assert {s: signal.getsignal(s) for s in before} == before
    with monkeypatch.context() as mp:
        seen = _signal_at_log_step(mp, 2, signal.SIGTERM)
        with pytest.raises(TrainingStopped) as stop:
            train(MoDConfig(**TINY), tc(corpus, out), progress=False)
    assert seen["handler"] is not before[signal.SIGTERM]
    assert (stop.value.signum, stop.value.step, stop.value.exit_code) == (signal.SIGTERM, 2, 143)
    assert stop.value.checkpoint == out / "checkpoint" and trainer_step(out) == 2
    assert str(stop.value).endswith(f"resume with: mod train --out {out} --resume")
    assert {s: signal.getsignal(s) for s in before} == before and not (out / LOCK_NAME).exists()
    with monkeypatch.context() as mp:
        _signal_in_set_up(mp)
        with pytest.raises(TrainingStopped, match="before step 3: nothing new was trained"):
            train(None, tc(corpus, out), resume=True, progress=False)
    assert trainer_step(out) == 2 and {s: signal.getsignal(s) for s in before} == before
    train(None, tc(corpus, out), resume=True, progress=False)  # returns: handlers restored
    assert {s: signal.getsignal(s) for s in before} == before
    assert_same_run(out, ref)


def test_a_signal_in_set_up_of_a_new_run_trains_nothing(corpus, tmp_path, monkeypatch, capsys):
    out, before = tmp_path / "run", signal.getsignal(signal.SIGTERM)
    _signal_in_set_up(monkeypatch)
    args = ["train", *RUN_ARGS, "--data", str(corpus), "--out", str(out)]
    assert main(args) == 143
    err = capsys.readouterr().err
    assert f"stopped by SIGTERM before the first step of {out}: nothing was trained" in err
    assert "nothing needs resuming" in err and "resume with" not in err
    assert not (out / "checkpoint").exists() and not (out / LOCK_NAME).exists()
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_signal_in_the_last_step_lets_the_run_finish_then_stops(corpus, tmp_path, monkeypatch):
    """The run ends as an uninterrupted one (summary and all), and the caller still hears of the
    signal: a study running several runs stops after this one."""
    out = tmp_path / "run"
    _signal_at_log_step(monkeypatch, 6, signal.SIGTERM)
    with pytest.raises(TrainingStopped, match="after step 6, the last: the run is complete"):
        train(MoDConfig(**TINY), tc(corpus, out), progress=False)
    assert trainer_step(out) == 6 and (out / "summary.json").exists()


def shard_files(ckpt: Path) -> list[str]:
    return sorted(f.name for f in (ckpt / "shards").iterdir())


def test_sigterm_to_torchrun_stops_every_fsdp_rank_at_a_log_step_with_its_shard(
    shared, monkeypatch
):
    """torchrun forwards the SIGTERM to both ranks; they agree (at a log step: every 2nd here)
    on the step to stop at, each writes its shard of that step's checkpoint, rank 0 alone says
    so, and one process resumes the sharded checkpoint to the end."""
    corpus, out = shared["corpus"], shared["root"] / "torchrun"
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    args = [*RUN_ARGS, "--log-every", "2", "--parallel", "fsdp", "--data", str(corpus)]
    cmd = [*run, str(CRASH), "slow", SLOW_MS, "train", *args, "--out", str(out)]
    proc = signal_mid_run(cmd, _env(corpus.parent / "cache"), out, signal.SIGTERM, 1)
    assert proc.returncode != 0
    step = trainer_step(out)
    assert step % 2 == 0 and step == logged_steps(out)[-1] < 12, proc.stderr[-3000:]
    assert proc.stderr.count("stopped by SIGTERM") == 1, proc.stderr[-3000:]
    assert f"mod train: stopped by SIGTERM after step {step}: checkpoint in " in proc.stderr
    assert "resume with: torchrun ... -m mixture_of_depths train --out" in proc.stderr
    assert len(shard_files(out / "checkpoint")) == 2  # every rank wrote its shard
    assert not (out / LOCK_NAME).exists() and not list(out.glob(".*.tmp"))
    monkeypatch.setenv("MOD_CACHE_DIR", str(corpus.parent / "cache"))
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert logged_steps(out) == list(range(2, 13, 2))
