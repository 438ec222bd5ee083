"""Models, prompts and the paged-cache driver shared by the serving engine's tests (float64
models: every comparison ends in a greedy argmax or a routing threshold)."""

from __future__ import annotations

import math

import torch
from generate_helpers import cached_tokens, causal_routes
from helpers import V, make_model, random_tokens, tiny_config

from mixture_of_depths import MoDTransformer
from mixture_of_depths.serve.paged import PagedKVCache, paged_forward

MAX_LEN = 64
F64 = torch.float64
# name -> config overrides: MoD in both causal modes, staggered, MLP-only routing, residual KV,
# dense, and staged MoDE (expert MLPs in MoD blocks).
KINDS = {
    "mod": dict(routing="joint", causal_router="aux_loss"),
    "predictor": dict(routing="joint", causal_router="predictor"),
    "staggered": dict(routing="staggered", causal_router="predictor"),
    "mlp": dict(routing="mlp", causal_router="predictor"),
    "residual": dict(routing="joint", causal_router="predictor", skipped_kv="residual"),
    "dense": dict(layer_pattern="D"),
    "mode": dict(routing="joint", causal_router="predictor", n_experts=2, experts_per_token=1),
}


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
        logits, routing = paged_forward(self.model, self.cache, rows, pos, toks)
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
            full = self.model.config.full_kv_layers  # every token: dense, residual, mlp
            for layer in range(self.model.config.n_layers):
                n = (
                    len(seq)
                    if layer in full
                    else int(cached_tokens(self.model, layer, decisions).sum())
                )
                assert self.cache.lengths[row][layer] == n, (row, layer)
                assert held[layer] == math.ceil(n / ps), (row, layer)
