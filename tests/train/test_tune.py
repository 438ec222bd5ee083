"""Router tuning (`mod tune-routers`, `TrainConfig.init_from` / `tune` / `distill` /
`capacity_warmup`) on a dense model of ours converted to MoD through the Llama layout.

Oracles: the frozen weights stay bit for bit; the dense teacher is the original model (KL 0 to a
converted model at full capacity); an interrupted tuning run resumed equals an uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import losses, tc, train_until

from mixture_of_depths import MoDConfig, MoDTransformer
from mixture_of_depths.cli import main
from mixture_of_depths.convert import convert, llama_config, to_llama
from mixture_of_depths.data import ByteTokenizer
from mixture_of_depths.runtime.checkpoint import load_model, save_checkpoint
from mixture_of_depths.train import train
from mixture_of_depths.train.tune import Distilled, capacity_at, dense_teacher, is_router_param

DENSE = MoDConfig(vocab_size=257, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2,
                  max_seq_len=32, layer_pattern="D")  # fmt: skip


def converted(tmp_path: Path, capacity: float = 0.25, **kw) -> Path:
    """A checkpoint of a dense model converted to MoD (routed every other block)."""
    torch.manual_seed(0)
    dense = MoDTransformer(DENSE)
    model = convert(to_llama(dense), llama_config(DENSE), "DR", capacity, **kw)
    return save_checkpoint(tmp_path / "conv", model, model.config, tokenizer=ByteTokenizer())


def test_tuning_routers_changes_only_routers_and_logs_the_schedule(corpus, tmp_path):
    start = converted(tmp_path)
    out = tmp_path / "tuned"
    t = tc(corpus, out, init_from=str(start), tune="routers", distill=1.0, capacity_warmup=4,
           steps=6, seq_len=32, lr=1e-2)  # fmt: skip
    train(None, t, progress=False)
    before, after = (
        load_model(start)[0].state_dict(),
        load_model(out / "checkpoint")[0].state_dict(),
    )
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(is_router_param(k) for k in changed)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["capacity"] for r in steps] == [capacity_at(s, 0.25, 4) for s in range(6)]
    assert steps[0]["capacity"] == 1.0 and steps[-1]["capacity"] == 0.25
    assert all(r["distill_loss"] >= 0 for r in steps)
    assert load_model(out / "checkpoint")[1].capacity == 0.25  # saved at the target


def test_the_teacher_is_the_original_model():
    """Distillation's teacher is the dense twin with the same weights: against a converted
    model at full capacity (straight-through gate) the KL is zero."""
    torch.manual_seed(0)
    dense = MoDTransformer(DENSE).double()
    model = convert(to_llama(dense), llama_config(DENSE), "DR", 1.0).double()
    teacher = dense_teacher(model)
    x = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(1))
    assert torch.equal(teacher(x).logits, dense(x).logits)
    out = Distilled(model, teacher, 1.0)(x, x)
    assert out.distill_loss.abs() < 1e-12
    assert not any(p.requires_grad for p in teacher.parameters())


def test_an_interrupted_tuning_run_resumes_exactly(corpus, tmp_path):
    start = converted(tmp_path)
    args = dict(init_from=str(start), tune="routers", distill=0.5, capacity_warmup=3, seq_len=32)
    full = tmp_path / "full"
    train(None, tc(corpus, full, **args), progress=False)
    cut = tc(corpus, tmp_path / "cut", **args)
    train_until(None, cut, stop_at=3)
    train(None, cut, resume=True, progress=False)
    assert losses(tmp_path / "cut") == losses(full)


def test_the_cli_mode_and_its_refusals(corpus, tmp_path, capsys):
    start = converted(tmp_path)
    out = tmp_path / "cli"
    common = ["--data", str(corpus), "--steps", "2", "--eval-every", "2", "--eval-batches", "1",
              "--batch-size", "2", "--seq-len", "32", "--no-progress"]  # fmt: skip
    assert main(["tune-routers", str(start), "--out", str(out), *common]) == 0
    run = json.loads((out / "run.json").read_text())["train"]
    assert run["tune"] == "routers" and run["init_from"] == str(start)
    dense = MoDTransformer(DENSE)
    plain = save_checkpoint(tmp_path / "dense", dense, DENSE, tokenizer=ByteTokenizer())
    assert main(["tune-routers", str(plain), "--out", str(tmp_path / "x"), *common]) == 2
    assert "no routers to tune" in capsys.readouterr().err
    with pytest.raises(ValueError, match="distill needs a teacher"):
        train(MoDConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=4, max_seq_len=32),
              tc(corpus, tmp_path / "y", distill=1.0, seq_len=32), progress=False)  # fmt: skip


def _capacities(out: Path) -> list[float | None]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r.get("capacity") for r in rows if "loss" in r]


def test_capacity_warmup_defaults_to_a_tenth_of_the_steps_and_resume_keeps_it(corpus, tmp_path):
    """The default (experiments/round2): a routed model warms its capacity up over 10% of the
    steps; `capacity_warmup` steps override the ratio; a dense model has none; a resume that
    extends --steps keeps the warm-up the run began with."""
    from mixture_of_depths.train import resume_config

    cfg = MoDConfig(vocab_size=257, d_model=32, n_layers=4, n_heads=4, max_seq_len=32)
    assert cfg.capacity == 0.125
    t = tc(corpus, tmp_path / "ratio", steps=30, seq_len=32, eval_every=10)
    assert t.capacity_warmup_ratio == 0.1 and t.capacity_warmup == 0
    train(cfg, t, progress=False)
    assert _capacities(tmp_path / "ratio") == [capacity_at(s, 0.125, 3) for s in range(30)]
    train(cfg, tc(corpus, tmp_path / "steps", steps=8, seq_len=32, capacity_warmup=5),
          progress=False)  # fmt: skip
    assert _capacities(tmp_path / "steps") == [capacity_at(s, 0.125, 5) for s in range(8)]
    dense = MoDConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=4, max_seq_len=32,
                      layer_pattern="D")  # fmt: skip
    train(dense, tc(corpus, tmp_path / "dense", seq_len=32), progress=False)
    assert _capacities(tmp_path / "dense") == [None] * 6
    # cut inside the warm-up, resumed to twice the steps: still 3 warm-up steps, not 6
    cut = tc(corpus, tmp_path / "cut", steps=30, seq_len=32, eval_every=2)
    train_until(cfg, cut, stop_at=2)
    longer = resume_config(tmp_path / "cut", {"steps": 60})
    train(None, longer, resume=True, progress=False)
    assert _capacities(tmp_path / "cut") == [capacity_at(s, 0.125, 3) for s in range(60)]
    # a run written before the ratio existed resumes with none (its warm-up was in steps)
    state_path = tmp_path / "ratio" / "checkpoint" / "trainer.json"
    state = json.loads(state_path.read_text())
    del state["train_config"]["capacity_warmup_ratio"], state["capacity_warmup_steps"]
    state_path.write_text(json.dumps(state))
    assert resume_config(tmp_path / "ratio", {"steps": 40}).capacity_warmup_ratio == 0.0


def test_a_run_from_a_checkpoint_records_and_keeps_its_tokenizer(corpus, tmp_path, capsys):
    """A run from a checkpoint's weights uses that checkpoint's tokenizer: run.json and
    trainer.json say which; a --tokenizer naming another is refused, saying so; a resumed tuning
    run (tokenizer among the fixed settings) goes on."""
    from mixture_of_depths.data import BPETokenizer

    bpe = BPETokenizer.train(sorted(corpus.iterdir()), vocab_size=300)
    cfg = MoDConfig(vocab_size=bpe.vocab_size, d_model=32, n_layers=2, n_heads=4, max_seq_len=32)
    start = save_checkpoint(tmp_path / "bpe", MoDTransformer(cfg), cfg, tokenizer=bpe)
    common = ["--data", str(corpus), "--steps", "2", "--eval-every", "2", "--eval-batches", "1",
              "--batch-size", "2", "--seq-len", "32", "--no-progress"]  # fmt: skip
    out = tmp_path / "tuned"
    assert main(["tune-routers", str(start), "--out", str(out), *common]) == 0
    assert json.loads((out / "run.json").read_text())["train"]["tokenizer"] == "bpe"
    state = json.loads((out / "checkpoint" / "trainer.json").read_text())
    assert state["train_config"]["tokenizer"] == "bpe"
    resumed = ["tune-routers", str(start), "--out", str(out), *common, "--steps", "3", "--resume"]
    assert main(resumed) == 0
    capsys.readouterr()
    refused = tmp_path / "refused"
    argv = ["tune-routers", str(start), "--out", str(refused), *common, "--tokenizer", "byte"]
    assert main(argv) == 2
    assert f"--tokenizer byte: a run from {start} uses that checkpoint's tokenizer (bpe, " in (
        capsys.readouterr().err
    )
    byte = converted(tmp_path)
    argv = ["train", "--init-from", str(byte), "--out", str(refused), *common, "--tokenizer", "bpe"]
    assert main(argv) == 2
    assert "uses that checkpoint's tokenizer (byte, 257 tokens)" in capsys.readouterr().err
    assert not refused.exists()
