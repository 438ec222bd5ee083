"""Generation against oracles: the no-cache reference path, full recomputation, cache invariants.

No golden numbers. `generate_reference` recomputes the full causal forward at every step (the
slow path cached decoding must equal); the model's own full forward, tests/reference.py's loop
RoPE and counts read back from routing decisions are the other oracles.

Comparisons across code paths or batch shapes (cached against recomputed, batched against alone)
end in hard decisions (a routing threshold at 0, a greedy argmax), so they run in float64, where
round-off (~1e-15) is far below any decision margin; float32 rounding differs between matmul
shapes and could flip a decision that sits within ~1e-6 of its threshold on one CPU and not on
another. float32 is compared only against itself on the same path.
"""

from __future__ import annotations

import pytest
import torch
from generate_helpers import (
    F64,
    LENS,
    MAX_LEN,
    MODES,
    N_NEW,
    SOME_MODES,
    TOL64,
    assert_same_generation,
    causal_routes,
    make_model,
    make_prompts,
)
from helpers import V, random_tokens

from mixture_of_depths.config import ROUTE_KINDS
from mixture_of_depths.generate import (
    generate,
    generate_reference,
    sample_next,
    stream,
)

# -- cached greedy generation equals the no-cache reference --------------------------------------


@pytest.mark.parametrize("routing, causal_router", MODES)
def test_cached_greedy_equals_reference(routing, causal_router):
    model = make_model(routing=routing, causal_router=causal_router, dtype=F64)
    prompts = make_prompts()
    got = generate(model, prompts, N_NEW, temperature=0, return_logits=True, return_routing=True)
    exp = generate_reference(model, prompts, N_NEW)
    assert_same_generation(got, exp)
    n_routers = 3 * len(ROUTE_KINDS[routing])  # "RDR" on 4 layers: R D R R
    assert len(got.router_names) == n_routers
    for b, n in enumerate(LENS):
        assert got.routing[b].shape == (n + N_NEW, n_routers)
        assert len(got.tokens[b]) == N_NEW and got.logits[b].shape == (N_NEW, V)
    # Routing matters: in the decoded tokens (not only the prompt) some take and some skip each
    # routed (sub-)block.
    decoded = torch.cat([r[n:] for r, n in zip(got.routing, LENS, strict=True)])
    assert decoded.any(0).all() and (~decoded).any(0).all(), decoded.float().mean(0)


def test_dense_model_cached_equals_reference():
    model = make_model(layer_pattern="D", dtype=F64)
    prompts = make_prompts()
    got = generate(model, prompts, N_NEW, temperature=0, return_logits=True, return_routing=True)
    assert_same_generation(got, generate_reference(model, prompts, N_NEW))
    assert got.router_names == [] and got.routing[0].shape == (LENS[0] + N_NEW, 0)


@pytest.mark.parametrize("routing", ["joint", "staggered", "mlp", "mlp_kv"])
def test_float64_cached_logits_equal_full_recomputation(routing):
    """A float64 model decodes in float64: every step's logits equal the full causal forward's to
    1e-10 (read from `stream`, which hands out the logits in the model's dtype)."""
    model = make_model(routing=routing, dtype=torch.float64)
    prompts = make_prompts()
    seqs = [list(p) for p in prompts]
    steps = 0
    for st in stream(model, prompts, N_NEW, temperature=0):
        assert st.logits.dtype == torch.float64
        for i, (b, tok) in enumerate(zip(st.rows, st.tokens, strict=True)):
            with torch.no_grad():
                full = model(torch.tensor([seqs[b]]), routing="causal").logits[0, -1]
            torch.testing.assert_close(st.logits[i], full, **TOL64)
            assert tok == int(full.argmax())
            seqs[b].append(tok)
        steps += 1
    assert steps == N_NEW


@pytest.mark.parametrize("routing, causal_router", SOME_MODES)
def test_batch_equals_each_prompt_alone(routing, causal_router):
    model = make_model(routing=routing, causal_router=causal_router, dtype=F64)
    prompts = make_prompts((9, 3, 14, 6), seed=2)
    kw = dict(temperature=0, return_logits=True, return_routing=True)
    batch = generate(model, prompts, N_NEW, **kw)
    for b, p in enumerate(prompts):
        alone = generate(model, [p], N_NEW, **kw)
        assert batch.tokens[b] == alone.tokens[0], b
        torch.testing.assert_close(batch.logits[b], alone.logits[0], **TOL64)
        assert torch.equal(batch.routing[b], alone.routing[0]), b


def test_tensor_prompts_equal_list_prompts():
    model = make_model(routing="staggered")
    idx = random_tokens(3, 7, seed=4)
    kw = dict(temperature=0, return_logits=True, return_routing=True)
    a, b = generate(model, idx, N_NEW, **kw), generate(model, idx.tolist(), N_NEW, **kw)
    assert a.tokens == b.tokens
    assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(a.routing, b.routing, strict=True))
    sa = generate(model, idx, N_NEW, temperature=1.0, seed=5)
    sb = generate(model, idx.tolist(), N_NEW, temperature=1.0, seed=5)
    assert sa.tokens == sb.tokens


# -- EOS, stream, max_new_tokens=0 ----------------------------------------------------------------


def _pick_eos(tokens: list[list[int]], n_new: int) -> tuple[int, int]:
    """(row, token): a token that the greedy reference produces for one row, before its last step,
    and never for any other row; prefers an early row so that later rows shift in the batch."""
    for b, row in enumerate(tokens):
        others = {t for c, r in enumerate(tokens) if c != b for t in r}
        for t in row[: n_new - 2]:
            if t not in others:
                return b, t
    raise AssertionError(f"no token is unique to one row: {tokens}")


@pytest.mark.parametrize(
    "routing, skipped_kv",
    [("joint", "none"), ("staggered", "none"), ("staggered", "residual"), ("mlp", "none"),
     ("mlp_kv", "none")],
)  # fmt: skip
def test_eos_stops_one_row_while_others_go_on(routing, skipped_kv):
    model = make_model(routing=routing, causal_router="predictor", dtype=F64, skipped_kv=skipped_kv)
    prompts = make_prompts((6, 10, 4, 9), seed=3)
    free = generate_reference(model, prompts, N_NEW)
    row, eos = _pick_eos(free.tokens, N_NEW)
    got = generate(
        model, prompts, N_NEW, temperature=0, eos_id=eos, return_logits=True, return_routing=True
    )
    exp = generate_reference(model, prompts, N_NEW, eos_id=eos)
    assert_same_generation(got, exp)
    stop = free.tokens[row].index(eos)
    assert got.tokens[row] == free.tokens[row][: stop + 1]
    assert len(got.tokens[row]) < N_NEW and got.tokens[row][-1] == eos
    assert not got.routing[row][-1].any()  # the final EOS is never fed back
    for b in range(len(prompts)):
        if b != row:
            assert got.tokens[b] == free.tokens[b] and len(got.tokens[b]) == N_NEW
    # The same through `stream`: the stopped row leaves the batch, the others stay.
    seen = [[] for _ in prompts]
    for st in stream(model, prompts, N_NEW, temperature=0, eos_id=eos):
        for b, t in zip(st.rows, st.tokens, strict=True):
            seen[b].append(t)
    assert seen == got.tokens


@pytest.mark.parametrize("temperature, top_k, seed", [(0, None, None), (1.0, None, 3), (0.7, 5, 4)])
def test_stream_yields_the_tokens_of_generate(temperature, top_k, seed):
    model = make_model(routing="staggered", causal_router="predictor")
    prompts = make_prompts()
    kw = dict(temperature=temperature, top_k=top_k, seed=seed)
    out = generate(model, prompts, N_NEW, **kw)
    seen = [[] for _ in prompts]
    n_steps = 0
    for st in stream(model, prompts, N_NEW, **kw):
        assert st.logits.shape == (len(st.rows), V)
        for b, t in zip(st.rows, st.tokens, strict=True):
            seen[b].append(t)
        n_steps += 1
    assert seen == out.tokens and n_steps == N_NEW


def test_max_new_tokens_zero_returns_empty_lists():
    model = make_model(routing="staggered", dtype=F64)
    prompts = make_prompts()
    out = generate(model, prompts, 0, temperature=0, return_logits=True, return_routing=True)
    assert out.tokens == [[] for _ in prompts]
    assert [tuple(lg.shape) for lg in out.logits] == [(0, V)] * len(prompts)
    for b, p in enumerate(prompts):  # the prompt's own routing, as the full forward decides it
        assert torch.equal(out.routing[b], causal_routes(model, p))
    assert list(stream(model, prompts, 0)) == []
    assert generate(model, prompts, 0).tokens == [[] for _ in prompts]


# -- sampling -----------------------------------------------------------------------------------


def test_same_seed_same_sample_other_seed_differs():
    model = make_model(routing="joint", causal_router="predictor")
    prompts = make_prompts((4, 7))
    n = 40  # 80 sampled tokens: two seeds agreeing on all of them has negligible probability
    a = generate(model, prompts, n, temperature=1.0, seed=123, return_logits=True)
    b = generate(model, prompts, n, temperature=1.0, seed=123)
    c = generate(model, prompts, n, temperature=1.0, seed=124)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens
    # Precondition for the "differs" half: the distributions are far from one-hot.
    p_max = torch.cat(a.logits).softmax(-1).max(-1).values
    assert float(p_max.mean()) < 0.9
    # Sampling is not greedy decoding.
    greedy = generate(model, prompts, n, temperature=0)
    assert a.tokens != greedy.tokens


def test_seeded_sampling_equals_sampling_from_recomputed_logits():
    """One row, temperature 1, top_k 7: the cached path samples exactly what the same seeded
    generator samples from the full causal forward recomputed at every step."""
    model = make_model(routing="staggered", causal_router="aux_loss", dtype=F64)
    prompt = make_prompts((6,))[0]
    out = generate(model, [prompt], 20, temperature=1.0, top_k=7, seed=11)
    g = torch.Generator().manual_seed(11)
    seq = list(prompt)
    for _ in range(20):
        with torch.no_grad():
            logits = model(torch.tensor([seq]), routing="causal").logits[:, -1]
        seq.append(int(sample_next(logits, 1.0, 7, None, g)[0]))
    assert out.tokens[0] == seq[len(prompt) :]


def test_top_k_and_top_p_samples_stay_in_their_sets():
    model = make_model(routing="joint")
    prompts = make_prompts()
    out = generate(model, prompts, 30, temperature=1.0, top_k=3, seed=7, return_logits=True)
    for toks, lg in zip(out.tokens, out.logits, strict=True):
        top3 = lg.topk(3, -1).indices
        assert (top3 == torch.tensor(toks)[:, None]).any(-1).all()
    top_p = 0.6
    out = generate(model, prompts, 30, temperature=1.0, top_p=top_p, seed=8, return_logits=True)
    outside_top1 = 0
    for toks, lg in zip(out.tokens, out.logits, strict=True):
        probs, order = lg.softmax(-1).sort(-1, descending=True)
        rank = (order == torch.tensor(toks)[:, None]).float().argmax(-1)
        mass_before = (probs.cumsum(-1) - probs).gather(-1, rank[:, None])[:, 0]
        assert (mass_before < top_p + 1e-6).all()  # the nucleus: mass before it is below top_p
        outside_top1 += int((rank > 0).sum())
    assert outside_top1 > 0  # precondition: top_p really sampled, not only argmax


@pytest.mark.parametrize(
    "kw",
    [
        dict(top_k=1),
        dict(top_p=1e-6),
        dict(top_k=1, top_p=0.3),
        dict(temperature=1e-4),  # the softmax of logits / T tends to the argmax as T -> 0
    ],
)
def test_degenerate_sampling_equals_greedy(kw):
    model = make_model(routing="staggered", causal_router="predictor")
    prompts = make_prompts()
    greedy = generate(model, prompts, N_NEW, temperature=0, return_logits=True)
    # Precondition for the low temperature: the top two logits are far apart in units of T.
    top2 = torch.cat(greedy.logits).topk(2, -1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 30 * 1e-4
    kw = {"temperature": 1.0, **kw}
    for seed in (0, 1):
        assert generate(model, prompts, N_NEW, seed=seed, **kw).tokens == greedy.tokens


# -- argument checks ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompts, kw, needle",
    [
        ([[1, 2]], dict(temperature=-0.5), "temperature"),
        ([[1, 2]], dict(temperature=float("nan")), "temperature"),
        ([[1, 2]], dict(top_p=0.0), "top_p"),
        ([[1, 2]], dict(top_p=1.5), "top_p"),
        ([[1, 2]], dict(top_k=0), "top_k"),
        ([[1, 2]], dict(prefill="dense"), "dense"),
        ([[1, 2]], dict(max_new_tokens=-1), "max_new_tokens"),
        ([[1, 2], []], {}, "empty"),
        ([], {}, "empty"),
        ([[1, V, 2]], {}, str(V)),
        ([[-1, 2]], {}, "-1"),
        ([[3] * 60], dict(max_new_tokens=5), "max_seq_len"),
        ([[3] * 10, [3] * MAX_LEN], dict(max_new_tokens=1), "max_seq_len"),
    ],
)
def test_bad_arguments_raise_value_error(prompts, kw, needle):
    model = make_model()
    kw = {"max_new_tokens": 4, **kw}
    with pytest.raises(ValueError) as err:
        generate(model, prompts, **kw)
    assert needle in str(err.value)
    with pytest.raises(ValueError) as err:
        list(stream(model, prompts, **kw))
    assert needle in str(err.value)


def test_prompt_filling_max_seq_len_exactly_is_allowed():
    """prompt + max_new_tokens == max_seq_len works (and equals the reference); one more raises."""
    model = make_model(routing="staggered", dtype=F64)
    prompts = make_prompts((MAX_LEN - 6, 3))
    got = generate(model, prompts, 6, temperature=0, return_logits=True, return_routing=True)
    assert_same_generation(got, generate_reference(model, prompts, 6))
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, prompts, 7, temperature=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, torch.zeros(1, MAX_LEN + 1, dtype=torch.long), 0)
