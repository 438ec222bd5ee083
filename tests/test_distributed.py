"""Data-parallel training under torchrun (gloo, local processes) against one process.

The oracle is the single-process run with the same global batch and seed: a 2-rank DDP run must
log the same losses, gradient norms and evaluation step by step, and so must a 2-rank FSDP2 run
(gloo, an explicit CPU mesh) and one process that splits each step into micro-batches
(`grad_accum`). Runs are in float64 (`--dtype float64`) so that routing decisions cannot flip on
round-off. Losses agree to ~1e-15 at first; AdamW then amplifies round-off in coordinates whose
gradient is nearly zero (it divides by sqrt(v)), so steps after the first evaluation are
compared to 1e-5 relative: a summed instead of averaged gradient (reported of FSDP2 on gloo,
pytorch issue 162338), a rank's loss logged as the job's, or a batch split wrongly miss by
orders of magnitude more.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

COMMON = [
    "train", "--preset", "tiny", "--d-model", "32", "--n-heads", "2", "--max-seq-len", "32",
    "--steps", "4", "--eval-every", "2", "--eval-batches", "1", "--batch-size", "4",
    "--log-every", "1", "--dtype", "float64", "--lr", "1e-2", "--no-progress",
]  # fmt: skip


def run_mod(args: list[str], env: dict[str, str], nproc: int = 1) -> None:
    if nproc == 1:
        cmd = [sys.executable, "-m", "mixture_of_depths", *args]
    else:
        launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        cmd = [sys.executable, *launch, "-m", "mixture_of_depths", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def logged(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(got: list[dict], want: list[dict]) -> None:
    """Step by step: to round-off (1e-12) up to the first evaluation, to 1e-5 after it (see the
    module docstring). A gradient summed over 2 ranks instead of averaged doubles the first
    step's gradient norm."""
    assert [r["step"] for r in got] == [r["step"] for r in want]
    first_eval = min(r["step"] for r in want if "val_loss_topk" in r)
    for g, w in zip(got, want, strict=True):
        keys = [k for k in ("loss", "lm_loss", "aux_loss", "grad_norm") if k in w]
        keys += [k for k in ("val_loss_topk", "val_loss_causal") if k in w]
        assert keys and set(keys) <= set(g), (sorted(g), sorted(w))
        rel = 1e-12 if w["step"] <= first_eval else 1e-5
        for k in keys:
            assert g[k] == pytest.approx(w[k], rel=rel, abs=0), (g["step"], k)
        for k in ("routing_accuracy", "causal_take_rate"):  # evaluation, averaged over ranks
            for layer, v in w.get(k, {}).items():
                assert g[k][layer] == pytest.approx(v, rel=1e-9, abs=1e-12), (g["step"], k)


@pytest.fixture()
def env(corpus: Path, tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MOD_CACHE_DIR": str(tmp_path / "cache"),
        "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"),
    }


def test_ddp_two_ranks_and_grad_accum_equal_one_process(corpus, tmp_path, env):
    base = [*COMMON, "--data", str(corpus)]
    one, two, acc = tmp_path / "one", tmp_path / "two", tmp_path / "acc"
    run_mod([*base, "--out", str(one)], env)
    run_mod([*base, "--out", str(two)], env, nproc=2)
    run_mod([*base, "--out", str(acc), "--grad-accum", "2"], env)
    want = logged(one)
    assert len([r for r in want if "loss" in r]) == 4 and any("val_loss_topk" in r for r in want)
    assert_same_run(logged(two), want)
    assert_same_run(logged(acc), want)
    # The first step, before AdamW has amplified anything, agrees to round-off.
    assert logged(two)[0]["loss"] == pytest.approx(want[0]["loss"], rel=1e-13)
    # Rank 0 wrote the run; the checkpoint is the single-process kind `mod eval` reads.
    assert (two / "checkpoint" / "model.safetensors").exists()
    assert json.loads((two / "summary.json").read_text())["steps"] == 4


def test_fsdp_two_ranks_equal_one_process_and_its_checkpoint_is_whole(corpus, tmp_path, env):
    base = [*COMMON, "--data", str(corpus)]
    one, fsdp = tmp_path / "one", tmp_path / "fsdp"
    run_mod([*base, "--out", str(one)], env)
    run_mod([*base, "--out", str(fsdp), "--parallel", "fsdp"], env, nproc=2)
    want = logged(one)
    assert_same_run(logged(fsdp), want)
    assert logged(fsdp)[0]["grad_norm"] == pytest.approx(want[0]["grad_norm"], rel=1e-12)
    # The checkpoint rank 0 wrote is whole (gathered from the shards): one process resumes it.
    from mixture_of_depths.checkpoint import load_model, load_optimizer_state

    model, _ = load_model(fsdp / "checkpoint")
    ref, _ = load_model(one / "checkpoint")
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert p.shape == q.shape and (p - q).abs().max() < 1e-4, name
    state = load_optimizer_state(fsdp / "checkpoint")
    assert len(state["state"]) == len(list(model.parameters()))
    run_mod(["train", "--out", str(fsdp), "--resume", "--steps", "5", "--no-progress"], env)
    assert logged(fsdp)[-1]["step"] == 5


def test_expert_layers_under_fsdp_equal_micro_batches_in_one_process(corpus, tmp_path, env):
    """Staged MoDE sharded by FSDP2 against one process with `--grad-accum 2`: each rank's rows
    are one micro-batch, and the load-balancing loss and capacity are a micro-batch's (as in
    every data-parallel MoE), so these two runs are the same computation. This caught the expert
    routes of blocks being lost when FSDP2 rebuilt a block's arguments."""
    base = [*COMMON, "--data", str(corpus), "--n-experts", "4"]
    acc, fsdp = tmp_path / "acc", tmp_path / "fsdp"
    run_mod([*base, "--out", str(acc), "--grad-accum", "2"], env)
    run_mod([*base, "--out", str(fsdp), "--parallel", "fsdp"], env, nproc=2)
    want, got = logged(acc), logged(fsdp)
    assert_same_run(got, want)
    for g, w in zip(got, want, strict=True):
        if "moe_loss" in w:
            assert g["moe_loss"] == pytest.approx(w["moe_loss"], rel=1e-5)
            assert set(g["expert_share"]) == set(w["expert_share"]) == {"0", "1", "2", "3"}


def test_global_batch_must_split_over_ranks_and_micro_batches(corpus, tmp_path, env):
    proc = subprocess.run(
        [sys.executable, "-m", "mixture_of_depths", *COMMON, "--data", str(corpus),
         "--out", str(tmp_path / "x"), "--grad-accum", "3"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "batch_size 4 (the global batch) must split evenly" in proc.stderr


def test_killed_rank_restarts_from_its_last_checkpoint_and_ends_as_uninterrupted(
    corpus, tmp_path, env
):
    """`kill -9` of rank 0 after the 3rd logged step of a 2-rank DDP job under torchrun
    --max-restarts 1 (tests/crash.py): torchrun restarts both ranks, `mod train` resumes from the
    checkpoint of step 2 by itself, and the job ends with the uninterrupted job's losses."""
    crash = Path(__file__).with_name("crash.py")
    args = [*COMMON, "--data", str(corpus), "--steps", "6"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    logs = {}
    for point, out in (("none", tmp_path / "clean"), ("log", tmp_path / "killed")):
        cmd = [*launch, "--max-restarts=1", str(crash), point, "3", *args, "--out", str(out)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        logs[point] = (proc.stderr, logged(out))
    err, killed = logs["log"]
    assert "restarted by torchrun; resuming" in err
    clean = logs["none"][1]
    steps = [r["step"] for r in killed if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]  # step 3 logged before the kill, then again after resume
    final = [r for r in clean if "val_loss_topk" in r][-1]
    got = [r for r in killed if "val_loss_topk" in r][-1]
    assert got["step"] == final["step"] == 6
    # The same run to round-off: in float64 a resumed DDP job matches to ~1e-10 (DDP's gradient
    # buckets are rebuilt after a job's first step, so the order of its reductions differs).
    for key in ("val_loss_topk", "val_loss_causal"):
        assert got[key] == pytest.approx(final[key], rel=1e-8), key
    want = [r["loss"] for r in clean if "loss" in r]
    assert [r["loss"] for r in killed if "loss" in r] == pytest.approx(want, rel=1e-8)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_node_job_on_one_machine_equals_one_process(corpus, tmp_path, env):
    """The multi-node command, two "nodes" of one process each on 127.0.0.1 (two torchrun
    launchers joined by --master-addr/--master-port, --node-rank 0 and 1): the job trains as
    one process does."""
    base = [*COMMON, "--data", str(corpus)]
    one, two = tmp_path / "one", tmp_path / "nodes"
    run_mod([*base, "--out", str(one)], env)
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc_per_node=1",
                f"--node_rank={node}",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                "-m",
                "mixture_of_depths",
                *base,
                "--out",
                str(two),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for node in (0, 1)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-4000:]
    assert_same_run(logged(two), logged(one))
