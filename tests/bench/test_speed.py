"""Speed-path properties: compiled equals eager, the packed attention takes SDPA's causal path
with no mask tensor, no host sync in forward, and the benchmark suite runs end to end.

Speed itself is measured by `mod bench`, never asserted here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mixture_of_depths import MoDConfig, MoDTransformer

ROOT = Path(__file__).resolve().parents[2]


def small_config(**over) -> MoDConfig:
    base = dict(
        vocab_size=61, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=64,
        layer_pattern="DR", capacity=0.25, predictor_hidden=8,
    )  # fmt: skip
    return MoDConfig(**{**base, **over})


@pytest.mark.slow
def test_compiled_fullgraph_equals_eager():
    """The top-k model compiles as one graph (no breaks: no host sync, no data-dependent Python)
    and the compiled forward and gradients equal eager ones."""
    cfg = small_config(routing="staggered", causal_router="predictor", layer_pattern="RDR")
    torch.manual_seed(0)
    model = MoDTransformer(cfg)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (2, 24), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (2, 24), generator=gen)

    eager = model(idx, targets)
    eager.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    out = compiled(idx, targets)
    out.loss.backward()
    torch.testing.assert_close(out.logits, eager.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, eager.loss, rtol=1e-5, atol=1e-6)
    # Routing is a hard decision on float32 router weights that compiled kernels round
    # differently (relative error ~1e-7): compare it only where the top-k boundary has a margin
    # far above that.
    k = cfg.capacity_tokens(idx.shape[1])
    for a, b in zip(out.routes, eager.routes, strict=True):
        ranked = b.logits.detach().sort(dim=1, descending=True).values
        margin = (ranked[:, k - 1] - ranked[:, k]).min() / ranked.abs().max()
        assert float(margin) > 1e-3  # precondition: 10^4 times the rounding
        assert torch.equal(a.mask, b.mask)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_packed_attention_uses_is_causal_without_mask(monkeypatch):
    """Top-k routing attends among the chosen tokens through SDPA's causal path (no (T, T) or
    (K, K) mask tensor), in dense and routed blocks alike; causal routing needs its mask."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append((q.shape[-2], attn_mask is None, is_causal))
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    cfg = small_config()
    model = MoDTransformer(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 32))
    model(idx)
    k = cfg.capacity_tokens(32)
    assert sorted(c[0] for c in calls) == sorted([32, k] * 2)  # DRDR: two dense, two routed
    assert all(no_mask and causal for _, no_mask, causal in calls)
    calls.clear()
    model(idx, routing="causal")
    assert any(not no_mask for _, no_mask, _ in calls)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_host_sync_in_forward_cuda():
    cfg = small_config()
    model = MoDTransformer(cfg).cuda()
    idx = torch.randint(0, cfg.vocab_size, (2, 32), device="cuda")
    model(idx, idx)  # warm-up (lazy init may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(idx, idx)
        out.loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_expert_layers_sync_once_each_cuda():
    """An expert layer's training forward reaches the host once (its slices' bounds)."""
    import warnings

    cfg = small_config(n_experts=4, expert_capacity_factor=0.5)
    model = MoDTransformer(cfg).cuda()
    idx = torch.randint(0, cfg.vocab_size, (2, 32), device="cuda")
    model(idx, idx)  # warm-up (lazy init, the grouped-matmul probe)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                model(idx, idx)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == cfg.n_layers, [str(w.message) for w in syncs]


def test_bench_suite_end_to_end():
    """`mod bench` on a tiny model: every section but compile (slow on a CPU; its equivalence is
    tested above) runs, the ratios are consistent, and the last line is JSON."""
    proc = subprocess.run(
        [
            sys.executable, "-m", "mixture_of_depths.cli", "bench", "--preset", "tiny",
            "--seq-lens", "48", "--tokens", "96", "--capacities", "1.0,0.25",
            "--repeats", "1", "--warmup", "0", "--sections", "train,block,memory,decode,experts",
            "--no-progress",
        ],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"train", "block", "memory", "decode", "bars"} <= set(res)
    train = res["train"]
    assert {(r["seq_len"], r["model"]) for r in train} == {
        (48, m) for m in ("dense", "c=1", "c=0.25")
    }
    for r in train:
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["speedup_flop_predicted"])
        if r["model"] == "dense":
            assert r["speedup"] == 1.0 and r["speedup_flop_predicted"] == 1.0
    # Activations saved for backward: a routed block at capacity 0.25 keeps fewer than a dense one.
    mem = {(r["seq_len"], r["model"]): r for r in res["memory"]}
    assert mem[48, "c=0.25"]["saved_bytes"] < mem[48, "dense"]["saved_bytes"]
    assert "## Training step" in proc.stdout and "## Training-step memory" in proc.stdout
    # Expert rows: each beside its FLOP prediction, from the share of slots that ran an expert.
    layers = {r["model"]: r for r in res["experts_layer"]}
    assert {"MLP", "MoE", "MoE drop 0.5", "MoE +no-ops"} <= set(layers)
    assert layers["MoE"]["expert_share"] == 1.0 and layers["MoE drop 0.5"]["expert_share"] <= 0.5
    assert (
        layers["MoE"]["speedup_flop_predicted"]
        < 1
        < layers["MoE drop 0.5"]["speedup_flop_predicted"]
    )  # the router costs a little; dropping half the slots saves about half the MLP
    models = {r["model"] for r in res["experts_model"]}
    assert models == {"dense", "MoE", "MoE drop 0.5", "staged MoDE", "integrated"}
    for r in res["experts_layer"] + res["experts_model"]:
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["speedup_flop_predicted"])


def test_bench_rejects_bad_flags():
    proc = subprocess.run(
        [sys.executable, "-m", "mixture_of_depths.cli", "bench", "--capacities", "0,0.5"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--capacities" in proc.stderr and "(0, 1]" in proc.stderr
