"""Bad input is a clear error that names the value and what is allowed, at the command line and
at the Python API, before anything is created; and the checks that guard a run's numbers (the
divergence watch, seeds, a CUDA device that is not there)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY, tc

from mixture_of_depths import MoDConfig, MoDTransformer, generate
from mixture_of_depths.cli import main
from mixture_of_depths.train import TrainConfig, train


# -- clear errors for bad values ------------------------------------------------------------------
@pytest.mark.parametrize(
    "flag,value,field",
    [
        ("--rope-theta", "nan", "rope_theta"),
        ("--norm-eps", "nan", "norm_eps"),
        ("--aux-loss-weight", "inf", "aux_loss_weight"),
        ("--ff-mult", "inf", "ff_mult"),
        ("--init-std", "-0.02", "init_std"),
        ("--capacity", "nan", "capacity"),
        ("--grad-clip", "nan", "grad_clip"),
        ("--weight-decay", "-1", "weight_decay"),
        ("--lr", "inf", "lr"),
        ("--beta2", "1", "beta2"),
        ("--min-lr-ratio", "nan", "min_lr_ratio"),
        ("--steps", "0", "steps"),
        ("--warmup-steps", "-1", "warmup_steps"),
    ],
)
def test_bad_numbers_are_clear_errors(tmp_path, capsys, flag, value, field):
    out = tmp_path / "run"
    assert main(["train", flag, value, "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mod train: error: {field} must be ") and value.lstrip("-") in err, err
    assert not out.exists()


def test_configs_check_every_number_in_one_place():
    """Any numeric field given NaN, infinity or a string is refused by name, before use."""
    import dataclasses

    for cls, base in ((MoDConfig, {}), (TrainConfig, {})):
        for f in dataclasses.fields(cls):
            name = f.name.removeprefix("_")  # MoDConfig's d_ff, given as _d_ff, read resolved
            default = getattr(cls(**base), name)
            if isinstance(default, bool) or not isinstance(default, int | float):
                continue
            for bad in (float("nan"), float("inf"), "3"):
                with pytest.raises(ValueError, match=f"^{name} must be "):
                    cls(**{**base, name: bad})


def test_cli_zero_is_not_the_default(finished_run, capsys):
    _, out = finished_run
    ck = str(out / "checkpoint")
    for args, field in (
        (["eval", ck, "--batches", "0"], "--batches"),
        (["eval", ck, "--batch-size", "0"], "--batch-size"),
        (["calibrate", ck, "--out", str(out / "cal"), "--batches", "0"], "--batches"),
        (["flops", "--seq-len", "0"], "--seq-len"),
        (["flops", "--batch-size", "0"], "--batch-size"),
        (["generate", ck, "--prompt", "x", "--top-k", "0"], "top_k"),
        (["generate", ck, "--prompt", "x", "--temperature", "nan"], "temperature"),
    ):
        assert main(args) == 2, args
        assert f"error: {field}" in capsys.readouterr().err, args


def test_bad_places_are_clear_errors(corpus, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert main(["train", "--out", str(a_file), "--data", str(corpus), "--no-progress"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path / "nothing"), "--resume"]) == 2
    assert "there is no run in" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path / "r"), "--device", "tpu9", "--steps", "1"]) == 2
    assert "device 'tpu9'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()  # refused before anything was created


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_device_cuda_without_cuda_is_a_clear_error(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "r"), "--device", "cuda", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "device 'cuda'" in err and "--device cpu" in err


# -- token ids at the Python API ------------------------------------------------------------------
def test_one_id_check_for_forward_and_generate():
    torch.manual_seed(0)
    cfg = MoDConfig(**TINY, vocab_size=50)
    model = MoDTransformer(cfg).eval()
    for prompts in ([[1.5, 2.7]], [[True, False]], torch.tensor([[1.0, 2.0]])):
        with pytest.raises(ValueError, match="integer token ids"):
            generate(model, prompts, max_new_tokens=1)
    with pytest.raises(ValueError, match="integer token ids"):
        model(torch.tensor([[True, False]]))
    with pytest.raises(ValueError, match="id 50 out of range"):
        generate(model, [[1, 50]], max_new_tokens=1)
    with pytest.raises(ValueError, match="id 50 out of range"):
        model(torch.tensor([[1, 50]]))
    ids = torch.tensor([[3, 7, 11, 2]])
    want = model(ids).logits
    assert torch.equal(model(ids.to(torch.uint8)).logits, want)  # widened, not an embedding error
    assert torch.equal(model(ids.to(torch.int32)).logits, want)
    a = generate(model, ids.to(torch.uint8), max_new_tokens=3, temperature=0).tokens
    assert a == generate(model, ids.tolist(), max_new_tokens=3, temperature=0).tokens


def test_targets_are_checked():
    cfg = MoDConfig(**TINY, vocab_size=50)
    model = MoDTransformer(cfg)
    ids = torch.tensor([[3, 7, 11, 2]])
    with pytest.raises(ValueError, match="targets has id 50 out of range"):
        model(ids, torch.tensor([[1, 2, 3, 50]]))
    with pytest.raises(ValueError, match="targets has id -5 out of range"):
        model(ids, torch.tensor([[1, 2, 3, -5]]))
    with pytest.raises(ValueError, match="every target is -100"):
        model(ids, torch.full_like(ids, -100))
    with pytest.raises(ValueError, match="integer token ids"):
        model(ids, ids.float())
    assert torch.equal(model(ids, ids.to(torch.int32)).loss, model(ids, ids).loss)  # widened
    # -100 ignores a position: the loss equals the mean over the others.
    t = torch.tensor([[7, 11, -100, 4]])
    out = model(ids, t)
    per_token = F.cross_entropy(out.logits[0], t[0].clamp(min=0), reduction="none")
    assert torch.allclose(out.lm_loss, per_token[[0, 1, 3]].mean())


def test_the_watch_sees_the_predictor_gradient_too():
    from mixture_of_depths.train.state import FiniteWatch

    watch = FiniteWatch.on(torch.device("cpu"))
    one = torch.tensor(1.0)
    watch.record(1, one, one, one)
    assert int(watch.bad_step) == 0
    watch.record(2, one, one, one * float("inf"))  # only the predictor's norm
    watch.record(3, one * float("nan"), one, one)  # the first bad step is kept
    assert int(watch.bad_step) == 2 and watch.bad_values.tolist() == [1.0, 1.0, float("inf")]


def test_seeds_keep_their_whole_range():
    for seed in (-1, 0, 2**63, 2**64 - 1):
        assert TrainConfig(seed=seed).seed == seed
    with pytest.raises(ValueError, match="seed must be an integer"):
        TrainConfig(seed=1.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_training_on_cuda_checks_and_saves_its_checkpoints(corpus, tmp_path):
    """Weights on the GPU, AdamW step counts on the CPU: the finiteness check handles both."""
    summary = train(MoDConfig(**TINY), tc(corpus, tmp_path / "r", device="cuda"), progress=False)
    assert summary["steps"] == 6 and (tmp_path / "r" / "checkpoint" / "model.safetensors").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_divergence_watch_has_no_host_sync_cuda(corpus, tmp_path):
    from mixture_of_depths.train.setup import start

    run = start(MoDConfig(**TINY), tc(corpus, tmp_path / "r", device="cuda"), False, False)
    loss = torch.tensor(1.0, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run.watch.record(1, loss, loss * float("nan"), loss)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(run.watch.bad_step) == 1
