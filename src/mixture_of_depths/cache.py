"""The KV-cache protocol the model's forward reads and writes, and `KVCache`, which holds only the
tokens that took each layer (every token, in layers with ``skipped_kv="residual"`` or
``routing="mlp"``).

`MoDTransformer.forward(idx, cache=...)` is the one forward path of training, prefill and decode: a
block that runs attention hands its new keys and values to the cache through `kv_hook`. On a
prefill (the cache holds nothing yet) the cache stores the new tokens that took the layer
(`write_prefill`) and the prompt attends within itself, exactly as the full forward does; on a
decode step (one new token per row) it appends the token's key and value (`append`) and reads
all that the layer holds for those rows (`read`). docs/semantics.md says what a layer stores
and why.

Layout of `KVCache`: for layer l, ``k[l]`` and ``v[l]`` are (B, n_kv_heads, S_l, head_dim) and
``lengths[l, b]`` says how many slots of row b are filled. Slots are filled left to right with no
holes: a routed layer appends a token only if the token took that layer (its attention sub-block,
in staggered routing), so ``lengths[l, b]`` is the number of such tokens and slot j holds the j-th
of them; with ``skipped_kv="residual"``, or ``routing="mlp"`` (attention dense, only the MLP
routed), a routed layer stores every token, as a dense one does. With ``routing="mlp_kv"`` it
stores its takers, and on a decode step every row reads it (`read`) after the taking rows
appended (`append`).
Keys are stored already rotated at the token's original position. Attention reads slots
``< lengths[l, b]`` only, so a slot that was never written is never attended.

Growth: layers that store every token are allocated for the whole generation up front. Other
routed layers start at a fraction of that (``capacity`` plus headroom) and grow by half, in steps
of 64 slots up to the full size, when a row fills its buffer: in causal routing a layer may take
more tokens than its capacity, and nothing is dropped. Writing past `max_len` (the full size)
raises an error; `generate` sizes the cache so that it cannot.

Lengths and positions are kept on the host: the decode loop already knows on the host which rows
take a layer, so no device-to-host copy is needed to read or check them.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import Tensor

from .config import MoDConfig
from .layers import KVHook

_MIN_SLOTS = 16


class Cache(Protocol):
    """What `MoDTransformer.forward` needs from a KV cache: positions, and per attention call
    either a prefill's write or a decode step's append-and-read (the model owns the rotary
    tables: a cache gives positions, not tables)."""

    max_len: int
    device: torch.device
    dtype: torch.dtype

    def positions(self) -> Tensor:
        """(batch,) host: the tokens each row has processed, i.e. the position of its next one."""
        ...

    def write_prefill(self, layer: int, k: Tensor, v: Tensor, take_BT: Tensor | None) -> None:
        """Store the prompt's keys/values (B, n_kv_heads, T, head_dim) of the tokens with
        `take_BT` set (all when None) in the empty `layer`."""
        ...

    def append(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Append one key/value per row (n, n_kv_heads, 1, head_dim): a decode step's new
        token (a static cache takes ``take_N=``, the rows whose token takes the layer)."""
        ...

    def read(self, layer: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """The keys, values and validity mask of everything `layer` holds for these rows."""
        ...

    def subset(self, rows: Tensor) -> Cache:
        """The same cache seen through some of its rows (sorted host indices)."""
        ...

    def advance(self, counts: Tensor | int) -> None:
        """After a forward: each row has processed `counts` more tokens."""
        ...


def kv_slots(config: MoDConfig, layer: int, max_len: int, headroom: float = 1.5) -> int:
    """The slots a cache gives KV layer `layer` (`Topology.kv_shares`) for `max_len` positions:
    all of them where the layer holds every token, none where it holds none (a recursion step
    that reads the first pass's, "share"), else `headroom` times its share at capacity, at
    least 16: causal routing may take more (`KVCache` grows, `StaticKVCache` flags it)."""
    share = config.kv_share(layer)
    if share >= 1 or share == 0:
        return max_len if share else 0
    return min(max_len, max(_MIN_SLOTS, math.ceil(headroom * share * max_len)))


def packed(k: Tensor, v: Tensor, take_BT: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """A prefill's keys and values (B, n_kv_heads, T, head_dim) with each row's takers
    (`take_BT`; None: every token) moved to the front, in order, and their counts (B,) on the
    host: what a cache layer stores, left-packed with no holes."""
    B, H, T, d = k.shape
    if take_BT is None:
        return k, v, torch.full((B,), T, dtype=torch.long)
    # A stable sort on "skipped" moves each row's taken tokens to the front, in order.
    order_BT = torch.sort((~take_BT).to(torch.int8), dim=1, stable=True).indices
    idx = order_BT[:, None, :, None].expand(B, H, T, d)
    return k.gather(2, idx), v.gather(2, idx), take_BT.sum(1).cpu()


def kv_hook(cache: Cache, layer: int, take_BT: Tensor | None, decode: bool) -> KVHook:
    """The attention's hook into `cache` for one layer. On a prefill the prompt's takers are
    stored and the prompt attends within itself, exactly as the full forward does; on a decode
    step the new token is appended (on a static cache, where `take_BT` (N,) is given, only the
    takers') and attends to all that the layer holds for its row."""
    if decode:
        takes = {} if take_BT is None else {"take_N": take_BT}

        def step(k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
            cache.append(layer, k, v, **takes)
            return cache.read(layer)

        return step

    def store(k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
        cache.write_prefill(layer, k, v, take_BT)
        return k, v, mask

    return store


class KVCache:
    """Per-layer, per-row key/value cache for causal MoD decoding."""

    def __init__(
        self,
        config: MoDConfig,
        batch_size: int,
        max_len: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        grow: bool = True,
    ) -> None:
        max_len = config.max_seq_len if max_len is None else max_len
        if not 1 <= max_len <= config.max_seq_len:
            raise ValueError(
                f"max_len must be in [1, max_seq_len={config.max_seq_len}], got {max_len}"
            )
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.config, self.batch_size, self.max_len = config, batch_size, max_len
        self.device, self.dtype = torch.device(device or "cpu"), dtype
        shape = (batch_size, config.n_kv_heads, 0, config.head_dim)
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        # One layer per application of a layer (a recursive model applies some several times).
        for layer in range(config.n_kv_layers):
            slots = kv_slots(config, layer, max_len) if grow else max_len
            size = (*shape[:2], slots, shape[3])
            self.k.append(torch.zeros(size, device=self.device, dtype=dtype))
            self.v.append(torch.zeros(size, device=self.device, dtype=dtype))
        self._lengths = torch.zeros(config.n_kv_layers, batch_size, dtype=torch.long)
        self._positions = torch.zeros(batch_size, dtype=torch.long)
        self._all_rows = torch.arange(batch_size)

    # -- the protocol ---------------------------------------------------------------------------
    def positions(self) -> Tensor:
        return self._positions.clone()

    def subset(self, rows: Tensor) -> CacheRows:
        return CacheRows(self, rows)

    def advance(self, counts: Tensor | int, rows: Tensor | None = None) -> None:
        if rows is None:
            self._positions += counts
        else:
            self._positions[rows] += counts

    # -- what is held ---------------------------------------------------------------------------
    @property
    def lengths(self) -> Tensor:
        """(n_layers, batch) filled slots: the tokens each layer has cached for each row."""
        return self._lengths.clone()

    def slots(self, layer: int) -> int:
        return self.k[layer].shape[2]

    @property
    def _bytes_per_slot(self) -> int:
        # keys and values, all kv heads, one token of one row
        return 2 * self.config.n_kv_heads * self.config.head_dim * self.k[0].element_size()

    @property
    def nbytes_used(self) -> int:
        """Bytes of the slots holding entries (keys and values)."""
        return int(self._lengths.sum()) * self._bytes_per_slot

    @property
    def nbytes_allocated(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    # -- writing --------------------------------------------------------------------------------
    def _ensure(self, layer: int, needed: int) -> None:
        """Grow layer `layer` (by half, in 64-slot steps, at most `max_len`) to `needed` slots."""
        have = self.slots(layer)
        if needed <= have:
            return
        if needed > self.max_len:
            raise RuntimeError(
                f"KV cache layer {layer} is full: {needed} slots needed, max_len={self.max_len}"
            )
        # Grow by half, in steps of 64 slots: doubling would let one busy row double the layer.
        new = min(self.max_len, 64 * math.ceil(max(needed, have * 3 // 2) / 64))
        for store in (self.k, self.v):
            old = store[layer]
            grown = old.new_zeros(*old.shape[:2], new, old.shape[3])
            grown[:, :, :have] = old
            store[layer] = grown

    def write_prefill(self, layer: int, k: Tensor, v: Tensor, take_BT: Tensor | None) -> None:
        """Store, for each row, the keys/values of the prompt tokens with ``take_BT`` set (all when
        None), in order. `k`, `v`: (B, n_kv_heads, T, head_dim) for the whole padded prompt. The
        layer must be empty."""
        k, v, counts = packed(k, v, take_BT)
        self._ensure(layer, int(counts.max()))
        n = min(k.shape[2], self.slots(layer))
        self.k[layer][:, :, :n] = k[:, :, :n].to(self.dtype)
        self.v[layer][:, :, :n] = v[:, :, :n].to(self.dtype)
        self._lengths[layer] = counts

    def _fast_rows(self, layer: int, rows: Tensor) -> tuple[Tensor, slice | None]:
        """The rows' filled lengths, and a batch slice when the rows are all rows or one row and
        their lengths are equal (the usual case: slice writes and reads, no gather, no mask)."""
        lens = self._lengths[layer, rows]
        n = rows.numel()
        if int(lens.min()) == int(lens.max()) and (n == self.batch_size or n == 1):
            return lens, slice(None) if n == self.batch_size else slice(
                int(rows[0]), int(rows[0]) + 1
            )
        return lens, None

    def append(self, layer: int, k: Tensor, v: Tensor, rows: Tensor | None = None) -> None:
        """Append one key/value (n, n_kv_heads, 1, head_dim) to each of `rows` (sorted host ids;
        None: every row)."""
        rows = self._all_rows if rows is None else rows
        lens, b = self._fast_rows(layer, rows)
        self._ensure(layer, int(lens.max()) + 1)
        K, V = self.k[layer], self.v[layer]
        if b is not None:
            lo = int(lens[0])
            K[b, :, lo] = k[:, :, 0]
            V[b, :, lo] = v[:, :, 0]
        else:
            dev_rows, dev_pos = rows.to(self.device), lens.to(self.device)
            K[dev_rows, :, dev_pos] = k[:, :, 0]
            V[dev_rows, :, dev_pos] = v[:, :, 0]
        self._lengths[layer, rows] += 1

    def read(self, layer: int, rows: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """What `rows` (sorted host ids; None: every row) attend to in `layer`: keys, values (n,
        n_kv_heads, S, head_dim) and a validity mask (n, 1, 1, S), or None when every returned
        slot is filled (S = longest row)."""
        rows = self._all_rows if rows is None else rows
        lens, b = self._fast_rows(layer, rows)
        K, V = self.k[layer], self.v[layer]
        S = int(lens.max())
        if b is not None:
            return K[b, :, :S], V[b, :, :S], None
        valid = torch.arange(S, device=self.device)[None, :] < lens.to(self.device)[:, None]
        if rows.numel() == self.batch_size:
            return K[:, :, :S], V[:, :, :S], valid[:, None, None, :]
        dev_rows = rows.to(self.device)
        return K[dev_rows, :, :S], V[dev_rows, :, :S], valid[:, None, None, :]


class CacheRows:
    """Some rows of a `KVCache` (sorted host indices), with the same protocol: the rows still
    generating, or those whose token takes a routed layer on a decode step."""

    def __init__(self, cache: KVCache, rows: Tensor) -> None:
        if not cache._positions.all():
            raise ValueError(
                "rows of a KV cache are for decode steps: prefill the whole batch first"
            )
        self.cache, self.rows = cache, _check_rows(rows, cache.batch_size)
        self.max_len, self.device, self.dtype = cache.max_len, cache.device, cache.dtype

    def positions(self) -> Tensor:
        return self.cache._positions[self.rows]

    def write_prefill(self, layer: int, k: Tensor, v: Tensor, take_BT: Tensor | None) -> None:
        raise ValueError("a prefill fills every row of the cache: run the whole batch")

    def append(self, layer: int, k: Tensor, v: Tensor) -> None:
        self.cache.append(layer, k, v, self.rows)

    def read(self, layer: int) -> tuple[Tensor, Tensor, Tensor | None]:
        return self.cache.read(layer, self.rows)

    def subset(self, rows: Tensor) -> CacheRows:
        return CacheRows(self.cache, self.rows[_check_rows(rows, len(self.rows))])

    def advance(self, counts: Tensor | int) -> None:
        self.cache.advance(counts, self.rows)


def _check_rows(rows: Tensor, n: int) -> Tensor:
    """`rows` as a host long tensor of strictly increasing indices in [0, n), or a ValueError."""
    rows = torch.as_tensor(rows).cpu()
    if rows.dtype.is_floating_point or rows.dtype == torch.bool or rows.dim() != 1 or not len(rows):
        raise ValueError(f"rows must be a non-empty 1-d tensor of integer indices, got {rows!r}")
    rows = rows.long()
    if (rows[1:] <= rows[:-1]).any() or rows[0] < 0 or rows[-1] >= n:
        raise ValueError(
            f"rows must be strictly increasing indices in [0, {n}), got {rows.tolist()}"
        )
    return rows
