"""Round 2's study run by several processes at once: twins, claims, and `mod study --workers`."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import zlib
from pathlib import Path

import pytest

from experiments.round2 import planning, running
from mixture_of_depths import MoDConfig
from mixture_of_depths.studies import rounds
from mixture_of_depths.studies.runner import RunSpec, load_results

HERE = Path(__file__).resolve().parent


def test_twin_is_the_same_training_run_only():
    shape = dict(planning.FULL.grid.sizes)[planning.FULL.grid.ablation_size]
    model = {"max_seq_len": 256, **shape, **planning.MOD, "causal_router": "predictor"}
    spec = RunSpec(name="ctx256-5e13-MoD-S-s0", group="isoflop", label="MoD S", budget=5e13,
                   model=model, seq_len=256, batch_size=16, capacity_warmup=0.1)  # fmt: skip
    # the finished run records its model as built: the vocabulary and the resolved routing
    built = dataclasses.asdict(MoDConfig(**{**model, "vocab_size": 4096}))
    done = {**dataclasses.asdict(spec), "name": "long-pred-warm-s0", "group": "longer",
            "evaluations": 10, "model": built}  # fmt: skip
    assert rounds.twin(spec, [done]) is done
    for change in (dict(seed=1), dict(capacity_warmup=0.0), dict(batch_size=8), dict(seq_len=128),
                   dict(budget=1.5e13), dict(model={**model, "d_model": 64}),
                   dict(model={**model, "router_scores": "random"})):  # fmt: skip
        assert rounds.twin(dataclasses.replace(spec, **change), [done]) is None, change
    rand = dataclasses.replace(spec, model={**model, "router_scores": "random"})
    assert rounds.twin(rand, [{**done, "model": {**built, "router_scores": "random"}}]) is None


def _fake_run_one(calls: list[tuple[str, str]], pause: float):
    """A stand-in for `run_one`: a row with every field the plan reads, its loss a fixed
    function of the run's name, so that any order of running gives the same plan."""
    lock = threading.Lock()

    def run_one(spec, settings, work, data, progress=False):
        with lock:
            calls.append((threading.current_thread().name, spec.name))
        time.sleep(pause)  # long enough for another worker to claim the next run meanwhile
        folder = work / spec.name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "metrics.jsonl").write_text("{}\n")
        loss = 3.0 + zlib.crc32(spec.name.removesuffix("-s0").removesuffix("-s1").encode()) / 2**32
        row = dataclasses.asdict(spec)
        row["model"] = dataclasses.asdict(MoDConfig(**{**spec.model, "vocab_size": 300}))
        layers = row["model"].get("n_layers", 2) // 2
        return {**row, "val_loss_causal": loss, "val_loss": loss,
                "causal_take_rate": {str(i): 0.125 for i in range(layers)}}  # fmt: skip

    return run_one


def test_workers_share_the_study_and_run_each_run_once(tmp_path, monkeypatch):
    """Two workers on one study (threads here; `mod study --workers` uses processes, the same
    locks) end with exactly the runs one worker would have run, each run once, both busy."""
    monkeypatch.setattr(running, "routing_profile", lambda *a, **k: {})
    monkeypatch.setattr(running, "position_profile", lambda *a, **k: {})
    monkeypatch.setattr(running, "write_report", lambda *a, **k: None)
    solo: list[tuple[str, str]] = []
    monkeypatch.setattr(rounds, "run_one", _fake_run_one(solo, 0.0))
    one = running.run(tmp_path / "solo", tmp_path / "w1", quick=True, progress=False)
    assert len(one) > 20 and len(solo) == len({r["name"] for r in one if "same_run_as" not in r})
    solo_names = sorted(name for _, name in solo)

    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(rounds, "run_one", _fake_run_one(calls, 0.02))
    out, work = tmp_path / "out", tmp_path / "work"
    mine: dict[int, list[str]] = {}

    def worker(i: int) -> None:
        rows = running.run(out, work, quick=True, progress=False, poll_s=0.01)
        mine[i] = [r["name"] for r in rows]

    threads = [
        threading.Thread(target=worker, args=(i,), name=f"w{i}", daemon=True) for i in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert sorted(name for _, name in calls) == solo_names  # the same runs, none twice
    assert {who for who, _ in calls} == {"w0", "w1"}  # both trained
    rows = load_results(out / "results.jsonl")
    names = [r["name"] for r in rows]
    assert len(names) == len(set(names)) and set(names) == {r["name"] for r in one}
    assert set(mine[0]) == set(mine[1]) == set(names)  # each returns the whole study
    assert not any(work.iterdir())  # claims released, run folders deleted
    # a claim is on what a run trains: twins share it (and are never trained twice), other
    # runs do not
    key = {r["name"]: rounds.training_key(RunSpec.from_row(r)) for r in rows}
    for r in rows:
        if "same_run_as" in r:
            assert key[r["name"]] == key[r["same_run_as"]]
    trained = [key[r["name"]] for r in rows if "same_run_as" not in r]
    assert len(set(trained)) == len(trained)


def test_a_run_finished_while_we_claimed_it_is_not_trained_again(tmp_path, monkeypatch):
    monkeypatch.setattr(running, "routing_profile", lambda *a, **k: {})
    monkeypatch.setattr(running, "position_profile", lambda *a, **k: {})
    monkeypatch.setattr(running, "write_report", lambda *a, **k: None)
    calls: list[tuple[str, str]] = []
    fake = _fake_run_one(calls, 0.0)
    monkeypatch.setattr(rounds, "run_one", fake)
    out, work = tmp_path / "out", tmp_path / "work"
    seen, real_key, real_claim = [], rounds.training_key, rounds.claim

    def key(spec):
        seen.append(spec)
        return real_key(spec)

    def claim(folder, name):
        if len(seen) == 1:  # another worker records the first run just before our claim lands
            row = {**fake(seen[0], None, work, None), "group": seen[0].group}
            # ...as a killed process would leave it, its line not ended
            (out / "results.jsonl").write_text(json.dumps(row))
            calls.clear()
        return real_claim(folder, name)

    monkeypatch.setattr(rounds, "training_key", key)
    monkeypatch.setattr(rounds, "claim", claim)
    rows = running.run(out, work, quick=True, progress=False, max_runs=2)
    first = seen[0].name
    assert first not in [name for _, name in calls]  # not trained again...
    assert [r["name"] for r in rows].count(first) == 1  # ...nor recorded twice
    assert len(calls) == 2 and len(rows) == 3  # our rows began on lines of their own


def test_a_claim_that_cannot_be_checked_is_an_error_not_a_wait(tmp_path):
    from mixture_of_depths.runtime.runlock import RunLockedError

    (tmp_path / "x.lock").write_text(
        json.dumps({"host": "elsewhere", "pid": 1, "boot": "another-boot", "since": "then"})
    )
    with pytest.raises(RunLockedError, match="delete the lock file"):
        rounds.claim(tmp_path, "x")


def test_mod_study_workers_launches_one_process_per_worker(tmp_path, monkeypatch, capsys):
    import os
    import subprocess

    from mixture_of_depths import cli

    launched = []

    class Popen:
        def __init__(self, cmd, env):
            launched.append((cmd, env))

        def wait(self):
            return 0

    monkeypatch.setenv("MOD_KEEP_FREED_MEMORY", "0")  # its library lookup runs a Popen too
    monkeypatch.setattr(subprocess, "Popen", Popen)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    out = str(tmp_path / "out")
    folder = str(HERE.parent)  # this study's folder, experiments/round2
    args = ["study", folder, "--out", out, "--max-runs", "3", "--quick"]
    assert cli.main([*args, "--workers", "2"]) == 0
    assert len(launched) == 2
    for i, (cmd, env) in enumerate(launched):  # the same study, each its share of the cores
        assert cmd[3:] == ["study", folder, "--no-progress", "--out", out, "--work",
                           f"{out}/runs", "--max-runs", "3", "--quick", "--worker-index",
                           str(i)]  # fmt: skip
        assert env["OMP_NUM_THREADS"] == "2"
    Popen.wait = lambda self: 3  # a worker that fails fails the command
    assert cli.main([*args, "--workers", "2"]) == 3
    assert "2 of 2 workers failed (exit 3)" in capsys.readouterr().err
    for bad, why in (("0", "--workers must be >= 1, got 0"), ("5", "at most the 4 cores")):
        assert cli.main([*args, "--workers", bad]) == 2
        assert why in capsys.readouterr().err
    isoflop = str(HERE.parents[1] / "isoflop")  # a fixed plan: no workers
    assert cli.main(["study", isoflop, "--workers", "2"]) == 2
    assert "--workers and --max-runs apply to a study that plans from its results" in (
        capsys.readouterr().err
    )
    launched.clear()
    Popen.wait = lambda self: 0
    round3 = str(HERE.parents[1] / "round3")
    assert cli.main(["study", round3, "--quick", "--workers", "2"]) == 0
    assert [cmd[3:5] for cmd, _ in launched] == [["study", round3]] * 2


def test_a_claim_survives_the_claims_folder_vanishing_under_it(tmp_path, monkeypatch):
    """A worker that finishes removes the empty claims folder; another taking a lock at that
    moment sees mkdir fail with "exists" then find nothing, or the folder gone before its open:
    both are retried, not a crash (a worker of `mod study --workers` died of the first)."""
    from mixture_of_depths.runtime.runlock import RunLock

    real, fails = RunLock.acquire, [FileExistsError(17, "exists"), FileNotFoundError(2, "gone")]

    def flaky(self):
        if fails:
            raise fails.pop(0)
        return real(self)

    monkeypatch.setattr(RunLock, "acquire", flaky)
    lock = rounds.claim(tmp_path / ".claims", "results")
    assert lock is not None and not fails and (tmp_path / ".claims" / "results.lock").exists()
    lock.release()
