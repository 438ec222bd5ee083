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
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import CRASH, write_corpus

# A global batch of 6 rows splits over 1, 2 and 3 ranks.
COMMON = [
    "train", "--preset", "tiny", "--d-model", "32", "--n-heads", "2", "--max-seq-len", "32",
    "--steps", "6", "--eval-every", "2", "--eval-batches", "1", "--batch-size", "6",
    "--log-every", "1", "--dtype", "float64", "--lr", "1e-2", "--no-progress",
]  # fmt: skip


def run_mod(
    args: list[str], env: dict[str, str], nproc: int = 1, ok: bool = True, launch: list[str] = ()
) -> subprocess.CompletedProcess:
    """`mod ARGS` in one process, or under torchrun with `nproc` ranks (`launch`: more torchrun
    flags, then a script in place of ``-m mixture_of_depths``)."""
    start = list(launch) or ["-m", "mixture_of_depths"]
    if nproc > 1 or launch:
        run = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        start = [*run, *start]
    cmd = [sys.executable, *start, *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if ok:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def logged(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(got: list[dict], want: list[dict], name: str = "") -> None:
    """Step by step: to round-off (1e-12) up to the first evaluation, to 1e-5 after it (see the
    module docstring). A gradient summed over 2 ranks instead of averaged doubles the first
    step's gradient norm. Prints the largest differences (`pytest -s` shows them)."""
    assert [r["step"] for r in got] == [r["step"] for r in want]
    first_eval = min(r["step"] for r in want if "val_loss_topk" in r)
    worst = {"early": 0.0, "late": 0.0}
    for g, w in zip(got, want, strict=True):
        for k in ("loss", "grad_norm", "val_loss_topk", "val_loss_causal"):
            if k in w and k in g:
                rel = abs(g[k] - w[k]) / abs(w[k])
                span = "early" if w["step"] <= first_eval else "late"
                worst[span] = max(worst[span], rel)
    final = [r for r in want if "val_loss_topk" in r][-1]
    final_got = [r for r in got if "val_loss_topk" in r][-1]
    print(
        f"\n{name or 'run'}: {len([r for r in got if 'loss' in r])} steps; max relative "
        f"difference of loss, grad norm and val losses to step {first_eval}: "
        f"{worst['early']:.1e}, after: {worst['late']:.1e}; final val loss top-k "
        f"{final_got['val_loss_topk']:.12f} vs {final['val_loss_topk']:.12f} (one process)"
    )
    for g, w in zip(got, want, strict=True):
        keys = [k for k in ("loss", "lm_loss", "aux_loss", "grad_norm") if k in w]
        keys += [k for k in ("val_loss_topk", "val_loss_causal") if k in w]
        assert keys and set(keys) <= set(g), (sorted(g), sorted(w))
        rel = 1e-12 if w["step"] <= first_eval else 1e-5
        for k in keys:
            assert g[k] == pytest.approx(w[k], rel=rel, abs=0), (g["step"], k)
        # Evaluation's rates, averaged over ranks: float32 ratios, so to float32 round-off (one
        # token decided otherwise moves a rate by 1/(rows x seq_len) = 5e-3 here).
        for k in ("routing_accuracy", "causal_take_rate"):
            for layer, v in w.get(k, {}).items():
                assert g[k][layer] == pytest.approx(v, rel=1e-6, abs=1e-9), (g["step"], k)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The corpus and the environment of every run here (one token cache for them all)."""
    root = tmp_path_factory.mktemp("distributed")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MOD_CACHE_DIR": str(root / "cache"),
        "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src"),
    }
    return write_corpus(root / "corpus"), env


@pytest.fixture(scope="module")
def reference(shared: tuple[Path, dict[str, str]], tmp_path_factory) -> list[dict]:
    """The oracle: the log of one process training on the whole global batch."""
    corpus, env = shared
    out = tmp_path_factory.mktemp("reference") / "one"
    run_mod([*COMMON, "--data", str(corpus), "--out", str(out)], env)
    want = logged(out)
    assert len([r for r in want if "loss" in r]) == 6 and any("val_loss_topk" in r for r in want)
    return want


@pytest.fixture()
def corpus(shared: tuple[Path, dict[str, str]]) -> Path:
    return shared[0]


@pytest.fixture()
def env(shared: tuple[Path, dict[str, str]]) -> dict[str, str]:
    return shared[1]


def test_ddp_two_ranks_and_grad_accum_equal_one_process(corpus, tmp_path, env, reference):
    base = [*COMMON, "--data", str(corpus)]
    two, acc = tmp_path / "two", tmp_path / "acc"
    printed = run_mod([*base, "--out", str(two)], env, nproc=2).stderr  # evaluation lines
    run_mod([*base, "--out", str(acc), "--grad-accum", "2"], env)
    assert_same_run(logged(two), reference, "DDP, 2 ranks")
    # Each evaluation's line is printed once, by rank 0, not once per rank.
    evals = [r["step"] for r in logged(two) if "val_loss_topk" in r]
    lines = [line for line in printed.splitlines() if ": val loss top-k" in line]
    assert [int(line.split()[1].rstrip(":")) for line in lines] == evals == [2, 4, 6]
    assert_same_run(logged(acc), reference, "1 process, --grad-accum 2")
    # The first step, before AdamW has amplified anything, agrees to round-off.
    assert logged(two)[0]["loss"] == pytest.approx(reference[0]["loss"], rel=1e-13)
    # Rank 0 wrote the run; under DDP the checkpoint is the single-file kind by default.
    assert (two / "checkpoint" / "model.safetensors").exists()
    assert json.loads((two / "summary.json").read_text())["steps"] == 6


def shard_files(ckpt: Path) -> list[str]:
    return sorted(f.name for f in (ckpt / "shards").iterdir())


@pytest.mark.slow
def test_fsdp_equals_one_process_a_rank_killed_mid_save_keeps_the_last_checkpoint_and_it_resumes_on_1_and_3_ranks(  # noqa: E501
    corpus, tmp_path, env, reference
):
    """A 2-rank FSDP2 job (sharded checkpoints, the default under FSDP2) whose rank 1 is killed
    (kill -9) inside its third checkpoint write, at step 6, with no restart. Its log is the
    single-process run's; the checkpoint of step 4 is intact (the killed write left at most a
    temporary folder). That checkpoint resumes in 1 process and on 3 ranks (DCP reshards the
    2-rank shards), and both end as the uninterrupted single process did; the 3-rank job's own
    sharded checkpoint consolidates into a single-file one that holds the same weights and
    optimizer state."""
    from mixture_of_depths.runtime.checkpoint import is_sharded, load_model, load_optimizer_state

    crash = str(CRASH)
    out = tmp_path / "fsdp"
    args = [*COMMON, "--data", str(corpus), "--out", str(out), "--parallel", "fsdp"]
    proc = run_mod(args, env, nproc=2, ok=False, launch=[crash, "shards@1", "3"])
    assert proc.returncode != 0
    assert_same_run(logged(out), reference, "FSDP2, 2 ranks, rank 1 killed in the step-6 save")
    assert logged(out)[0]["grad_norm"] == pytest.approx(reference[0]["grad_norm"], rel=1e-12)
    ckpt = out / "checkpoint"
    assert json.loads((ckpt / "trainer.json").read_text())["step"] == 4
    assert is_sharded(ckpt) and not (ckpt / "model.safetensors").exists()
    assert len(shard_files(ckpt)) == 2
    # The write cut short: left behind, or removed by rank 0 if it saw rank 1's end (a gloo
    # error) before torchrun stopped it.
    assert len(list(out.glob(".checkpoint.*.tmp"))) <= 1
    load_model(ckpt)  # loadable as it is
    three = tmp_path / "three"
    shutil.copytree(out, three)
    resume = ["train", "--resume", "--steps", "6", "--no-progress"]
    run_mod([*resume, "--out", str(out)], env)
    run_mod([*resume, "--out", str(three), "--parallel", "fsdp"], env, nproc=3)
    assert_same_run(logged(out), reference, "its step-4 checkpoint resumed in 1 process")
    assert_same_run(logged(three), reference, "its step-4 checkpoint resumed on 3 FSDP2 ranks")
    assert not list(three.glob(".checkpoint.*.tmp"))  # the next save removed it
    assert (out / "checkpoint" / "model.safetensors").exists()  # one process: single-file
    sharded = three / "checkpoint"
    assert len(shard_files(sharded)) == 3
    whole = tmp_path / "consolidated"
    proc = run_mod(["consolidate", str(sharded), str(whole)], env)
    assert "single-file checkpoint" in proc.stdout
    assert not is_sharded(whole) and (whole / "model.safetensors").exists()
    a, b = load_model(sharded)[0].state_dict(), load_model(whole)[0].state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    one = load_model(out / "checkpoint")[0].state_dict()  # resumed in one process
    assert all((a[k] - one[k]).abs().max() < 1e-4 for k in a)
    sa, sb = load_optimizer_state(sharded), load_optimizer_state(whole)
    assert sa["param_groups"] == sb["param_groups"]
    assert len(sa["state"]) == len(list(load_model(whole)[0].parameters()))
    for pid, st in sa["state"].items():
        assert all(torch.equal(v, sb["state"][pid][k]) for k, v in st.items())
    # The consolidated checkpoint is a run's checkpoint: one process resumes it.
    shutil.rmtree(sharded)
    shutil.copytree(whole, sharded)
    run_mod(["train", "--out", str(three), "--resume", "--steps", "7", "--no-progress"], env)
    assert logged(three)[-1]["step"] == 7


def test_expert_layers_under_ddp_and_fsdp_equal_micro_batches_in_one_process(corpus, tmp_path, env):
    """MoDE (routed blocks with 2 experts and 14 no-op experts) under DDP and sharded by FSDP2,
    against one process with `--grad-accum 2`: each rank's rows are one micro-batch, and the
    load-balancing loss and capacity are a micro-batch's (as in every data-parallel MoE), so
    these runs are the same computation. This caught the expert routes of blocks being lost
    when FSDP2 rebuilt a block's arguments, and, with so many no-ops that some steps send no
    token of a rank to a real expert, the experts' gradients missing on that rank only (a
    collective mismatch that aborted the job)."""
    base = [*COMMON, "--data", str(corpus), "--n-experts", "2", "--n-noop-experts", "14"]
    acc, fsdp, ddp = tmp_path / "acc", tmp_path / "fsdp", tmp_path / "ddp"
    run_mod([*base, "--out", str(acc), "--grad-accum", "2"], env)
    whole = ["--checkpoint-format", "whole"]
    run_mod([*base, "--out", str(fsdp), "--parallel", "fsdp", *whole], env, nproc=2)
    run_mod([*base, "--out", str(ddp), "--parallel", "ddp"], env, nproc=2)
    want = logged(acc)
    for name, out in (("FSDP2", fsdp), ("DDP", ddp)):
        got = logged(out)
        assert_same_run(got, want, f"MoDE, {name} 2 ranks vs 1 process --grad-accum 2")
        for g, w in zip(got, want, strict=True):
            if "moe_loss" in w:
                assert g["moe_loss"] == pytest.approx(w["moe_loss"], rel=1e-5)
                assert set(g["expert_share"]) == set(w["expert_share"]) == {"0", "1", "2", "3"}
    # --checkpoint-format whole under FSDP2: rank 0 wrote the gathered weights, one file.
    from mixture_of_depths.runtime.checkpoint import load_model

    a, b = load_model(fsdp / "checkpoint")[0], load_model(acc / "checkpoint")[0]
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert p.shape == q.shape and (p - q).abs().max() < 1e-4, name


def test_global_batch_must_split_over_ranks_and_micro_batches(corpus, tmp_path, env):
    proc = subprocess.run(
        [sys.executable, "-m", "mixture_of_depths", *COMMON, "--data", str(corpus),
         "--out", str(tmp_path / "x"), "--grad-accum", "4"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "batch_size 6 (the global batch) must split evenly" in proc.stderr


@pytest.mark.slow
def test_killed_rank_restarts_from_its_last_checkpoint_and_ends_as_uninterrupted(
    corpus, tmp_path, env
):
    """`kill -9` of rank 0 after the 3rd logged step of a 2-rank DDP job under torchrun
    --max-restarts 1 (tests/crash.py): torchrun restarts both ranks, `mod train` resumes from the
    checkpoint of step 2 by itself, and the job ends with the uninterrupted job's losses."""
    crash = CRASH
    args = [*COMMON, "--data", str(corpus)]
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
    got_losses = [r["loss"] for r in killed if "loss" in r]
    diff = max(abs(g - w) / abs(w) for g, w in zip(got_losses, want, strict=True))
    print(
        f"\nDDP 2 ranks, rank 0 killed after step 3, restarted: final val loss top-k "
        f"{got['val_loss_topk']:.12f} vs {final['val_loss_topk']:.12f} uninterrupted; largest "
        f"relative loss difference over the 6 steps {diff:.1e}"
    )
    assert got_losses == pytest.approx(want, rel=1e-8)


def test_fsdp_job_restarted_after_a_rank_died_mid_save_ends_as_one_process(
    corpus, tmp_path, env, reference
):
    """Rank 1 of a 2-rank FSDP2 job is killed inside its sharded write of step 4 under torchrun
    --max-restarts 1: the restarted job resumes from step 2's checkpoint by itself, removes the
    cut-short write, and ends with the single process's losses."""
    crash = str(CRASH)
    out = tmp_path / "fsdp"
    args = [*COMMON, "--data", str(corpus), "--out", str(out), "--parallel", "fsdp"]
    proc = run_mod(args, env, nproc=2, launch=["--max-restarts=1", crash, "shards@1", "2"])
    assert "restarted by torchrun; resuming" in proc.stderr
    assert_same_run(logged(out), reference, "FSDP2, rank 1 killed mid-save, restarted")
    assert not list(out.glob(".checkpoint.*.tmp"))
    assert json.loads((out / "checkpoint" / "trainer.json").read_text())["step"] == 6


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_node_job_on_one_machine_equals_one_process(corpus, tmp_path, env, reference):
    """The multi-node command, two "nodes" of one process each on 127.0.0.1 (two torchrun
    launchers joined by --master-addr/--master-port, --node-rank 0 and 1): the job trains as
    one process does. Its checkpoints are sharded under DDP (each rank writes part of the
    replicated tensors), which one process loads."""
    base = [*COMMON, "--data", str(corpus), "--checkpoint-format", "sharded"]
    two = tmp_path / "nodes"
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
    assert_same_run(logged(two), reference, "two nodes x 1 process (DDP, sharded checkpoints)")
    from mixture_of_depths.runtime.checkpoint import is_sharded, load_model

    assert is_sharded(two / "checkpoint") and len(shard_files(two / "checkpoint")) == 2
    assert load_model(two / "checkpoint")[0].num_params() > 0
