"""Fault injection: kills at every kind of moment, concurrent runs, divergence, damaged files, and
bad input. Each failure here was reproduced before its fix (docs/reliability.md lists them).

The kill -9 runs are subprocesses started through tests/crash.py, which SIGKILLs itself at a
chosen point; their oracle is an uninterrupted run started the same way: metrics and weights must
be bit-identical. The slowest variants are marked ``slow`` (``pytest -m slow`` runs them).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import CRASH, TINY, losses, tc, write_corpus
from safetensors.torch import load_file, save_file

from mixture_of_depths import MoDConfig, MoDTransformer
from mixture_of_depths.cli import main
from mixture_of_depths.runtime.checkpoint import CheckpointError, save_checkpoint
from mixture_of_depths.runtime.runlock import (
    LOCK_NAME,
    RunLock,
    RunLockedError,
    boot_id,
    start_time,
)
from mixture_of_depths.train import TrainingDiverged, train

# The subprocess runs: 12 steps, checkpoints at 4, 8 and 12, a log line every step.
RUN_ARGS = [
    "--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--max-seq-len", "32",
    "--predictor-hidden", "8", "--batch-size", "4", "--steps", "12", "--eval-every", "4",
    "--eval-batches", "2", "--log-every", "1", "--warmup-steps", "2", "--no-progress",
]  # fmt: skip
VOLATILE = {"tokens_per_s"}  # wall-clock figures: everything else in the log must match


def _env(cache: Path) -> dict[str, str]:
    # Same threads in every run, so that float reductions add up in the same order.
    return {**os.environ, "MOD_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}


def mod_run(
    corpus: Path, out: Path, point: str = "none", n: int = 1, extra: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """`mod train` on `corpus` into `out`, killed at the n-th `point` (see crash.py)."""
    cmd = [sys.executable, str(CRASH), point, str(n), "train", *RUN_ARGS, "--data", str(corpus)]
    cmd += ["--out", str(out), *extra]
    return subprocess.run(
        cmd, env=_env(corpus.parent / "cache"), capture_output=True, text=True, timeout=300
    )


def killed(proc: subprocess.CompletedProcess) -> bool:
    return proc.returncode == -9


def records(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in rows]


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "checkpoint" / "model.safetensors")


def assert_same_run(got: Path, want: Path) -> None:
    assert records(got) == records(want)
    a, b = weights(got), weights(want)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    opt_a = load_file(got / "checkpoint" / "optimizer.safetensors")
    opt_b = load_file(want / "checkpoint" / "optimizer.safetensors")
    assert all(torch.equal(opt_a[k], opt_b[k]) for k in opt_b)


def trainer_step(out: Path, name: str = "checkpoint") -> int:
    return json.loads((out / name / "trainer.json").read_text())["step"]


def stale_temps(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob(".*.tmp"))


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """A corpus and the uninterrupted reference run, shared by the kill tests. The reference
    runs in this process (one thread, as the subprocesses: see `_env`), to save a start-up."""
    root = tmp_path_factory.mktemp("faults")
    corpus = write_corpus(root / "corpus")
    ref = root / "reference"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOD_CACHE_DIR", str(root / "cache"))
        assert torch.get_num_threads() == 1  # conftest
        assert main(["train", *RUN_ARGS, "--data", str(corpus), "--out", str(ref)]) == 0
        yield {"corpus": corpus, "reference": ref, "root": root}


# -- kill -9, then resume: bit-identical to the uninterrupted run ---------------------------------
def test_kill_inside_checkpoint_writes_then_resume(shared):
    corpus, out = shared["corpus"], shared["root"] / "chain"
    # 1. Killed inside the step-8 checkpoint write (its model file written, the optimizer's not):
    #    the step-4 checkpoint is untouched, the log runs ahead of it (steps 5-8), and a
    #    temporary folder is left behind.
    assert killed(mod_run(corpus, out, "tensors", 3))
    assert trainer_step(out) == 4 and max(losses(out)) == 8
    assert [n for n in stale_temps(out) if n.startswith(".checkpoint.")]
    # 2. Resumed (the leftover is removed at start, the log cut back to step 4), killed between
    #    the step-8 write's two renames: only the previous checkpoint, moved aside as
    #    .checkpoint.old, is on disk, beside this run's complete temporary folder.
    assert killed(mod_run(corpus, out, "swap", 1, ("--resume",)))
    assert not (out / "checkpoint").exists() and trainer_step(out, ".checkpoint.old") == 4
    assert len([n for n in stale_temps(out) if n.startswith(".checkpoint.")]) == 1
    # 3. Resumed from .checkpoint.old, to the end: the same run as one never interrupted.
    proc = mod_run(corpus, out, extra=("--resume",))
    assert proc.returncode == 0, proc.stderr
    assert_same_run(out, shared["reference"])
    assert stale_temps(out) == [] and not (out / ".checkpoint.old").exists()
    assert not (out / LOCK_NAME).exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "point,n", [("log", 6), ("log", 1), ("log", 11), ("tensors", 1), ("tensors", 2), ("swap", 2)]
)
def test_kill_at_other_points_then_resume(shared, point: str, n: int):
    """Between checkpoints (before the first, mid-run, just before the last), inside the first
    write (model file or optimizer file done), between the last write's renames."""
    corpus, out = shared["corpus"], shared["root"] / f"kill-{point}-{n}"
    assert killed(mod_run(corpus, out, point, n))
    resumable = (out / "checkpoint").exists() or (out / ".checkpoint.old").exists()
    proc = mod_run(corpus, out, extra=("--resume",) if resumable else ("--overwrite",))
    assert proc.returncode == 0, proc.stderr
    assert_same_run(out, shared["reference"])


# -- --overwrite ----------------------------------------------------------------------------------
class Crash(BaseException):
    """A crash at a chosen point, in-process (no handler of ours catches a BaseException)."""


def test_overwrite_removes_the_old_run_before_anything_else(shared, capsys, monkeypatch):
    corpus, out = shared["corpus"], shared["root"] / "overwrite"
    monkeypatch.setenv("MOD_CACHE_DIR", str(corpus.parent / "cache"))
    shutil.copytree(shared["reference"], out)
    args = ["train", *RUN_ARGS, "--data", str(corpus), "--out", str(out), "--overwrite"]
    real_replace = os.replace

    def replace(src, dst):  # noqa: ANN001, ANN202
        real_replace(src, dst)
        if ".overwritten." in str(dst):
            raise Crash  # right after the old checkpoint went into the trash

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Crash):
        main(args)
    monkeypatch.setattr(os, "replace", real_replace)
    assert not (out / "checkpoint").exists() and (out / "metrics.jsonl").exists()
    advice = "stopped before its first checkpoint, so there is nothing to resume"
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 2
    assert advice in capsys.readouterr().err
    # Crashed after the new run's first step (before its first checkpoint): nothing of the old
    # run remains for --resume to continue, and the trash of the first attempt is gone.
    monkeypatch.setattr(
        "mixture_of_depths.train.loop._log_step", lambda *a: (_ for _ in ()).throw(Crash)
    )
    with pytest.raises(Crash):
        main(args)
    monkeypatch.undo()
    assert not (out / "checkpoint").exists() and stale_temps(out) == []
    assert not (out / "summary.json").exists()  # the old run's files went with it
    monkeypatch.setenv("MOD_CACHE_DIR", str(corpus.parent / "cache"))
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 2
    assert advice in capsys.readouterr().err
    # Rerunning without a flag gives the same advice, not "resume it".
    assert main(["train", "--out", str(out), "--data", str(corpus), "--no-progress"]) == 2
    assert advice in capsys.readouterr().err


def test_overwrite_deletes_nothing_when_the_new_run_is_refused(corpus, tmp_path, monkeypatch):
    out = tmp_path / "run"
    train(MoDConfig(**TINY), tc(corpus, out, steps=3), progress=False)
    before = _digest(out / "checkpoint")
    with pytest.raises(ValueError, match="seq_len 64 exceeds"):
        train(MoDConfig(**TINY), tc(corpus, out, seq_len=64), overwrite=True, progress=False)
    with pytest.raises(FileNotFoundError):
        train(MoDConfig(**TINY), tc(tmp_path / "no-data", out), overwrite=True, progress=False)
    assert _digest(out / "checkpoint") == before and (out / "summary.json").exists()
    # Both checkpoint and .checkpoint.old (a crash after a write's second rename): a crash
    # inside --overwrite must not leave the older one alone for --resume to find.
    shutil.copytree(out / "checkpoint", out / ".checkpoint.old")
    real_replace = os.replace

    def replace(src, dst):  # noqa: ANN001, ANN202
        real_replace(src, dst)
        raise Crash

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Crash):
        train(MoDConfig(**TINY), tc(corpus, out), overwrite=True, progress=False)
    monkeypatch.setattr(os, "replace", real_replace)
    assert not (out / ".checkpoint.old").exists() and _digest(out / "checkpoint") == before


# -- one run per folder ---------------------------------------------------------------------------
def test_a_second_run_on_a_folder_is_refused_and_a_killed_owner_does_not_block(shared, capsys):
    corpus, out = shared["corpus"], shared["root"] / "concurrent"
    cmd = [sys.executable, str(CRASH), "none", "1", "train", *RUN_ARGS, "--data", str(corpus)]
    cmd += ["--out", str(out), "--steps", "1000000", "--eval-every", "1000000"]
    owner = subprocess.Popen(cmd, env=_env(corpus.parent / "cache"), stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (out / "run.json").exists():  # written under the lock, after set-up
            assert owner.poll() is None, owner.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for extra in ([], ["--resume"], ["--overwrite"]):
            assert main(["train", "--out", str(out), "--no-progress", *extra]) == 2
            err = capsys.readouterr().err
            assert f"is in use: process {owner.pid} on host" in err, (extra, err)
    finally:
        owner.kill()  # SIGKILL: the lock file stays behind, naming a dead process
        owner.wait()
        owner.stderr.close()
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == owner.pid
    args = ["train", *RUN_ARGS, "--data", str(corpus), "--out", str(out), "--overwrite"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOD_CACHE_DIR", str(corpus.parent / "cache"))
        assert main([*args, "--steps", "2"]) == 0  # the stale lock is taken over
    assert not (out / LOCK_NAME).exists()


def test_lock_refuses_a_live_owner_and_takes_over_a_dead_one(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = {"host": socket.gethostname(), "pid": sleeper.pid, "start": start_time(sleeper.pid)}
        (tmp_path / LOCK_NAME).write_text(json.dumps(live))
        with pytest.raises(RunLockedError, match=f"process {sleeper.pid} on host"):
            RunLock(tmp_path).acquire()
    finally:
        sleeper.kill()
        sleeper.wait()
    with RunLock(tmp_path):  # now dead: stale, taken over
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
        with pytest.raises(RunLockedError):  # held (flock) by this process: a second is refused
            RunLock(tmp_path).acquire()
    assert not (tmp_path / LOCK_NAME).exists()
    other = {"host": "elsewhere.example", "pid": 1, "start": None}
    (tmp_path / LOCK_NAME).write_text(json.dumps(other))
    with pytest.raises(RunLockedError, match="delete the lock file"):
        RunLock(tmp_path).acquire()
    (tmp_path / LOCK_NAME).write_text('{"host": ')  # cut short by a kill while written: stale
    RunLock(tmp_path).acquire().release()
    boot = boot_id()
    if boot is not None:  # Linux: a container restarted under a new hostname, same machine
        dead = {"host": "old-container", "boot": boot, "pid": sleeper.pid, "start": live["start"]}
        (tmp_path / LOCK_NAME).write_text(json.dumps(dead))
        RunLock(tmp_path).acquire().release()
        rebooted = {**live, "boot": "an-earlier-boot", "pid": os.getppid()}  # a live PID now
        (tmp_path / LOCK_NAME).write_text(json.dumps(rebooted))
        RunLock(tmp_path).acquire().release()


# -- divergence -----------------------------------------------------------------------------------
def strict_json_lines(path: Path) -> list[dict]:
    def refuse(token: str) -> None:
        raise AssertionError(f"{path} holds the non-JSON token {token}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_a_huge_learning_rate_stops_the_run_and_writes_no_checkpoint(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", *RUN_ARGS, "--data", str(corpus), "--out", str(out)]
    assert main([*args, "--lr", "1e3", "--warmup-steps", "0", "--log-every", "5"]) == 2
    err = capsys.readouterr().err
    assert "training diverged at step" in err and "no checkpoint was written" in err
    assert not (out / "checkpoint").exists() and not (out / "summary.json").exists()
    rows = strict_json_lines(out / "metrics.jsonl")
    assert "diverged" in rows[-1]


def _nan_from_call(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """The n-th training forward (1-based) returns a NaN loss: its gradients are NaN too."""
    real = MoDTransformer.forward
    calls = {"n": 0}

    def forward(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        out = real(self, *a, **kw)
        if self.training:
            calls["n"] += 1
            if calls["n"] >= n:
                out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(MoDTransformer, "forward", forward)


def test_nan_after_a_checkpoint_keeps_it_and_names_the_step(corpus, tmp_path, monkeypatch):
    out = tmp_path / "run"
    real_forward = MoDTransformer.forward
    _nan_from_call(monkeypatch, 5)  # step 5 goes bad; looked at on step 6 (log_every=3)
    t = tc(corpus, out, steps=12, eval_every=3, log_every=3)
    import mixture_of_depths.train.loop as tr

    hashes = {}
    real_save = tr.save_checkpoint

    def save(directory, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        result = real_save(directory, *a, **kw)
        hashes[kw["trainer_state"]["step"]] = _digest(Path(directory))
        return result

    monkeypatch.setattr(tr, "save_checkpoint", save)
    with pytest.raises(TrainingDiverged, match="diverged at step 5: loss nan") as info:
        train(MoDConfig(**TINY), t, progress=False)
    assert "stopped at step 6" in str(info.value) and "(step 3) is the last good one" in str(
        info.value
    )
    assert sorted(hashes) == [3] and _digest(out / "checkpoint") == hashes[3]
    rows = strict_json_lines(out / "metrics.jsonl")
    assert max(r["step"] for r in rows if "loss" in r) == 3  # step 6's NaN line never written
    monkeypatch.setattr(MoDTransformer, "forward", real_forward)  # NaN gone: resume from step 3
    summary = train(None, t, resume=True, progress=False)
    assert summary["steps"] == 12 and max(losses(out)) == 12


def _digest(d: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(d.iterdir()):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def test_checkpoints_with_non_finite_weights_are_neither_written_nor_resumed(corpus, tmp_path):
    cfg = MoDConfig(**TINY)
    model = MoDTransformer(cfg)
    ck = save_checkpoint(tmp_path / "ck", model, cfg)
    before = _digest(ck)
    with torch.no_grad():
        model.blocks[0].attn.wqkv.weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or infinity.*blocks.0.attn.wqkv.weight"):
        save_checkpoint(tmp_path / "ck", model, cfg)
    assert _digest(ck) == before
    # A NaN checkpoint from an older version: resume refuses it.
    out = tmp_path / "run"
    train(cfg, tc(corpus, out, steps=3), progress=False)
    path = out / "checkpoint" / "model.safetensors"
    tensors = load_file(path)
    tensors["embed.weight"][0, 0] = float("nan")
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match="NaN or infinite"):
        train(None, tc(corpus, out, steps=6), resume=True, progress=False)


def test_a_random_score_checkpoint_with_predictors_is_refused_by_name(tmp_path):
    """Older versions built predictors under random router scores, and they decided its causal
    routing; this one does not, so such a checkpoint is refused, saying why, not loaded to route
    differently."""
    from mixture_of_depths.runtime.checkpoint import load_model

    cfg = MoDConfig(**TINY, causal_router="predictor")
    ck = save_checkpoint(tmp_path / "ck", MoDTransformer(cfg), cfg)
    saved = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**saved, "router_scores": "random"}))
    with pytest.raises(CheckpointError, match="predictors under random router scores"):
        load_model(ck)


def test_written_json_is_strict(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    summary = train(MoDConfig(**TINY, layer_pattern="D"), tc(corpus, out, steps=3), progress=False)
    summary["nan"] = float("nan")
    from mixture_of_depths.fileio import json_text, write_json

    assert json.loads(json_text(summary))["nan"] is None
    write_json(tmp_path / "s.json", {"x": [float("inf"), 1.0]})
    assert json.loads((tmp_path / "s.json").read_text()) == {"x": [None, 1.0]}
    strict_json_lines(out / "metrics.jsonl")
    json.loads((out / "summary.json").read_text(), parse_constant=pytest.fail)


@pytest.fixture()
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs to fill, so that the writers raise what a full disk really makes them raise
    (safetensors: a Rust SafetensorError, no OSError); mounting one needs root."""
    d = tmp_path / "small"
    d.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=2M", "tmpfs", str(d)]
    if os.geteuid() != 0 or not shutil.which("mount") or subprocess.run(mount).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def _fill(d: Path, leave: int) -> None:
    """Fill the filesystem of `d`, then free `leave` bytes of it."""
    with open(d / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    size = (d / "filler").stat().st_size
    os.truncate(d / "filler", max(0, size - leave))


def test_a_full_disk_during_a_checkpoint_write_names_the_file_and_the_kept_step(small_disk):
    cfg = MoDConfig(**TINY)
    model = MoDTransformer(cfg)
    ck = save_checkpoint(small_disk / "checkpoint", model, cfg, trainer_state={"step": 3})
    before = _digest(ck)
    _fill(small_disk, leave=8192)  # config.json fits, model.safetensors does not
    from mixture_of_depths.fileio import DiskFullError

    with pytest.raises(DiskFullError) as info:
        save_checkpoint(ck, model, cfg, trainer_state={"step": 6})
    assert str(info.value) == (
        f"could not write {ck / 'model.safetensors'}: the disk is full (ENOSPC); "
        f"the previous checkpoint {ck} (step 3) is intact"
    )
    causes, exc = [], info.value
    while exc is not None:
        causes, exc = [*causes, type(exc).__name__], exc.__cause__
    assert causes[-1] == "SafetensorError"  # what the library raised: recognised
    assert _digest(ck) == before and stale_temps(small_disk) == []


def test_a_full_disk_in_mod_train_is_one_line(corpus, tmp_path, capsys, monkeypatch):
    """What safetensors raises on ENOSPC (the test above sees it on a real full disk), raised by
    the writer of the second checkpoint of a `mod train`: one line, not a traceback."""
    from safetensors import SafetensorError

    import mixture_of_depths.fileio as fileio

    out = tmp_path / "run"
    real = fileio.save_file

    def save_file(tensors, tmp, metadata=None):  # noqa: ANN001, ANN202
        if (out / "checkpoint").exists() and Path(tmp).name.startswith(".model.safetensors."):
            raise SafetensorError("Error while serializing: I/O error: No space left on device "
                                  "(os error 28)")  # fmt: skip
        return real(tensors, tmp, metadata)

    monkeypatch.setattr(fileio, "save_file", save_file)
    args = ["train", *RUN_ARGS, "--steps", "8", "--data", str(corpus), "--out", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if not line.startswith("step ")]  # less the evaluation lines
    ck = out / "checkpoint"
    assert err == [
        f"mod train: error: could not write {ck / 'model.safetensors'}: the disk is full "
        f"(ENOSPC); the previous checkpoint {ck} (step 4) is intact"
    ]
    assert trainer_step(out) == 4 and stale_temps(out) == []


# -- resume rules ---------------------------------------------------------------------------------
def test_resume_refuses_fewer_steps_than_the_checkpoint(corpus, tmp_path):
    out = tmp_path / "run"
    train(MoDConfig(**TINY), tc(corpus, out, steps=6), progress=False)
    with pytest.raises(ValueError, match="--steps 3 is less than the checkpoint's step 6"):
        train(None, tc(corpus, out, steps=3), resume=True, progress=False)
    assert train(None, tc(corpus, out, steps=6), resume=True, progress=False)["steps"] == 6


def test_stale_temporaries_are_removed_at_start_and_on_save(corpus, tmp_path):
    out = tmp_path / "run"
    train(MoDConfig(**TINY), tc(corpus, out, steps=3), progress=False)
    junk = [out / ".checkpoint.abc123.tmp", out / ".overwritten.x.tmp"]
    for d in junk:
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"\0" * 1000)
    (out / ".metrics.jsonl.q1.tmp").write_text("half")
    train(None, tc(corpus, out, steps=6), resume=True, progress=False)
    assert stale_temps(out) == []
    # save_checkpoint alone (the library API) also clears its own leftovers.
    cfg = MoDConfig(**TINY)
    junk[0].mkdir()
    save_checkpoint(out / "checkpoint", MoDTransformer(cfg), cfg)
    assert not junk[0].exists()


# -- damaged checkpoint files ---------------------------------------------------------------------
class _Boom:
    """Unpickling this writes a marker file: proof that something unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (Path.write_text, (self.marker, "unpickled!"))


def _damage(ck: Path, name: str, how: str, marker: Path) -> None:
    path = ck / name
    if how == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "torch.save":
        torch.save({"embed.weight": torch.zeros(3)}, path)
    elif how == "pickle":
        path.write_bytes(pickle.dumps(_Boom(marker)))
    elif how.startswith("rng="):  # the generator state replaced, the rest kept
        state = json.loads(path.read_text())
        state["rng"] = json.loads(how[4:])
        path.write_text(json.dumps(state))
    else:
        path.write_text(how)  # literal JSON text


DAMAGE = [
    ("model.safetensors", "truncate"),
    ("model.safetensors", "empty"),
    ("model.safetensors", "torch.save"),
    ("model.safetensors", "pickle"),
    ("optimizer.safetensors", "truncate"),
    ("config.json", "[]"),
    ("config.json", "null"),
    ("config.json", '{"d_model": 32,'),
    ("config.json", '{"d_model": "wide"}'),
    ("trainer.json", "{}"),
    ("trainer.json", '{"step": 3, "sampler": {}, "train_config": {}}'),
    ("trainer.json", 'rng={"cpu": "AAAA"}'),  # base64, but not a generator's state
    ("trainer.json", 'rng={"cpu": "not base64!"}'),
    ("trainer.json", "rng=[]"),
    ("trainer.json", 'rng={"cpu": "AAAA", "cuda": 5}'),
    ("optimizer.json", "{}"),
    ("tokenizer.json", "\x00\x01 not a tokenizer"),
]


@pytest.mark.parametrize("name,how", DAMAGE)
def test_a_damaged_checkpoint_file_is_named_in_the_error(finished_run, tmp_path, name, how, capsys):
    corpus, good = finished_run
    out = tmp_path / "run"
    shutil.copytree(good, out)
    marker = tmp_path / "marker"
    _damage(out / "checkpoint", name, how, marker)
    path = out / "checkpoint" / name
    what = "tokenizer file" if name == "tokenizer.json" else "checkpoint file"
    assert main(["train", "--out", str(out), "--resume", "--steps", "6", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{what} {path} is corrupt or not a" in err, err
    assert "Traceback" not in err
    if name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert main(["eval", str(out / "checkpoint"), "--data", str(corpus)]) == 2
        assert f"{what} {path} is corrupt" in capsys.readouterr().err
    assert not marker.exists()  # nothing was unpickled
