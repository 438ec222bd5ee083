"""Sharded checkpoints (torch.distributed.checkpoint, safetensors shards) in one process: they
hold the same model, optimizer state and run as the single-file kind, which is the oracle here.
Several ranks writing and resharding them: test_distributed.py."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from helpers import TINY, losses, tc, train_until
from safetensors import safe_open

from mixture_of_depths import MoDConfig, MoDTransformer
from mixture_of_depths.cli import main
from mixture_of_depths.data import ByteTokenizer
from mixture_of_depths.runtime.checkpoint import (
    CheckpointError,
    consolidate_checkpoint,
    is_sharded,
    load_model,
    load_optimizer_state,
    save_checkpoint,
    save_sharded_checkpoint,
)
from mixture_of_depths.runtime.distributed import DistEnv
from mixture_of_depths.train import TrainConfig, make_optimizer, train


def trained(tie: bool) -> tuple[MoDConfig, MoDTransformer, torch.optim.AdamW]:
    """A tiny model after two AdamW steps. The routers get no gradient, so AdamW holds no state
    for them, as for the weights of a block that took no token or random-score routers."""
    cfg = MoDConfig(**TINY, tie_embeddings=tie, routing="staggered", causal_router="predictor")
    torch.manual_seed(1)
    model = MoDTransformer(cfg)
    opt = make_optimizer(model, TrainConfig())
    x = torch.randint(0, cfg.vocab_size, (2, 24))
    for _ in range(2):
        model(x, targets=x).loss.backward()
        for name, p in model.named_parameters():
            if ".router." in name:
                p.grad = None
        opt.step()
        opt.zero_grad()
    return cfg, model, opt


def both_kinds(tmp_path: Path, tie: bool) -> tuple[Path, Path, MoDTransformer]:
    cfg, model, opt = trained(tie)
    state = {"step": 2}
    sharded = save_sharded_checkpoint(
        tmp_path / "sharded", model, opt, cfg, DistEnv(), trainer_state=state,
        tokenizer=ByteTokenizer(),
    )  # fmt: skip
    whole = save_checkpoint(
        tmp_path / "whole", model, cfg, optimizer=opt, trainer_state=state,
        tokenizer=ByteTokenizer(),
    )  # fmt: skip
    return sharded, whole, model


def assert_same_optimizer(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert sorted(a["state"]) == sorted(b["state"])
    for pid, st in a["state"].items():
        assert sorted(st) == sorted(b["state"][pid])
        for k, v in st.items():
            assert torch.equal(v, b["state"][pid][k]), (pid, k)


@pytest.mark.parametrize("tie", [True, False])
def test_sharded_checkpoint_holds_what_the_single_file_one_holds(tmp_path: Path, tie: bool):
    sharded, whole, model = both_kinds(tmp_path, tie)
    assert is_sharded(sharded) and not is_sharded(whole)
    assert not (sharded / "model.safetensors").exists()
    a, b = load_model(sharded)[0], load_model(whole)[0]
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(0, model.config.vocab_size, (3, 20), generator=gen)
    for routing in ("topk", "causal"):
        want = model(x, routing=routing).logits
        assert torch.equal(a(x, routing=routing).logits, want)
        assert torch.equal(b(x, routing=routing).logits, want)
    assert (a.lm_head.weight is a.embed.weight) == tie
    keys = set()
    for f in (sharded / "shards").glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            keys |= set(st.keys())
    assert ("model.lm_head.weight" in keys) != tie  # a tied weight is stored once
    want_opt = load_optimizer_state(whole)
    assert 0 < len(want_opt["state"]) < len(list(model.parameters()))  # routers have none
    assert_same_optimizer(load_optimizer_state(sharded), want_opt)
    # Consolidated, it is the single-file checkpoint, tensor for tensor.
    out = consolidate_checkpoint(sharded, tmp_path / "consolidated")
    assert not is_sharded(out)
    c = load_model(out)[0].state_dict()
    assert all(torch.equal(v, c[k]) for k, v in b.state_dict().items())
    assert_same_optimizer(load_optimizer_state(out), want_opt)
    assert (out / "tokenizer.json").read_bytes() == (whole / "tokenizer.json").read_bytes()


def test_a_run_with_sharded_checkpoints_resumes_bit_exact(corpus: Path, tmp_path: Path):
    """One process, --checkpoint-format sharded: a run stopped after its step-3 checkpoint and
    resumed gives the uninterrupted run's losses and weights, bit for bit."""
    cfg = MoDConfig(**TINY)
    full = tmp_path / "full"
    train(cfg, tc(corpus, full, checkpoint_format="sharded"), progress=False)
    assert is_sharded(full / "checkpoint")
    first = tmp_path / "first"
    stopped = tc(corpus, first, checkpoint_format="sharded")
    train_until(cfg, stopped, stop_at=3, saver="save_sharded_checkpoint")
    train(None, stopped, resume=True, progress=False)
    assert losses(first) == losses(full)
    a, b = load_model(full / "checkpoint")[0], load_model(first / "checkpoint")[0]
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())


def test_non_finite_weights_are_not_written_and_the_last_checkpoint_stays(tmp_path: Path):
    cfg, model, opt = trained(True)
    d = save_sharded_checkpoint(tmp_path / "ck", model, opt, cfg, DistEnv(), trainer_state={})
    before = sorted((p.name, p.stat().st_size) for p in (d / "shards").iterdir())
    with torch.no_grad():
        model.blocks[0].mlp.w2.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinity.*blocks.0.mlp.w2.weight"):
        save_sharded_checkpoint(d, model, opt, cfg, DistEnv(), trainer_state={})
    assert sorted((p.name, p.stat().st_size) for p in (d / "shards").iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]
    load_model(d)


def test_damaged_or_lost_shards_are_named_and_never_unpickled(tmp_path: Path):
    cfg, model, opt = trained(True)
    d = save_sharded_checkpoint(tmp_path / "ck", model, opt, cfg, DistEnv(), trainer_state={})
    shard = next((d / "shards").glob("*.safetensors"))
    good = shard.read_bytes()
    marker = tmp_path / "unpickled"

    class Payload:
        def __reduce__(self):  # noqa: ANN204
            return (marker.write_text, ("ran",))

    evil = pickle.dumps(Payload())
    # The same size as the shard it replaces: past the index of files, into the reader.
    for bad in (evil + b" " * (len(good) - len(evil)), b"\0" * len(good)):
        shard.write_bytes(bad)
        with pytest.raises(CheckpointError, match=r"ck/shards.*do not load"):
            load_model(d)
        assert not marker.exists()
    # Cut short, lost, or a stray file: the index of shard files says so before any is read.
    for damage in ("truncate", "unlink", "extra"):
        shard.write_bytes(good)
        if damage == "truncate":
            shard.write_bytes(good[: len(good) // 2])
        elif damage == "unlink":
            shard.unlink()
        else:
            (d / "shards" / "stray.safetensors").write_bytes(good)
        with pytest.raises(CheckpointError, match=r"not those shards.json lists"):
            load_model(d)
    (d / "shards" / "stray.safetensors").unlink()
    load_model(d)  # whole again


def test_consolidate_refuses_what_it_cannot_do(tmp_path: Path, capsys):
    sharded, whole, _ = both_kinds(tmp_path, True)
    assert main(["consolidate", str(whole), str(tmp_path / "x")]) == 2
    assert "already a single-file checkpoint" in capsys.readouterr().err
    assert main(["consolidate", str(sharded), str(whole)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert main(["consolidate", str(sharded), str(sharded)]) == 2
    assert "another folder" in capsys.readouterr().err
    assert main(["consolidate", str(tmp_path / "nothing"), str(tmp_path / "y")]) == 2
    assert "no checkpoint at" in capsys.readouterr().err
    assert main(["consolidate", str(sharded), str(tmp_path / "ok")]) == 0
    assert "single-file checkpoint of" in capsys.readouterr().out
