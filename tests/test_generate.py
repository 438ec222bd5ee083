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
from helpers import V, force_routing, random_tokens, tiny_config
from helpers import make_model as _make_model
from reference import rotate

from mixture_of_depths import MoDConfig, MoDTransformer, capacity_tokens
from mixture_of_depths.cache import KVCache
from mixture_of_depths.generate import (
    Generation,
    decode_step,
    generate,
    generate_reference,
    prefill,
    router_names,
    sample_next,
    stream,
)

MAX_LEN = 64
LENS = (5, 11, 8)  # prompt lengths of the default batch: unequal, the longest not first
N_NEW = 12
TOL32 = dict(rtol=0.0, atol=1e-5)
TOL64 = dict(rtol=0.0, atol=1e-10)
F64 = torch.float64
MODES = [
    ("joint", "aux_loss"),
    ("joint", "predictor"),
    ("staggered", "aux_loss"),
    ("staggered", "predictor"),
]


# -- models and prompts -------------------------------------------------------------------------


def make_config(**overrides) -> MoDConfig:
    return tiny_config(**{"max_seq_len": MAX_LEN, "capacity": 0.25, **overrides})


def make_model(
    seed: int = 0, dtype: torch.dtype = torch.float32, take: float = 0.5, **overrides
) -> MoDTransformer:
    return _make_model(make_config(**overrides), seed, dtype, take)


def make_prompts(lens=LENS, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]


def pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.tensor([len(p) for p in prompts])
    idx = torch.zeros(len(prompts), int(lens.max()), dtype=torch.long)
    for b, p in enumerate(prompts):
        idx[b, : len(p)] = torch.tensor(p)
    return idx, lens


def attn_router_column(model: MoDTransformer, layer: int) -> int:
    """Index, in the routing decisions, of the router whose choice fills layer `layer`'s cache."""
    name = str(layer) if model.config.routing == "joint" else f"{layer}.attn"
    return router_names(model).index(name)


@torch.no_grad()
def causal_routes(model: MoDTransformer, seq: list[int]) -> torch.Tensor:
    """(len(seq), n_routers) bool: the full causal forward's decisions for one sequence."""
    routes = model(torch.tensor([seq]), routing="causal").routes
    if not routes:
        return torch.zeros(len(seq), 0, dtype=torch.bool)
    return torch.stack([r.mask[0] for r in routes], -1)


def unrotated_keys_and_values(
    model: MoDTransformer, seq: list[int]
) -> tuple[dict[tuple[int, str], torch.Tensor], torch.Tensor]:
    """The full causal forward on one sequence: {(layer, "k" or "v"): (T, n_kv_heads, head_dim)}
    read off the k/v rows of `wqkv` (keys before RoPE), and the routing decisions (T, n_routers)."""
    cfg = model.config
    raw: dict[tuple[int, str], torch.Tensor] = {}

    nq, nkv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim

    def recorder(layer: int):  # noqa: ANN202
        def hook(module, args, out):  # noqa: ANN001, ANN202
            assert (layer, "k") not in raw  # one attention call per block and forward
            qkv = out[0].detach().double()  # the fused projection: rows q, then k, then v
            raw[(layer, "k")] = qkv[:, nq : nq + nkv].reshape(-1, cfg.n_kv_heads, cfg.head_dim)
            raw[(layer, "v")] = qkv[:, nq + nkv :].reshape(-1, cfg.n_kv_heads, cfg.head_dim)

        return hook

    handles = [
        block.attn.wqkv.register_forward_hook(recorder(block.layer)) for block in model.blocks
    ]
    try:
        routes = causal_routes(model, seq)
    finally:
        for h in handles:
            h.remove()
    return raw, routes


class HandDecoder:
    """prefill + decode_step driven by hand (greedy, every row fed every step), cache exposed."""

    def __init__(
        self, model: MoDTransformer, prompts: list[list[int]], n_new: int, grow: bool = False
    ) -> None:
        cfg = model.config
        self.model = model
        self.idx, self.lens = pad(prompts)
        total = int(self.lens.max()) + n_new
        dtype = next(model.parameters()).dtype
        self.cache = KVCache(cfg, len(prompts), total, dtype=dtype, grow=grow)
        self.rows = torch.arange(len(prompts))
        self.seqs = [list(p) for p in prompts]

    def prefill(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.logits, routing = prefill(self.model, self.idx, self.lens, self.cache)
        return self.logits, routing

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed each row its greedy token; returns the new logits and routing decisions."""
        tokens = self.logits.argmax(-1)
        for b, t in enumerate(tokens.tolist()):
            self.seqs[b].append(t)
        self.logits, routing = decode_step(self.model, tokens, self.rows, self.cache)
        return self.logits, routing


def assert_same_generation(got, exp, logits_tol=TOL64) -> None:  # noqa: ANN001
    assert got.tokens == exp.tokens
    assert got.router_names == exp.router_names
    for b, (lg, le) in enumerate(zip(got.logits, exp.logits, strict=True)):
        assert lg.shape == le.shape, b
        torch.testing.assert_close(lg, le, **logits_tol)
    for b, (rg, re) in enumerate(zip(got.routing, exp.routing, strict=True)):
        assert torch.equal(rg, re), b


# -- cached greedy generation equals the no-cache reference --------------------------------------


@pytest.mark.parametrize("routing, causal_router", MODES)
def test_cached_greedy_equals_reference(routing, causal_router):
    model = make_model(routing=routing, causal_router=causal_router, dtype=F64)
    prompts = make_prompts()
    got = generate(model, prompts, N_NEW, temperature=0, return_logits=True, return_routing=True)
    exp = generate_reference(model, prompts, N_NEW)
    assert_same_generation(got, exp)
    n_routers = 3 * (1 if routing == "joint" else 2)  # "RDR" on 4 layers: R D R R
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


@pytest.mark.parametrize("routing", ["joint", "staggered"])
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


@pytest.mark.parametrize("routing, causal_router", MODES[::3])
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
    "routing, skipped_kv", [("joint", "none"), ("staggered", "none"), ("staggered", "residual")]
)
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


# -- the KV cache -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("routing, causal_router", MODES[::3])
def test_cache_lengths_count_the_tokens_that_took_each_layer(routing, causal_router, dtype):
    model = make_model(routing=routing, causal_router=causal_router, dtype=dtype)
    cfg = model.config
    prompts = make_prompts()
    dec = HandDecoder(model, prompts, N_NEW)
    _, routing_BTR = dec.prefill()
    decisions = [routing_BTR[b, :n] for b, n in enumerate(LENS)]
    bytes_per_slot = 2 * cfg.n_kv_heads * cfg.head_dim * torch.empty(0, dtype=dtype).element_size()
    for step in range(N_NEW + 1):
        if step:
            _, r_NR = dec.step()
            decisions = [torch.cat([d, r_NR[b : b + 1]]) for b, d in enumerate(decisions)]
        lengths = dec.cache.lengths
        assert lengths.shape == (cfg.n_layers, len(prompts))
        for layer, kind in enumerate(cfg.layer_kinds):
            for b in range(len(prompts)):
                if kind == "D":
                    expected = LENS[b] + step  # every token fed
                else:
                    expected = int(decisions[b][:, attn_router_column(model, layer)].sum())
                assert int(lengths[layer, b]) == expected, (step, layer, b)
        assert dec.cache.nbytes_used == int(lengths.sum()) * bytes_per_slot
    # The decisions made by hand are the full causal forward's (the oracle for the counts above),
    # compared across code paths in float64 only (see the module docstring).
    if dtype == F64:
        for b in range(len(prompts)):
            assert torch.equal(decisions[b], causal_routes(model, dec.seqs[b]))
    routed = [layer for layer, kind in enumerate(cfg.layer_kinds) if kind == "R"]
    lengths = dec.cache.lengths
    assert (lengths[routed] < lengths[1]).all() and (lengths[routed] > 0).any()  # 1 is dense


def test_cache_of_a_mostly_skipping_model_uses_less_than_it_allocates():
    model = make_model(routing="joint", causal_router="predictor", take=0.15)
    cfg = model.config
    prompts = make_prompts((9, 9, 9))  # equal lengths: the dense layers fill their slots exactly
    dec = HandDecoder(model, prompts, N_NEW, grow=False)
    dec.prefill()
    for _ in range(N_NEW - 1):
        dec.step()
    lengths, cache = dec.cache.lengths, dec.cache
    bytes_per_slot = 2 * cfg.n_kv_heads * cfg.head_dim * 4
    assert cache.nbytes_used == int(lengths.sum()) * bytes_per_slot
    assert cache.nbytes_allocated == cfg.n_layers * 3 * (9 + N_NEW) * bytes_per_slot  # grow=False
    assert (lengths[1] == 9 + N_NEW - 1).all()
    routed = lengths[cfg.routed_layers]
    assert (routed <= (9 + N_NEW - 1) // 2).all()  # mostly skipped
    assert cache.nbytes_used < cache.nbytes_allocated
    assert cache.nbytes_used <= cache.nbytes_allocated - int((lengths[1] - routed).sum()) * (
        bytes_per_slot
    )
    # grow=True allocates the routed layers at a fraction of the dense size.
    small = KVCache(cfg, 3, MAX_LEN, grow=True)
    assert all(small.slots(layer) < MAX_LEN for layer in cfg.routed_layers)
    assert small.nbytes_allocated < KVCache(cfg, 3, MAX_LEN, grow=False).nbytes_allocated


@pytest.mark.parametrize("routing", ["joint", "staggered"])
def test_unused_cache_slots_are_never_attended(routing):
    """Poison every slot past each row's length with huge values after prefill and after every
    step: decoding still equals the no-cache reference, so no unfilled slot (zero hole or a
    skipped token's leftover) is ever given attention weight."""
    model = make_model(routing=routing, dtype=F64)
    prompts = make_prompts()
    exp = generate_reference(model, prompts, N_NEW)
    dec = HandDecoder(model, prompts, N_NEW)
    g = torch.Generator().manual_seed(0)
    logits, _ = dec.prefill()
    for step in range(N_NEW):
        lengths = dec.cache.lengths
        for layer in range(model.config.n_layers):
            for store in (dec.cache.k, dec.cache.v):
                for b in range(len(prompts)):
                    hole = store[layer][b, :, int(lengths[layer, b]) :]
                    hole.copy_(1e4 * torch.randn(hole.shape, generator=g))
        for b in range(len(prompts)):
            torch.testing.assert_close(logits[b], exp.logits[b][step], **TOL64)
        logits, _ = dec.step()
    assert [s[n:] for s, n in zip(dec.seqs, LENS, strict=True)] == [t[:N_NEW] for t in exp.tokens]
    assert (dec.cache.lengths < dec.cache.lengths.max()).any()  # precondition: rows of unequal use


@pytest.mark.parametrize("routing", ["joint", "staggered"])
def test_decode_runs_routed_blocks_only_on_the_rows_that_take_them(routing):
    model = make_model(
        routing=routing, causal_router="predictor", n_layers=3, layer_pattern="RDR", dtype=F64
    )
    force_routing(model, take=False, layers=[2])  # layer 2: every token skips
    prompts = make_prompts((5, 11, 8, 3))
    calls = {}

    def recorder(name):  # noqa: ANN001, ANN202
        def hook(module, args, output):  # noqa: ANN001, ANN202
            calls.setdefault(name, []).append(args[0].shape[0])

        return hook

    handles = []
    for layer in (0, 2):
        block = model.blocks[layer]
        handles.append(block.attn.register_forward_hook(recorder((layer, "attn"))))
        handles.append(block.mlp.register_forward_hook(recorder((layer, "mlp"))))
    dec = HandDecoder(model, prompts, N_NEW)
    dec.prefill()
    names = router_names(model)
    partial = 0
    try:
        for _ in range(N_NEW):
            before = dec.cache.lengths
            calls.clear()
            _, r_NR = dec.step()
            grown = dec.cache.lengths - before
            for layer in (0, 2):
                for sub in ("attn", "mlp"):
                    name = str(layer) if routing == "joint" else f"{layer}.{sub}"
                    n_take = int(r_NR[:, names.index(name)].sum())
                    assert calls.get((layer, sub), []) == ([n_take] if n_take else []), (
                        layer,
                        sub,
                    )
                    partial += 0 < n_take < len(prompts)
                col = r_NR[:, attn_router_column(model, layer)]
                assert torch.equal(grown[layer], col.long())  # skipping rows add nothing
            assert (grown[1] == 1).all()  # the dense layer stores every row's token
    finally:
        for h in handles:
            h.remove()
    assert partial > 0  # precondition: some steps had some rows take and some skip
    assert (dec.cache.lengths[2] == 0).all()
    got = generate(model, prompts, N_NEW, temperature=0, return_logits=True, return_routing=True)
    assert_same_generation(got, generate_reference(model, prompts, N_NEW))


@pytest.mark.parametrize("routing", ["joint", "staggered"])
def test_cached_keys_are_rotated_at_original_positions(routing):
    """Slot j of a layer holds the key (rotated at its original position) and value of the j-th
    token that took that layer: compared with the unrotated keys of the full causal forward,
    rotated here by the loop oracle's RoPE."""
    model = make_model(routing=routing, causal_router="predictor", dtype=F64)
    cfg = model.config
    prompts = make_prompts()
    gen = Generation(model, prompts, N_NEW, 0.0, None, None, None, None, "causal", True)
    new = [[] for _ in prompts]
    for st in gen.steps():
        for b, t in zip(st.rows, st.tokens, strict=True):
            new[b].append(t)
    cache = gen.cache
    H = cfg.n_kv_heads
    for b, p in enumerate(prompts):
        seq = p + new[b]
        raw, routes = unrotated_keys_and_values(model, seq)
        for layer, kind in enumerate(cfg.layer_kinds):
            if kind == "D":
                took = list(range(len(seq)))
            else:
                took = routes[:, attn_router_column(model, layer)].nonzero()[:, 0].tolist()
                assert 0 < len(took) < len(seq)
            assert int(cache.lengths[layer, b]) == len(took)
            for j, pos in enumerate(took):
                for h in range(H):
                    k_exp = rotate(raw[(layer, "k")][pos, h], pos, cfg.rope_theta)
                    torch.testing.assert_close(cache.k[layer][b, h, j], k_exp, **TOL64)
                    torch.testing.assert_close(
                        cache.v[layer][b, h, j], raw[(layer, "v")][pos, h], **TOL64
                    )


@pytest.mark.parametrize("routing", ["joint", "staggered"])
def test_cache_grows_when_every_token_takes_every_block(routing):
    model = make_model(routing=routing, causal_router="predictor", dtype=F64)
    force_routing(model, take=True)
    cfg = model.config
    prompts = make_prompts((20, 7))
    n_new = 30
    total = 20 + n_new
    initial = KVCache(cfg, 2, total, grow=True)
    assert all(initial.slots(layer) < total for layer in cfg.routed_layers)  # precondition
    got = generate(model, prompts, n_new, temperature=0, return_logits=True, return_routing=True)
    assert_same_generation(got, generate_reference(model, prompts, n_new))
    assert all(r.all() for r in got.routing)
    gen = Generation(model, prompts, n_new, 0.0, None, None, None, None, "causal", True)
    for _ in gen.steps():
        pass
    expected = torch.tensor([20 + n_new, 7 + n_new]).expand(cfg.n_layers, 2)
    assert torch.equal(gen.cache.lengths, expected)
    assert all(gen.cache.slots(layer) >= total for layer in range(cfg.n_layers))


def test_cache_past_max_len_raises_runtime_error():
    model = make_model(routing="joint", causal_router="predictor")
    force_routing(model, take=True)
    cfg = model.config
    idx = random_tokens(2, 8, seed=5)
    lens = torch.tensor([8, 8])
    cache = KVCache(cfg, 2, max_len=8, grow=True)
    logits, _ = prefill(model, idx, lens, cache)
    with pytest.raises(RuntimeError, match="max_len"):
        decode_step(model, logits.argmax(-1), torch.arange(2), cache)
    with pytest.raises(RuntimeError, match="max_len"):
        prefill(model, random_tokens(2, 9, seed=6), torch.tensor([9, 4]), KVCache(cfg, 2, 8))


# -- top-k prefill ------------------------------------------------------------------------------


@pytest.mark.parametrize("routing", ["joint", "staggered"])
def test_topk_prefill_takes_capacity_tokens_per_row(routing):
    """prefill="topk" routes each prompt with the paper's top-k over that prompt alone: exactly
    capacity_tokens(capacity, len) tokens per row and routed (sub-)block, the choice and the
    last-token logits of the model's own top-k forward on the row alone."""
    model = make_model(routing=routing, dtype=torch.float64)
    cfg = model.config
    lens = (5, 11, 8, 16)
    prompts = make_prompts(lens, seed=6)
    out = generate(
        model, prompts, N_NEW, temperature=0, prefill="topk", return_logits=True,
        return_routing=True,
    )  # fmt: skip
    assert [len(t) for t in out.tokens] == [N_NEW] * len(prompts)
    for b, (p, n) in enumerate(zip(prompts, lens, strict=True)):
        k = capacity_tokens(cfg.capacity, n)
        prompt_routing = out.routing[b][:n]
        assert (prompt_routing.sum(0) == k).all(), (b, prompt_routing.sum(0))
        with torch.no_grad():
            alone = model(torch.tensor([p]), routing="topk")
        assert torch.equal(prompt_routing, torch.stack([r.mask[0] for r in alone.routes], -1))
        torch.testing.assert_close(out.logits[b][0], alone.logits[0, -1], **TOL32)
    assert len({capacity_tokens(cfg.capacity, n) for n in lens}) > 1  # rows really differ in k
    # The cache holds exactly the top-k tokens in each routed layer.
    idx, lens_t = pad(prompts)
    cache = KVCache(cfg, len(prompts), dtype=torch.float64)
    prefill(model, idx, lens_t, cache, mode="topk")
    for layer in cfg.routed_layers:
        assert cache.lengths[layer].tolist() == [capacity_tokens(cfg.capacity, n) for n in lens]


# -- the cache protocol through the model's forward ---------------------------------------------


def test_forward_with_a_cache_refuses_what_cannot_be_cached():
    model = make_model(routing="staggered", causal_router="predictor")
    idx = random_tokens(2, 6, seed=1)
    with pytest.raises(ValueError, match="lengths"):
        model(idx, lengths=torch.tensor([6, 4]))  # padding needs a cache
    cache = KVCache(model.config, 2, 16)
    with pytest.raises(ValueError, match="rows"):
        model(random_tokens(3, 6, seed=1), cache=cache, routing="causal")
    with pytest.raises(ValueError, match="float64"):
        model(idx, cache=KVCache(model.config, 2, 16, dtype=F64), routing="causal")
    with pytest.raises(ValueError, match="prefill the whole batch"):
        cache.subset(torch.tensor([0]))  # a view is for decode steps
    with pytest.raises(ValueError, match="integers"):
        model(idx, cache=cache, routing="causal", lengths=torch.tensor([6.0, 4.0]))
    with pytest.raises(ValueError, match="lengths"):
        model(idx, cache=cache, routing="causal", lengths=torch.tensor([7, 4]))
    with pytest.raises(ValueError, match="targets"):
        model(idx, targets=idx, cache=cache, last_only=True)
    model(idx, cache=cache, routing="causal", lengths=torch.tensor([6, 4]))  # the prefill
    assert cache.positions().tolist() == [6, 4]
    one = random_tokens(2, 1, seed=2)
    with pytest.raises(ValueError, match="top-k"):
        model(one, cache=cache, routing="topk")  # top-k cannot decode
    with pytest.raises(ValueError, match="one token"):
        model(random_tokens(2, 2, seed=2), cache=cache, routing="causal")
    with pytest.raises(ValueError, match="strictly increasing"):
        cache.subset(torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="strictly increasing"):
        cache.subset(torch.tensor([2]))
    with pytest.raises(ValueError, match="strictly increasing"):
        cache.subset(torch.tensor([1])).subset(torch.tensor([-1]))
    with pytest.raises(ValueError, match="strictly increasing"):
        decode_step(model, torch.tensor([3, 3]), torch.tensor([1, 1]), cache)
    with pytest.raises(ValueError, match="lengths"):
        model(one, cache=cache, routing="causal", lengths=torch.tensor([1, 1]))
    model(one[1:], cache=cache.subset(torch.tensor([1])), routing="causal")  # row 1 alone
    assert cache.positions().tolist() == [6, 5]


@pytest.mark.parametrize("skipped_kv", ["none", "residual"])
def test_decode_step_of_some_rows_equals_full_recomputation(skipped_kv):
    """Rows fed unevenly (row 1 every step, row 0 every other step) through cache views: each
    row's logits equal the full causal forward of its own sequence (float64)."""
    model = make_model(routing="joint", causal_router="predictor", dtype=F64, skipped_kv=skipped_kv)
    prompts = make_prompts((7, 4))
    idx, lens = pad(prompts)
    cache = KVCache(model.config, 2, 40, dtype=F64)
    logits, _ = prefill(model, idx, lens, cache)
    seqs = [list(p) for p in prompts]
    for step in range(8):
        rows = torch.tensor([0, 1]) if step % 2 else torch.tensor([1])
        tokens = logits[rows].argmax(-1)
        for b, t in zip(rows.tolist(), tokens.tolist(), strict=True):
            seqs[b].append(t)
        new_logits, _ = decode_step(model, tokens, rows, cache)
        for i, b in enumerate(rows.tolist()):
            with torch.no_grad():
                full = model(torch.tensor([seqs[b]]), routing="causal").logits[0, -1]
            torch.testing.assert_close(new_logits[i], full, **TOL64)
            logits[b] = new_logits[i]
    assert cache.positions().tolist() == [len(s) for s in seqs]
