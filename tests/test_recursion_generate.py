"""MoR generation with the KV cache against full recomputation (`generate_reference`), for both
`recursion_kv` strategies and both routers, batched rows that recurse differently; a decode step
against FlopCounterMode; training, a checkpoint round trip and `mod generate` on a MoR run.
float64 where a comparison ends in a hard decision (docs/semantics.md, "Numerics and tests")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from generate_helpers import TOL64, assert_same_generation, make_prompts
from helpers import TINY, losses, make_model, random_tokens, tc
from recursion_helpers import CASES, IDS, mor_config
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mixture_of_depths import MoDConfig
from mixture_of_depths.cache import KVCache
from mixture_of_depths.cli import main
from mixture_of_depths.flops import estimate_flops
from mixture_of_depths.generate import decode_step, generate, generate_reference, prefill
from mixture_of_depths.runtime.checkpoint import load_model
from mixture_of_depths.train import train

N_NEW = 10


@pytest.mark.parametrize("over", CASES, ids=IDS)
def test_cached_greedy_equals_full_recomputation_and_rows_recurse_differently(over):
    model = make_model(mor_config(**over))
    prompts = make_prompts((5, 11, 8), seed=3)
    got = generate(model, prompts, N_NEW, temperature=0, return_logits=True, return_routing=True)
    exp = generate_reference(model, prompts, N_NEW)
    assert_same_generation(got, exp)
    assert got.router_names == model.route_names()
    decoded = torch.stack([r[len(p) :] for r, p in zip(got.routing, prompts, strict=True)])
    # in the decoded tokens some go on and some stop at each step, and rows differ
    assert decoded.any((0, 1)).all() and (~decoded).any((0, 1)).all()
    assert not all(torch.equal(decoded[0], decoded[b]) for b in range(1, len(prompts)))


@pytest.mark.parametrize("over", [CASES[1], CASES[3]], ids=["expert-share", "token"])
def test_a_batch_decodes_as_each_prompt_alone(over):
    model = make_model(mor_config(**over))
    prompts = make_prompts((9, 3, 14), seed=2)
    kw = dict(temperature=0, return_logits=True, return_routing=True)
    batch = generate(model, prompts, N_NEW, **kw)
    for b, p in enumerate(prompts):
        alone = generate(model, [p], N_NEW, **kw)
        assert batch.tokens[b] == alone.tokens[0]
        torch.testing.assert_close(batch.logits[b], alone.logits[0], **TOL64)
        assert torch.equal(batch.routing[b], alone.routing[0])


@pytest.mark.parametrize("kv", ["recursion", "share"])
def test_a_decode_step_that_takes_every_step_equals_flop_counter(kv):
    cfg = mor_config(recursion_kv=kv, causal_router="predictor")
    model = make_model(cfg)
    with torch.no_grad():  # every token takes every step: the decode estimate at take 1
        for pred in model.recursion.predictor.values():
            pred.fc2.weight.zero_()
            pred.fc2.bias.fill_(5.0)
    B, T = 2, 12
    cache = KVCache(cfg, B, T + 1, dtype=torch.float64)
    prefill(model, random_tokens(B, T, seed=1), torch.full((B,), T), cache)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        _, routing = decode_step(model, torch.tensor([3, 4]), cache)
    assert routing.all()
    est = estimate_flops(cfg, T, take_rate=1.0, decode_context=T + 1).decode_per_token
    assert est * B == pytest.approx(fc.get_total_flops(), rel=0.01)


@pytest.mark.parametrize("router", ["expert", "token"])
def test_mor_trains_saves_loads_and_generates_through_the_commands(
    corpus, tmp_path: Path, capsys, router
):
    cfg = MoDConfig(
        **{**TINY, "n_layers": 3}, layer_pattern="D", recursions=3, recursion_kv="share",
        recursion_router=router,
    )  # fmt: skip
    out = tmp_path / "run"
    train(cfg, tc(corpus, out, steps=4, eval_every=4), progress=False)
    seen = losses(out)
    assert len(seen) == 4 and all(v == v for v in seen.values())
    model, loaded = load_model(out / "checkpoint")
    assert loaded == cfg
    idx = random_tokens(2, 16, seed=1) % cfg.vocab_size
    for routing in ("topk", "causal"):
        assert model(idx, routing=routing).routes[0].kind == "recursion"
    main(["generate", str(out / "checkpoint"), "--prompt", "def ",
          "--max-new-tokens", "5", "--show-routing"])  # fmt: skip
    shown = capsys.readouterr().out
    assert ("step capacities 50.0%, 25.0%" if router == "expert" else "balanced depths") in shown
