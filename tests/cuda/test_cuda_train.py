"""A training run, its evaluation, experts and the Hugging Face model on CUDA (`pytest -m
cuda`; these repeat default CPU tests, so they run on CUDA alone). Oracles: the checkpoint
re-evaluated equals the run's last evaluation (the path where a CPU tensor met the router's
CUDA scores and every MoD run crashed at its first evaluation), the expert loop, our own
generation."""

from __future__ import annotations

import json

import pytest
import torch
from devices import CUDA_ONLY, MODES, moved
from helpers import TINY, make_model, tc, tiny_config, write_corpus
from test_experts import expert_layer, reference

from mixture_of_depths import MoDConfig, generate
from mixture_of_depths.train import evaluate_checkpoint, train

TRAIN_MODES = ["joint-pred", "stag-aux", "mlp-pred", "residual"]


@pytest.mark.parametrize("device", CUDA_ONLY)
@pytest.mark.parametrize("kw", [*(MODES[m] for m in TRAIN_MODES), dict(layer_pattern="D"),
                                dict(n_experts=4, layer_pattern="R")], ids=[*TRAIN_MODES, "dense",
                                                                            "moe"])  # fmt: skip
def test_a_run_on_the_device_trains_evaluates_and_re_evaluates_to_its_numbers(
    device, kw, tmp_path, monkeypatch
):
    monkeypatch.setenv("MOD_CACHE_DIR", str(tmp_path / "cache"))
    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    summary = train(MoDConfig(**{**TINY, **kw}), tc(corpus, out, device=device), progress=False)
    assert all(torch.isfinite(torch.tensor(v)) for v in (summary["val_loss_topk"],
                                                         summary["val_loss_causal"]))  # fmt: skip
    rows = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    assert (
        any("routing_diag" in r for r in rows) or "R" not in MoDConfig(**{**TINY, **kw}).layer_kinds
    )
    again = evaluate_checkpoint(out / "checkpoint", data=str(corpus), device=device)
    for key in ("val_loss_topk", "val_loss_causal"):
        assert again[key] == pytest.approx(summary[key], rel=1e-4, abs=1e-5), key


@pytest.mark.parametrize("device", CUDA_ONLY)
@pytest.mark.parametrize("kw", [dict(n_experts=4, experts_per_token=2),
                                dict(n_experts=3, n_noop_experts=2)])  # fmt: skip
def test_the_expert_layer_on_the_device_equals_the_loop(device, kw):
    layer = expert_layer(**kw)
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y, _ = moved(layer, device, torch.float64)(x.to(device), drop=False)
    torch.testing.assert_close(y.cpu(), reference(layer, x, False), rtol=1e-10, atol=1e-10)


@pytest.mark.hf
@pytest.mark.parametrize("device", CUDA_ONLY)
@pytest.mark.parametrize("router", ["aux_loss", "predictor"])
def test_greedy_generate_through_transformers_on_the_device_equals_ours(device, router):
    pytest.importorskip("transformers", minversion="5")
    from mixture_of_depths.hf import MoDForCausalLM

    model = moved(make_model(tiny_config(causal_router=router)).eval(), device, torch.float64)
    hf = MoDForCausalLM.from_mod(model, pad_token_id=0)
    prompts = [[5, 7, 9, 11, 3, 4, 12], [1, 2], [8, 8, 8, 30]]
    ours = generate(model, prompts, max_new_tokens=8, temperature=0).tokens
    P = max(map(len, prompts))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts], device=device)
    got = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8)
    assert got[:, P:].tolist() == ours
