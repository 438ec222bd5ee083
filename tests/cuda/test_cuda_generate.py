"""Generation on every device, the static-buffer decode step (static_cache.py) against the
`KVCache` decode, and the host syncs of a training step and a decode step, counted on a CPU as
a GPU would have them (tests/cuda/syncs.py; docs/bench.md, "The audit")."""

from __future__ import annotations

import pytest
import torch
from devices import CUDA_ONLY, MODES, moved, on_cuda
from generate_helpers import make_model, make_prompts, served_and_reference
from helpers import make_model as make_tiny
from helpers import random_tokens, tiny_config
from syncs import SyncCounter

from mixture_of_depths import generate
from mixture_of_depths.generate import generate_reference
from mixture_of_depths.serve.engine import Engine
from mixture_of_depths.serve.paged import PagedKVCache
from mixture_of_depths.static_cache import StaticDecoder, StaticKVCache, static_generate

F64 = torch.float64
MOR = dict(layer_pattern="D", recursions=3, recursion_capacities=(0.5, 0.3))
GEN_MODES = ["joint-aux", "joint-pred", "stag-aux", "stag-pred", "mlp-pred", "mlp-kv-pred",
             "residual"]  # fmt: skip


def _model(mode: str, device: str, seed: int = 0):  # noqa: ANN202
    over = MOR if mode == "mor" else MODES[mode]
    return moved(make_model(seed=seed, dtype=F64, **over), device, F64)


@pytest.mark.parametrize("device", CUDA_ONLY)
@pytest.mark.parametrize("mode", [*GEN_MODES, "stag-residual"])
def test_cached_greedy_equals_recomputing_the_causal_forward(device, mode):
    """Cached generation on the device equals the no-cache reference, token for token, with
    the same routing (float64: no argmax or threshold flips on round-off)."""
    model = _model(mode, device)
    got = generate(model, make_prompts(), 10, temperature=0, return_routing=True)
    want = generate_reference(model, make_prompts(), 10)
    assert got.tokens == want.tokens
    for a, b in zip(got.routing, want.routing, strict=True):
        assert torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("device", CUDA_ONLY)
@pytest.mark.parametrize("mode", ["joint-pred", "stag-aux", "mlp-pred", "residual"])
def test_a_batch_decodes_as_each_prompt_alone(device, mode):
    model = _model(mode, device)
    prompts = make_prompts()
    batch = generate(model, prompts, 10, temperature=0).tokens
    alone = [generate(model, [p], 10, temperature=0).tokens[0] for p in prompts]
    assert batch == alone


@pytest.mark.parametrize("mode", [*GEN_MODES, "stag-residual"])
def test_static_decode_equals_the_kv_cache_decode(device, mode):
    """Masks and a trash slot instead of a host-side choice of rows: the same greedy tokens as
    `generate` with a `KVCache` (float64), prompts of unequal lengths."""
    model = _model(mode, device)
    want = generate(model, make_prompts(), 12, temperature=0).tokens
    assert static_generate(model, make_prompts(), 12, headroom=4.0) == want


@pytest.mark.parametrize("device", CUDA_ONLY)
@pytest.mark.parametrize("mode", ["joint-pred", "mlp-kv-pred", "residual", "mor"])
def test_the_server_steps_through_the_static_decode_step_on_cuda(device, mode):
    """On CUDA the engine decodes through the static step by default, captured as one CUDA
    graph (static_cache.static_step); its greedy completions equal the no-cache reference's.
    MOD_TEST_CUDA_ON_CPU runs the same path, eager, on the CPU."""
    model = _model(mode, device)
    assert Engine(model, None, max_rows=2, device=device).static == on_cuda(device)
    static = None if on_cuda(device) else True  # None: the engine's default
    got, want = served_and_reference(model, device=device, static_decode=static)
    assert got == want


def test_a_static_layer_that_overflows_is_an_error_not_a_wrong_token(device):
    """At take-rate 0.5 a routed layer fills more than its 16 static slots in 40 steps: the run
    says so (a prefill that does not fit is refused before any step)."""
    model = _model("joint-pred", device)
    with pytest.raises(RuntimeError, match="static slots"):
        static_generate(model, [[1, 2, 3], [4, 5, 6]], 40, headroom=0.1)
    with pytest.raises(ValueError, match="static slots"):
        static_generate(model, [list(range(50))], 2, headroom=0.1)


@pytest.mark.parametrize("paged", [False, True], ids=["static-cache", "paged"])
@pytest.mark.parametrize("mode", ["stag-pred", "mlp-kv-pred", "mor"])
def test_static_decode_step_reads_nothing_on_the_host(device, mode, paged):
    """No sync in a static decode step (the eager one reads each routed decision), over a
    `StaticKVCache` or over the server's paged cache (its static view, two row slots)."""
    model = _model(mode, device)
    if paged:
        pages = PagedKVCache(model.config, 64, 4, device, F64, static_rows=2)
        for row in (5, 9):
            pages.add_row(row)
        pages.static_step([5, 9], [0, 0], [3, 4])
        cache = pages.static
    else:
        cache = StaticKVCache(model.config, 2, 40, device, F64, headroom=4.0)
    step = StaticDecoder(model, cache)
    toks = torch.tensor([3, 4], device=device)
    with torch.no_grad(), SyncCounter(model, cache, toks) as c:
        for _ in range(3):
            toks = step(toks)[0].argmax(-1)
    assert c.total == 0, c.where
    if on_cuda(device):  # the real thing: any sync raises
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.no_grad():
                step(toks)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.slow  # torch.compile takes ~50 s on 2 busy cores
@pytest.mark.parametrize("mode", ["joint-pred", "stag-aux", "mlp-kv-pred"])
def test_the_compiled_static_step_has_no_graph_break_and_equals_eager(device, mode):
    """fullgraph=True fails on any graph break; on CUDA the step is captured (reduce-overhead)."""
    if device == "cpu:0":  # MOD_TEST_CUDA_ON_CPU
        pytest.skip("cpu:0 and cpu are one device to eager torch, two to the compiler")
    model = _model(mode, device)
    prompts = make_prompts()
    total = max(map(len, prompts)) + 8
    cache = StaticKVCache(model.config, len(prompts), total, device, F64, headroom=4.0)
    mode_ = "reduce-overhead" if on_cuda(device) else "default"
    step = torch.compile(StaticDecoder(model, cache), mode=mode_, fullgraph=True)
    want = generate(model, prompts, 8, temperature=0).tokens
    assert static_generate(model, prompts, 8, step=step) == want


# -- host syncs, counted ----------------------------------------------------------------------
# Every read of a device value on the host, by the function that reads it, with its reason.
# A new one in the hot path changes these counts: say why in docs/bench.md, then here.
CPU_ONLY_CHECKS = {  # the id checks' CPU branch; on a device they are torch._assert_async
    "__bool__ at checks.py:check_id_range": 2,
    "__bool__ at checks.py:check_targets": 1,
}


@pytest.mark.parametrize("kw", [{}, dict(routing="staggered", causal_router="aux_loss"),
                                dict(skipped_kv="residual"), dict(layer_pattern="D"),
                                dict(routing="mlp_kv")])  # fmt: skip
def test_a_training_step_reads_nothing_on_the_host(kw):
    """Forward (top-k), backward, clipping and AdamW: no sync on a device, after the first
    AdamW step (which reads its step counters once)."""
    model = make_tiny(tiny_config(**kw), dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx, y = random_tokens(2, 32, 0), random_tokens(2, 32, 1)
    for _ in range(2):  # the second step: AdamW reads its step counters on the first
        with SyncCounter(model, idx, y) as c:
            model(idx, y, routing="topk").loss.backward()
            c.mark_grads(model)
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
            opt.step()
            opt.zero_grad()
    assert dict(c.where) == CPU_ONLY_CHECKS
    assert c.uploads == 0


@pytest.mark.parametrize("routing", ["joint", "staggered", "mlp_kv"])
def test_an_eager_decode_step_reads_each_routed_decision_and_the_sampled_tokens(routing):
    """Per decode step of `generate`: one read per router (which rows take the block), one for
    the sampled tokens (the loop keeps them on the host), and the id check's CPU branch."""
    model = make_tiny(tiny_config(routing=routing), dtype=torch.float32)
    counts = []
    for n_new in (3, 5):
        with SyncCounter(model) as c:
            generate(model, [[1, 2, 3, 4], [5, 6, 7]], n_new, temperature=0)
        counts.append(c.where)
    per_step = {k: (counts[1][k] - counts[0][k]) / 2 for k in counts[1]}
    routers = len(model.config.routed_layers) * (2 if routing == "staggered" else 1)
    assert {k: v for k, v in per_step.items() if v} == {
        "cpu at selection.py:choose": routers,
        "cpu at generate.py:steps": 1,
        "__bool__ at checks.py:check_id_range": 1,
    }
