"""Decoding with fixed shapes, for a GPU (docs/semantics.md, "Static decoding"; docs/bench.md,
"Decode on a GPU"): `StaticCache`, what a static cache is; `StaticKVCache`, capacity-sized
buffers allocated once (`cache.kv_slots`), lengths and positions on the device; `StaticDecoder`,
a decode step with no host sync and no data-dependent shape over any static cache (this one, or
the server's paged one), captured as one CUDA graph by `graph_step` (or compiled with
``torch.compile(mode="reduce-overhead")``, as gpt-fast does); `static_generate` drives it.

Every row computes every routed block and masks decide, exactly (selection.py, "device"): the
eager step's arithmetic on more rows, so its tokens are the eager ones. The price is the routed
blocks' compute on the skipping rows: little at batch 64, where nearly every routed layer has a
taker anyway (1 - (1 - c)^B), the whole saving at batch 1. A row that outgrows its slots sets an
overflow flag and `static_generate` raises once at the end (one read). Expert layers decode but
are not capturable (their slices' bounds are read on the host).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from .blocks import Pass
from .cache import kv_slots, packed
from .config import MoDConfig
from .generate import prefill, prompt_batch
from .layers import rope_tables
from .model import MoDTransformer
from .precision import at_least_float32


class StaticCache(nn.Module):
    """What a static cache is (a `StaticKVCache`, the server's `serve.paged.PagedStatic`):
    buffers ``k{layer}`` and ``v{layer}``, ``lengths`` (layers, rows), ``pos`` and ``active``
    (rows,) on the device, updated in place so that a captured step may; a decode step runs
    every row under masks (selection.py, "device"), a skipper's key and value (or an inactive
    row's) going to a trash place no query reads (`place`)."""

    static = True

    def positions(self) -> Tensor:
        return self.pos

    def advance(self, counts: Tensor | int) -> None:
        self.pos += counts.to(self.device) if isinstance(counts, Tensor) else counts

    def place(self, layer: int, take_N: Tensor) -> tuple:
        """Where each row's new key and value go in ``k{layer}``: its next slot, or trash."""
        raise NotImplementedError

    def append(self, layer: int, k: Tensor, v: Tensor, take_N: Tensor | None = None) -> None:
        """Each active row's new key and value (N, n_kv_heads, 1, head_dim) at its length;
        with `take_N` (N,) bool only the takers', the others' to the trash."""
        take = self.active if take_N is None else take_N & self.active
        where = self.place(layer, take)
        getattr(self, f"k{layer}")[where] = k[:, :, 0].to(self.dtype)
        getattr(self, f"v{layer}")[where] = v[:, :, 0].to(self.dtype)
        self.lengths[layer] += take


class StaticKVCache(StaticCache):
    """Per-layer key/value buffers (B, n_kv_heads, S_l + 1, head_dim) whose last slot is the
    trash slot, every row active; the model's prefill writes them (`write_prefill`)."""

    def __init__(
        self,
        config: MoDConfig,
        batch_size: int,
        max_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        headroom: float = 1.5,
    ) -> None:
        super().__init__()
        if not 1 <= max_len <= config.max_seq_len:
            raise ValueError(
                f"max_len must be in [1, max_seq_len={config.max_seq_len}], got {max_len}"
            )
        if batch_size < 1 or not headroom > 0:
            raise ValueError(f"batch_size must be >= 1 and headroom > 0, got {batch_size}, "
                             f"{headroom}")  # fmt: skip
        self.config, self.batch_size, self.max_len = config, batch_size, max_len
        self.device, self.dtype = torch.device(device or "cpu"), dtype
        n = config.n_kv_layers  # one per application of a layer (cfg.topology)
        self.slots = [kv_slots(config, layer, max_len, headroom) for layer in range(n)]
        for layer, s in enumerate(self.slots):
            shape = (batch_size, config.n_kv_heads, s + 1, config.head_dim)
            self.register_buffer(f"k{layer}", torch.zeros(shape, device=self.device, dtype=dtype))
            self.register_buffer(f"v{layer}", torch.zeros(shape, device=self.device, dtype=dtype))
        long = dict(device=self.device, dtype=torch.long)
        self.register_buffer("lengths", torch.zeros(n, batch_size, **long))
        self.register_buffer("pos", torch.zeros(batch_size, **long))
        self.register_buffer("overflow", torch.zeros(n, dtype=torch.bool, device=self.device))
        self.register_buffer("rows", torch.arange(batch_size, **long))
        self.register_buffer("active", torch.ones(batch_size, dtype=torch.bool, device=device))

    def write_prefill(self, layer: int, k: Tensor, v: Tensor, take_BT: Tensor | None) -> None:
        """A prefill's keys and values of the tokens with `take_BT` set (all when None),
        left-packed per row (`cache.packed`); more than the layer's slots is an error."""
        k, v, counts = packed(k, v, take_BT)
        s = self.slots[layer]
        if int(counts.max()) > s:
            raise ValueError(
                f"layer {layer}'s prefill stored {int(counts.max())} tokens in a row, more than "
                f"its {s} static slots: raise headroom"
            )
        n = min(k.shape[2], s)
        getattr(self, f"k{layer}")[:, :, :n] = k[:, :, :n].to(self.dtype)
        getattr(self, f"v{layer}")[:, :, :n] = v[:, :, :n].to(self.dtype)
        self.lengths[layer] = counts.to(self.device)

    def place(self, layer: int, take_N: Tensor) -> tuple:
        """A taker's next slot; a row past its slots sets the overflow flag (and writes to the
        trash slot): the generation is then refused."""
        s, lens = self.slots[layer], self.lengths[layer]
        self.overflow[layer] |= (take_N & (lens >= s)).any()
        return self.rows, slice(None), torch.where(take_N, lens.clamp(max=s), s)

    def read(self, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        """Keys, values (N, n_kv_heads, S_l, head_dim) and the mask of filled slots."""
        s = self.slots[layer]
        valid = torch.arange(s, device=self.device)[None, :] < self.lengths[layer][:, None]
        K, V = getattr(self, f"k{layer}"), getattr(self, f"v{layer}")
        return K[:, :, :s], V[:, :, :s], valid[:, None, None, :]


class StaticDecoder(nn.Module):
    """One decode step over a static cache (a `StaticKVCache`, or the server's paged cache as
    its static step sees it, `serve.paged.PagedStatic`): ``decoder(tokens_N)`` -> logits
    (N, vocab) and the routing decisions (N, n_routers) on the device, the cache updated in
    place. The model's own layer loop (`run_blocks`) with every routed (sub-)block under masks.
    Fixed shapes, no host sync: capture it (`graph_step`), or compile it, e.g.
    ``torch.compile(decoder, mode="reduce-overhead", fullgraph=True)`` on a GPU. `skip_idle`
    (for a step run eagerly, never captured): a routed block that no active row takes is
    skipped, as the entries' decode step skips it, at one host read of its decisions."""

    def __init__(self, model: MoDTransformer, cache: nn.Module, skip_idle: bool = False) -> None:
        super().__init__()
        self.model, self.cache, self.skip_idle = model, cache, skip_idle
        cfg = model.config  # the model's rotary tables, held for a captured step to index
        dtype = at_least_float32(cache.dtype)
        self.cos, self.sin = rope_tables(
            cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cache.device, dtype
        )

    def forward(self, tokens_N: Tensor) -> tuple[Tensor, Tensor]:
        model, cache = self.model, self.cache
        x = model.embed(tokens_N[:, None])
        pos = cache.positions()
        cos, sin = self.cos[pos][:, None, None], self.sin[pos][:, None, None]
        p = Pass("causal", cos, sin, cache, decode=True, static=True, skip_idle=self.skip_idle)
        x, routes, _ = model.run_blocks(x, p)
        cache.advance(1)
        masks = [r.mask[:, 0] for r in routes]
        routing = torch.stack(masks, -1) if masks else x.new_zeros(len(x), 0, dtype=torch.bool)
        return model.lm_head(model.norm(x))[:, 0], routing


def graph_step(
    decoder: nn.Module, tokens_N: Tensor
) -> tuple[torch.cuda.CUDAGraph, Tensor, tuple[Tensor, Tensor]]:
    """`decoder` (a `StaticDecoder`, on a CUDA device) captured as one CUDA graph, no compiler:
    two warm-up steps on a side stream (allocations, lazy init; they run, and change the cache
    as a step does), then the capture with a copy of `tokens_N` as its static input.
    ``graph.replay()`` runs the step on what that input holds, into the static outputs."""
    static_in = tokens_N.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            decoder(static_in)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        static_out = decoder(static_in)
    return graph, static_in, static_out


def static_step(
    model: MoDTransformer, cache: nn.Module
) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
    """The decode step over a new static `cache` as a caller runs it: on CUDA a
    `StaticDecoder` captured now as one CUDA graph (`graph_step`: its warm-ups decode no slot
    of a new cache, whose positions each step sets) and replayed on each call's tokens, where
    the model is capturable (expert layers read their bounds on the host); else the decoder,
    eager, skipping the routed blocks no row takes (a graph cannot skip without a host read)."""
    if cache.device.type != "cuda" or model.config.has_experts:
        return torch.no_grad()(StaticDecoder(model, cache, skip_idle=True))
    decoder = StaticDecoder(model, cache)
    idle = torch.zeros(len(cache.positions()), dtype=torch.long, device=cache.device)
    graph, static_in, static_out = graph_step(decoder, idle)

    def replay(tokens_N: Tensor) -> tuple[Tensor, Tensor]:
        static_in.copy_(tokens_N)
        graph.replay()
        return static_out

    return replay


@torch.no_grad()
def static_generate(
    model: MoDTransformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    step: nn.Module | None = None,
    headroom: float = 1.5,
) -> list[list[int]]:
    """Greedy generation of `max_new_tokens` per row (no EOS) with a static cache: the model's
    prefill into it (`generate.prefill`), then `step` (a `StaticDecoder` over this batch's
    cache, or that compiled; None: an eager one is built). Tokens stay on the device until the
    end."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    idx, lens = prompt_batch(model, prompts, max_new_tokens, model.embed.weight.device)
    dtype = model.embed.weight.dtype
    total = int(lens.max()) + max_new_tokens
    if step is None:
        cache = StaticKVCache(model.config, len(lens), total, idx.device, dtype, headroom)
        step = StaticDecoder(model, cache)
    decoder = getattr(step, "_orig_mod", step)
    was_training = model.training
    model.eval()
    try:
        logits, _ = prefill(model, idx, lens, decoder.cache)
        out = [logits.argmax(-1)]
        for _ in range(max_new_tokens - 1):
            out.append(step(out[-1])[0].argmax(-1))
    finally:
        model.train(was_training)
    if bool(decoder.cache.overflow.any()):  # the one read of the flags, at the end
        layers = decoder.cache.overflow.nonzero().flatten().tolist()
        raise RuntimeError(
            f"routed layers {layers} took more tokens than their static slots: the generation "
            f"is not exact; raise headroom (was {headroom})"
        )
    return torch.stack(out, 1).tolist()
