"""Models, prompts and the paged-cache driver shared by the serving engine's tests (float64
models: every comparison ends in a greedy argmax or a routing threshold)."""

from __future__ import annotations

import math

import torch
from generate_helpers import cached_tokens, causal_routes
from helpers import V, make_model, random_tokens, tiny_config

from mixture_of_depths import MoDTransformer
from mixture_of_depths.generate import decode_step
from mixture_of_depths.serve.paged import PagedKVCache

MAX_LEN = 64
F64 = torch.float64
# name -> config overrides: MoD in both causal modes, staggered, MLP-only routing, the takers'
# keys (routing="mlp_kv"), residual KV, dense, staged MoDE (expert MLPs in MoD blocks), and MoR
# (both KV strategies, both routers).
KINDS = {
    "mod": dict(routing="joint", causal_router="aux_loss"),
    "predictor": dict(routing="joint", causal_router="predictor"),
    "staggered": dict(routing="staggered", causal_router="predictor"),
    "mlp": dict(routing="mlp", causal_router="predictor"),
    "mlp-kv": dict(routing="mlp_kv", causal_router="predictor"),
    "residual": dict(routing="joint", causal_router="predictor", skipped_kv="residual"),
    "dense": dict(layer_pattern="D"),
    "mode": dict(routing="joint", causal_router="predictor", n_experts=2, experts_per_token=1),
    # Mixture-of-Recursions: the middle layers applied 3 times, a cache layer per application
    "mor": dict(layer_pattern="D", recursions=3, recursion_capacities=(0.5, 0.3),
                causal_router="predictor"),
    "mor-share": dict(layer_pattern="D", recursions=3, recursion_capacities=(0.5, 0.3),
                      causal_router="predictor", recursion_kv="share"),
    "mor-token": dict(layer_pattern="D", recursions=3, recursion_router="token"),
}  # fmt: skip


def serve_model(kind: str = "predictor", seed: int = 0, **overrides) -> MoDTransformer:
    cfg = tiny_config(**{"max_seq_len": MAX_LEN, "capacity": 0.3, **KINDS[kind], **overrides})
    return make_model(cfg, seed, F64, take=0.5, calib_idx=random_tokens(4, 32, seed + 100))


def prompts(lens, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]


class PagedDriver:
    """Rows fed by hand through a `PagedKVCache`: `feed({row: tokens})` runs one step with each
    row's tokens as consecutive entries, and returns each row's logits and routing per token."""

    def __init__(self, model: MoDTransformer, n_pages: int, page_size: int) -> None:
        self.model = model
        self.cache = PagedKVCache(model.config, n_pages, page_size, dtype=F64)
        self.seqs: dict[int, list[int]] = {}

    def feed(self, feeds: dict[int, list[int]]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        rows, pos, toks = [], [], []
        for row, tokens in feeds.items():
            if row not in self.seqs:
                self.cache.add_row(row)
                self.seqs[row] = []
            start = len(self.seqs[row])
            rows += [row] * len(tokens)
            pos += list(range(start, start + len(tokens)))
            toks += tokens
            self.seqs[row] += tokens
        logits, routing = decode_step(self.model, torch.tensor(toks), self.cache.step(rows, pos))
        out, i = {}, 0
        for row, tokens in feeds.items():
            out[row] = (logits[i : i + len(tokens)], routing[i : i + len(tokens)])
            i += len(tokens)
        return out

    def check_pages(self) -> None:
        """Each (row, layer) holds the tokens the full causal forward caches there, on
        ceil(tokens / page_size) pages."""
        ps = self.cache.page_size
        for row, seq in self.seqs.items():
            decisions = causal_routes(self.model, seq)
            held = self.cache.pages_held(row)
            for vl in range(self.model.config.n_kv_layers):
                n = layer_tokens(self.model, vl, decisions)
                assert self.cache.lengths[row][vl] == n, (row, vl)
                assert held[vl] == math.ceil(n / ps), (row, vl)


class LetterTokenizer:
    """Token i is the letter chr(65 + i) (the test vocabulary of 61 ids), with an end-of-text
    id that decodes to nothing: text whose oracle is plain string slicing."""

    def __init__(self, eot_id: int = V - 1) -> None:
        self.eot_id, self.vocab_size = eot_id, V

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(65 + i) for i in ids if i != self.eot_id)

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 65 for c in text]


def layer_tokens(model: MoDTransformer, vl: int, decisions: torch.Tensor) -> int:
    """The tokens of one row that KV-cache layer `vl` holds, from the full causal forward's
    decisions (T, routes): every token in a full layer; for a MoR step the tokens its route took
    (none with ``recursion_kv="share"``: later steps read the first pass's); for MoD the tokens
    the layer's attention router took."""
    cfg = model.config
    if vl in cfg.full_kv_layers:
        return decisions.shape[0]
    if cfg.recursive:
        step = cfg.layer_schedule[vl][1]
        if cfg.recursion_kv == "share":
            return 0
        return int(decisions[:, cfg.recursion_routed_steps.index(step)].sum())
    return int(cached_tokens(model, vl, decisions).sum())


def engine_pages_match_their_rows(engine) -> None:  # noqa: ANN001
    """Each running row holds, per cache layer, the tokens the full causal forward of what it
    has fed caches there, on ceil(tokens / page_size) pages; the pools count the rows' pages."""
    cache, model = engine.cache, engine.model
    layers = range(model.config.n_kv_layers)
    for row in engine.sched.running:
        fed = row.request.tokens[: row.fed]
        if not fed:
            assert cache.pages_held(row.id) == [0] * len(layers)
            continue
        decisions = causal_routes(model, fed)
        for vl in layers:
            n = layer_tokens(model, vl, decisions)
            assert cache.lengths[row.id][vl] == n, (row.id, vl)
            assert cache.pages_held(row.id)[vl] == math.ceil(n / cache.page_size)
    held = [sum(cache.pages_held(r.id)[i] for r in engine.sched.running) for i in layers]
    assert cache.pages_in_use() == held
    static = cache.static  # the static step's host-kept page tables follow the rows' pages
    if static is not None:
        for row in engine.sched.running:
            slot = cache.slots[row.id]
            for vl, pages in enumerate(cache.tables[row.id]):
                assert static.table_h[vl, slot, : len(pages)].tolist() == pages, (row.id, vl)
        for slot in set(range(static.n_rows)) - set(cache.slots.values()):
            assert bool((static.table_h[:, slot] == static.trash).all()), slot
