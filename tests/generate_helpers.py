"""The models, prompts and hand-written decoders shared by the generation tests (float64 where a
comparison ends in a hard decision; see test_generate.py)."""

from __future__ import annotations

import torch
from helpers import V, tiny_config
from helpers import make_model as _make_model

from mixture_of_depths import MoDConfig, MoDTransformer
from mixture_of_depths.cache import KVCache
from mixture_of_depths.generate import (
    decode_step,
    prefill,
    router_names,
)
from mixture_of_depths.routing import route_name

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
    ("mlp", "aux_loss"),
    ("mlp", "predictor"),
    ("mlp_kv", "aux_loss"),
    ("mlp_kv", "predictor"),
]
# Each routing mode once, both causal routers among them: for the tests that need not run all.
SOME_MODES = [
    ("joint", "aux_loss"),
    ("staggered", "predictor"),
    ("mlp", "predictor"),
    ("mlp_kv", "predictor"),
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


def attn_router_column(model: MoDTransformer, layer: int) -> int | None:
    """Index, in the routing decisions, of the router whose choice fills layer `layer`'s cache;
    None where every token fills it (a dense layer, or attention dense with routing="mlp")."""
    routing = model.config.routing
    if model.config.layer_kinds[layer] == "D" or routing == "mlp":
        return None
    kind = {"joint": "block", "staggered": "attn", "mlp_kv": "mlp_kv"}[routing]
    return router_names(model).index(route_name(layer, kind))


def cached_tokens(model: MoDTransformer, layer: int, decisions_TR: torch.Tensor) -> torch.Tensor:
    """(T,) bool: the tokens of one row that layer `layer` caches, from the row's routing
    decisions (T, n_routers): those its attention's router took, or every token."""
    col = attn_router_column(model, layer)
    if col is None:
        return torch.ones(decisions_TR.shape[0], dtype=torch.bool)
    return decisions_TR[:, col]


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
        self.seqs = [list(p) for p in prompts]

    def prefill(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.logits, routing = prefill(self.model, self.idx, self.lens, self.cache)
        return self.logits, routing

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed each row its greedy token; returns the new logits and routing decisions."""
        tokens = self.logits.argmax(-1)
        for b, t in enumerate(tokens.tolist()):
            self.seqs[b].append(t)
        self.logits, routing = decode_step(self.model, tokens, self.cache)
        return self.logits, routing


def assert_same_generation(got, exp, logits_tol=TOL64) -> None:  # noqa: ANN001
    assert got.tokens == exp.tokens
    assert got.router_names == exp.router_names
    for b, (lg, le) in enumerate(zip(got.logits, exp.logits, strict=True)):
        assert lg.shape == le.shape, b
        torch.testing.assert_close(lg, le, **logits_tol)
    for b, (rg, re) in enumerate(zip(got.routing, exp.routing, strict=True)):
        assert torch.equal(rg, re), b


def served_and_reference(model: MoDTransformer, **engine_kw) -> tuple[list, list]:
    """Four prompts of several lengths served together by an `Engine` (a chunked prefill, rows
    that join and leave; greedy), and each prompt's no-cache reference alone."""
    from mixture_of_depths.generate import generate_reference
    from mixture_of_depths.serve.engine import Engine
    from mixture_of_depths.serve.types import SamplingParams

    prompts, new = make_prompts((5, 17, 3, 9), seed=2), (6, 4, 7, 5)
    engine = Engine(model, None, max_rows=3, page_size=4, prefill_chunk=8, **engine_kw)
    greedy = dict(temperature=0.0, stop_at_eos=False)
    pairs = list(zip(prompts, new, strict=True))
    reqs = [engine.submit(p, SamplingParams(max_tokens=n, **greedy)) for p, n in pairs]
    while engine.step():
        pass
    want = [generate_reference(model, [p], n).tokens[0] for p, n in pairs]
    return [r.result(0)[0] for r in reqs], want
