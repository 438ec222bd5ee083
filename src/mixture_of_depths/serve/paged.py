"""`PagedKVCache`: the serving engine's KV cache, a pool of fixed-size pages per layer and a page
table per (row, layer), behind the model's `Cache` protocol (cache.py), so the model's one forward
runs unchanged on the live rows (docs/serving.md).

A layer's pages hold the tokens that layer caches, exactly as `KVCache` does (docs/kv.md): every
token in a dense layer (and in a routed one with ``skipped_kv="residual"`` or ``routing="mlp"``),
only the tokens that took it in any other routed layer (with ``routing="mlp_kv"`` an entry that
skips still reads what its row holds there). A row holds ``ceil(tokens / page_size)``
pages in each layer, allocated when a token lands on a fresh page and returned to the pool when the
row leaves, so the memory in use follows what each layer actually holds across the live requests.
A pool's storage is allocated lazily (it grows by half, up to its size in pages, lowest page ids
first), so the bytes allocated follow the pages in use too.

One forward is one `step` over *entries*: each entry is one token of one row at that row's next
position. A decoding row has one entry; a row prefilling a chunk of its prompt has one entry per
chunk token, in position order. Every entry runs the model as a decode row (one token, its own
rotary position), and attention in each layer reads, for each entry, the entries of its row that
the layer holds *up to its own*, which the same call has just appended: so a chunk of a prompt
attends causally to the row's earlier chunks and to itself, and a prefill chunk and the other
rows' decode steps are one batched forward. Causal routing decides per token from the token's own
stream, so this is the causal prefill: the decisions and values decoding would make
(docs/semantics.md).

Rows that have fed nothing yet skip the entries: `prefill(rows)` is a view (`PagedPrefill`) for the
model's own prefill of their prompts, right-padded into one forward (`generate.prefill`), whose
writes put each layer's takers straight onto the rows' pages, as `KVCache.write_prefill` does.
Both views go through generation's one driver pair (`generate.prefill`, `generate.decode_step`).

Names with shape suffixes: N entries of a step, R distinct rows among them, P pages, S slots.
"""

from __future__ import annotations

import heapq
import math
import os
from collections.abc import Sequence

import torch
from torch import Tensor

from ..config import MoDConfig
from ..static_cache import StaticCache


class PagePool:
    """One layer's pages: keys and values (pages, page_size, n_kv_heads, head_dim), a free list
    (lowest id first) and storage that grows as higher ids are handed out (`full`: allocated
    at once, with a trash page after the last, for a static step to write its skippers to)."""

    def __init__(self, n_pages: int, shape: tuple, dtype, device, full: bool = False) -> None:
        self.n_pages, self.page_size = n_pages, shape[0]
        self._shape = shape  # (page_size, n_kv_heads, head_dim)
        self.k = torch.zeros(n_pages + 1 if full else 0, *shape, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self._free = list(range(n_pages))  # a heap: sorted is a valid heap
        self.in_use = 0

    @property
    def free(self) -> int:
        return self.n_pages - self.in_use

    def allocate(self, n: int = 1) -> list[int]:
        """`n` pages, lowest ids first: all of them or none. A pool that runs dry, or whose
        storage fails to grow (out of memory), keeps every page it had, so a caller that fails
        part-way has nothing to give back (issue 54: pages taken before a failure were lost)."""
        if n > len(self._free):
            raise RuntimeError(f"KV page pool exhausted ({self.n_pages} pages)")
        pages = [heapq.heappop(self._free) for _ in range(n)]  # ascending: the last is largest
        try:
            if pages and pages[-1] >= self.k.shape[0]:
                self._grow(pages[-1] + 1)
        except BaseException:
            for page in pages:
                heapq.heappush(self._free, page)
            raise
        self.in_use += n
        return pages

    def _grow(self, need: int) -> None:
        """Storage for `need` pages at least: by half (at least 4), up to the pool's size; keys
        and values replaced together, so a failure leaves both as they were."""
        have = self.k.shape[0]
        new = min(self.n_pages, max(need, have * 3 // 2, 4))
        k, v = self.k.new_zeros(new, *self._shape), self.v.new_zeros(new, *self._shape)
        k[:have], v[:have] = self.k, self.v
        self.k, self.v = k, v

    def release(self, pages: Sequence[int]) -> None:
        for page in pages:
            heapq.heappush(self._free, page)
        self.in_use -= len(pages)

    @property
    def page_bytes(self) -> int:
        return 2 * math.prod(self._shape) * self.k.element_size()

    @property
    def nbytes_allocated(self) -> int:
        return self.k.shape[0] * self.page_bytes


def read_pages(pool: Tensor, idx: Tensor, rows: int) -> Tensor:
    """The pages `idx` (rows * P,) of `pool` (pages, page_size, H, D) as (rows, P * page_size,
    H, D): whole pages copied as flat rows (index_select), cheaper on a CPU than indexing the
    4-d pool with a 2-d table (an element-wise copy)."""
    flat = pool.view(pool.shape[0], -1).index_select(0, idx)
    return flat.view(rows, -1, *pool.shape[2:])


def pool_bytes(config: MoDConfig, n_pages: int, page_size: int, dtype: torch.dtype) -> int:
    """The bytes of every cache layer's pool of `n_pages` pages at full size (keys and values);
    the pools grow to it lazily."""
    per_page = 2 * page_size * config.n_kv_heads * config.head_dim * dtype.itemsize
    return config.n_kv_layers * n_pages * per_page


def device_memory(device: torch.device | str) -> int | None:
    """The memory of `device` in bytes (of the machine, for the CPU); None where unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    if device.type == "cpu" and hasattr(os, "sysconf"):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None


class PagedKVCache:
    """Pages per layer for the rows of a serving engine. Rows are added and freed by id;
    `step(rows, positions)` is one forward's view (the `Cache` protocol). With `static_rows`
    the pools are allocated at once and `static_step` gives the view of a static decode step
    over that many row slots (`PagedStatic`)."""

    def __init__(
        self,
        config: MoDConfig,
        n_pages: int,
        page_size: int = 16,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        static_rows: int = 0,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        row_pages = math.ceil(config.max_seq_len / page_size)
        if n_pages < row_pages:
            raise ValueError(
                f"kv_pages={n_pages} cannot hold one row at full context: max_seq_len="
                f"{config.max_seq_len} at page_size={page_size} needs {row_pages} pages per layer"
            )
        need, have = pool_bytes(config, n_pages, page_size, dtype), device_memory(device)
        if have is not None and need > have:
            raise ValueError(
                f"kv_pages={n_pages}: the page pools would take {need / 2**30:,.1f} GiB at full "
                f"size, more than the {have / 2**30:,.1f} GiB of memory of {device}"
            )
        self.config, self.page_size, self.max_len = config, page_size, config.max_seq_len
        self.device, self.dtype = torch.device(device), dtype
        shape = (page_size, config.n_kv_heads, config.head_dim)
        self.pools = [
            PagePool(n_pages, shape, dtype, self.device, static_rows > 0)
            for _ in range(config.n_kv_layers)  # one per application of a layer (MoR)
        ]
        self.tables: dict[int, list[list[int]]] = {}  # row -> per layer, its pages in order
        self.lengths: dict[int, list[int]] = {}  # row -> per layer, the tokens it holds
        self.static = PagedStatic(self, static_rows) if static_rows else None
        self.slots: dict[int, int] = {}  # row -> its slot in the static step's batch
        self._free_slots = list(range(static_rows))  # a heap
        self._ahead: list[tuple[int, int]] = []  # (row, layer): a page a static step took ahead

    # -- rows -----------------------------------------------------------------------------------
    def add_row(self, row: int) -> None:
        if row in self.tables:
            raise ValueError(f"row {row} is already in the cache")
        self.tables[row] = [[] for _ in self.pools]
        self.lengths[row] = [0] * len(self.pools)
        if self.static is not None:
            if not self._free_slots:
                raise RuntimeError(
                    f"every one of the {self.static.n_rows} static row slots is taken"
                )
            self.slots[row] = heapq.heappop(self._free_slots)

    def free_row(self, row: int) -> None:
        """Return the row's pages to the pools (nothing if the row is not here)."""
        tables = self.tables.pop(row, None)
        self.lengths.pop(row, None)
        if row in self.slots:
            slot = self.slots.pop(row)
            self.static.clear(slot)
            heapq.heappush(self._free_slots, slot)
        for pool, pages in zip(self.pools, tables or (), strict=False):
            pool.release(pages)

    def _take(self, row: int, layer: int, n: int) -> None:
        """`n` fresh pages at the end of the row's table in `layer` (none taken if the pool
        cannot give them all), mirrored into the static view's page table. The row's table
        holds them first, so that a failing mirror leaves them where `restore` and `free_row`
        return them."""
        pages = self.tables[row][layer]
        new = self.pools[layer].allocate(n)
        pages += new
        if row in self.slots:
            self.static.set_pages(layer, self.slots[row], len(pages) - n, new)

    def snapshot(self, rows: Sequence[int]) -> dict[int, tuple[list[int], list[int]]]:
        """Per row, the pages and tokens each layer holds: what `restore` undoes a failed
        forward to (taken every step: copies of the host's lists, no per-layer Python)."""
        return {r: (list(map(len, self.tables[r])), self.lengths[r][:]) for r in rows}

    def restore(self, held: dict[int, tuple[list[int], list[int]]]) -> None:
        """Return the pages and slots taken since `snapshot` (what they hold is never read)."""
        for row, (n_pages, lengths) in held.items():
            for pool, pages, n in zip(self.pools, self.tables[row], n_pages, strict=True):
                pool.release(pages[n:])
                del pages[n:]
            self.lengths[row] = lengths
            if row in self.slots:
                self.static.clear(self.slots[row], n_pages)
        self._ahead = []

    def pages_held(self, row: int) -> list[int]:
        return [len(pages) for pages in self.tables[row]]

    def worst_case_pages(self, row: int, tokens: int) -> list[int]:
        """Per layer, the pages `row` needs for `tokens` more tokens if every one of them takes
        every layer (a dense layer: exactly)."""
        ps = self.page_size
        return [
            math.ceil((n + tokens) / ps) - len(pages)
            for n, pages in zip(self.lengths[row], self.tables[row], strict=True)
        ]

    def max_new_tokens(self, row: int | None, free: Sequence[int]) -> int:
        """The most tokens `row` (None: a new, empty row) can add, whatever they take, with
        `free` pages per layer available to it."""
        ps = self.page_size
        if row is None:
            return min(f * ps for f in free)
        held, lens = self.tables[row], self.lengths[row]
        return min((f + len(h)) * ps - n for f, h, n in zip(free, held, lens, strict=True))

    # -- what is held ---------------------------------------------------------------------------
    def pages_in_use(self) -> list[int]:
        return [pool.in_use for pool in self.pools]

    def free_pages(self) -> list[int]:
        return [pool.free for pool in self.pools]

    @property
    def nbytes_in_use(self) -> int:
        return sum(pool.in_use * pool.page_bytes for pool in self.pools)

    @property
    def nbytes_allocated(self) -> int:
        return sum(pool.nbytes_allocated for pool in self.pools)

    # -- one forward ----------------------------------------------------------------------------
    def step(self, rows: Sequence[int], positions: Sequence[int]) -> PagedView:
        """The view of one forward: entry i is a token of `rows[i]` at `positions[i]`; a row's
        entries are consecutive, in position order, starting at the tokens it has processed."""
        return PagedView(_Step(self, list(rows), torch.tensor(list(positions), dtype=torch.long)))

    def prefill(self, rows: Sequence[int]) -> PagedPrefill:
        """The view of one prefill forward of the empty `rows`' right-padded prompts."""
        return PagedPrefill(self, list(rows))

    def static_step(
        self, rows: Sequence[int], positions: Sequence[int], tokens: Sequence[int]
    ) -> Tensor:
        """Set up the static view (`static`) for a decode step of `tokens`, one per row of
        `rows` at `positions`: a page taken in each layer where a row's next token would start
        one (the scheduler's worst case: the token may take every layer), then the slots' page
        tables, lengths and positions copied to the device from the host's (kept as pages come
        and go, not rebuilt per row), every other slot inactive. Returns the step's input, each
        row's token at its slot (N,). `static_done` follows the step."""
        lens = torch.tensor([self.lengths[row] for row in rows], dtype=torch.long)  # (n, L)
        self._ahead = []
        for i, layer in (lens % self.page_size == 0).nonzero().tolist():  # a host tensor
            self._take(rows[i], layer, 1)
            self._ahead.append((rows[i], layer))
        slots = [self.slots[row] for row in rows]
        return self.static.load(slots, lens, positions, tokens)

    def static_done(self, rows: Sequence[int], lengths: Tensor | None = None) -> None:
        """After a static step of `rows`: each layer's lengths (L, N slots), as the caller read
        them back in its step's one transfer (None: read here), and the pages taken ahead that
        no token reached returned."""
        lens = self.static.lengths.cpu() if lengths is None else lengths
        slots = torch.tensor([self.slots[row] for row in rows], dtype=torch.long)
        for row, held in zip(rows, lens[:, slots].T.tolist(), strict=True):
            self.lengths[row] = held
        for row, layer in self._ahead:
            pages, keep = self.tables[row][layer], -(-self.lengths[row][layer] // self.page_size)
            self.pools[layer].release(pages[keep:])
            del pages[keep:]
        self._ahead = []

    def _append(self, layer: int, rows: list[int]) -> list[tuple[int, int, int]]:
        """One slot per entry row, in order (a fresh page where a slot starts one): the
        (page, offset, slot) of each."""
        ps, out = self.page_size, []
        for row in rows:
            n = self.lengths[row][layer]
            if n >= self.max_len:
                raise RuntimeError(
                    f"row {row} holds max_len={self.max_len} tokens in layer {layer}"
                )
            if n % ps == 0:
                self._take(row, layer, 1)
            self.lengths[row][layer] = n + 1
            pages = self.tables[row][layer]
            out.append((pages[n // ps], n % ps, n))
        return out

    def _gather(self, layer: int, rows: list[int], upto: list[int]) -> tuple[Tensor, Tensor]:
        """Keys and values (R, n_kv_heads, S, head_dim) of each row's first `upto` slots, S the
        longest, padded with whatever the padding pages hold (masked by the caller)."""
        pool, ps = self.pools[layer], self.page_size
        S = max(upto)
        P = math.ceil(S / ps)
        table = []
        for row, n in zip(rows, upto, strict=True):
            pages = self.tables[row][layer][: -(-n // ps)]
            pad = pages[:1] or [0]  # a row holding nothing reads (masked) page 0
            table.append(pages + pad * (P - len(pages)))
        idx = torch.tensor(table, dtype=torch.long, device=self.device).view(-1)
        K, V = (read_pages(t, idx, len(rows))[:, :S].transpose(1, 2) for t in (pool.k, pool.v))
        return K, V


class PagedStatic(StaticCache):
    """The paged cache as a static decode step sees it (`static_cache.StaticDecoder`): a fixed
    batch of row slots over the same pools (as buffers), the slots' page tables (unused
    entries: the trash page), lengths, positions and which slots decode, on the device, set by
    `PagedKVCache.static_step` before each step. The page tables are kept on the host as pages
    are taken and freed (`set_pages`, `clear`) and copied to the device when they changed."""

    def __init__(self, cache: PagedKVCache, rows: int) -> None:
        super().__init__()
        self.n_rows, self.page_size = rows, cache.page_size
        self.max_len, self.device, self.dtype = cache.max_len, cache.device, cache.dtype
        self.trash = cache.pools[0].n_pages
        for layer, pool in enumerate(cache.pools):
            self.register_buffer(f"k{layer}", pool.k, persistent=False)
            self.register_buffer(f"v{layer}", pool.v, persistent=False)
        long = dict(dtype=torch.long, device=self.device)
        shape = (len(cache.pools), rows, math.ceil(cache.max_len / cache.page_size))
        self.register_buffer("table", torch.full(shape, self.trash, **long), False)
        self.register_buffer("lengths", torch.zeros(shape[:2], **long), False)
        self.register_buffer("pos", torch.zeros(rows, **long), False)
        self.register_buffer("active", torch.zeros(rows, dtype=torch.bool, device=cache.device))
        self.table_h = torch.full(shape, self.trash, dtype=torch.long)  # the host's copy
        self._dirty = False

    def set_pages(self, layer: int, slot: int, start: int, pages: list[int]) -> None:
        """The slot's pages `start:` in `layer` are `pages` (on the host until `load`)."""
        if len(pages) == 1:
            self.table_h[layer, slot, start] = pages[0]
        elif pages:
            self.table_h[layer, slot, start : start + len(pages)] = torch.tensor(pages)
        self._dirty = True

    def clear(self, slot: int, starts: Sequence[int] | None = None) -> None:
        """The slot's page entries (per layer from `starts`, else all) back to the trash page."""
        for layer, start in enumerate(starts or [0] * self.table_h.shape[0]):
            self.table_h[layer, slot, start:] = self.trash
        self._dirty = True

    def load(
        self, slots: Sequence[int], lens_NL: Tensor, positions: Sequence[int], tokens: Sequence[int]
    ) -> Tensor:
        """The step's state on the device: the page tables if they changed, the decoding
        slots' lengths (`lens_NL`, host (n, layers)) and positions, the other slots inactive.
        Returns each slot's token (N,) on the device."""
        s = torch.tensor(slots, dtype=torch.long)
        lens = torch.zeros(self.lengths.shape, dtype=torch.long)
        lens[:, s] = lens_NL.T
        pos, ids = torch.zeros(self.n_rows, dtype=torch.long), torch.zeros(self.n_rows).long()
        pos[s], ids[s] = torch.tensor(positions), torch.tensor(tokens)
        active = torch.zeros(self.n_rows, dtype=torch.bool)
        active[s] = True
        if self._dirty:
            self.table.copy_(self.table_h)
            self._dirty = False
        for buf, value in ((self.lengths, lens), (self.pos, pos), (self.active, active)):
            buf.copy_(value)
        return ids.to(self.device)

    def place(self, layer: int, take_N: Tensor) -> tuple:
        """A taker's next slot: its page (taken ahead by `static_step`) and offset."""
        lens, ps = self.lengths[layer], self.page_size
        page = self.table[layer].gather(1, (lens // ps)[:, None])[:, 0]
        return torch.where(take_N, page, self.trash), lens % ps

    def read(self, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        """Every slot's pages of `layer` (as many as a row at full context): keys, values
        (N, n_kv_heads, S, head_dim) and the mask of filled slots."""
        table = self.table[layer]
        pools = getattr(self, f"k{layer}"), getattr(self, f"v{layer}")
        K, V = (read_pages(t, table.view(-1), len(table)).transpose(1, 2) for t in pools)
        valid = torch.arange(K.shape[2], device=self.device) < self.lengths[layer][:, None]
        return K, V, valid[:, None, None, :]


class _Step:
    """What the views of one forward share: the entries' rows and positions, and per layer the
    slot each entry wrote (-1: none yet), which bounds what the entry reads."""

    def __init__(self, cache: PagedKVCache, rows: list[int], positions: Tensor) -> None:
        self.cache, self.rows, self.positions = cache, rows, positions
        self.slots = [[-1] * len(rows) for _ in cache.pools]
        self.one_each = len(set(rows)) == len(rows)  # decoding: one entry per row

    def upto(self, layer: int) -> list[int]:
        """Per entry, the slots of its row in `layer` at or before the entry's place: up to the
        last slot its row's entries up to it appended, else all the row held before this step
        (an entry that appended nothing, a skipper of a ``routing="mlp_kv"`` layer, reads)."""
        slots, lengths = self.slots[layer], self.cache.lengths
        if self.one_each:  # an entry's row holds up to it: what it held, and what it appended
            return [lengths[row][layer] for row in self.rows]
        held = {row: lengths[row][layer] for row in self.rows}
        for row, slot in zip(self.rows, slots, strict=True):
            held[row] -= slot >= 0  # appended by this step: not held before it
        out = []
        for row, slot in zip(self.rows, slots, strict=True):
            if slot >= 0:
                held[row] = slot + 1
            out.append(held[row])
        return out


class PagedView:
    """Some entries of one step (sorted host indices) with the model's `Cache` protocol."""

    def __init__(self, step: _Step, entries: Tensor | None = None) -> None:
        self._step = step
        n = len(step.rows)
        self.entries = list(range(n)) if entries is None else [int(i) for i in entries]
        cache = step.cache
        self.max_len, self.device, self.dtype = cache.max_len, cache.device, cache.dtype

    def positions(self) -> Tensor:
        return self._step.positions[self.entries].clone()

    def subset(self, rows: Tensor) -> PagedView:
        picked = torch.as_tensor(rows).cpu().tolist()
        return PagedView(self._step, torch.tensor([self.entries[i] for i in picked]))

    def advance(self, counts: Tensor | int) -> None:
        """Nothing: the engine owns each row's position and moves it after the step; the layers'
        lengths moved as entries were appended."""

    def append(self, layer: int, k: Tensor, v: Tensor) -> None:
        """One key and value (n, n_kv_heads, 1, head_dim) per entry of this view."""
        step, cache = self._step, self._step.cache
        where = cache._append(layer, [step.rows[e] for e in self.entries])
        for e, (_, _, slot) in zip(self.entries, where, strict=True):
            step.slots[layer][e] = slot
        pool, ps = cache.pools[layer], cache.page_size
        at = torch.tensor([p * ps + o for p, o, _ in where], device=cache.device)
        for buf, new in ((pool.k, k), (pool.v, v)):  # one flat row per slot: index_copy_
            buf.view(-1, *buf.shape[2:]).index_copy_(0, at, new[:, :, 0].to(cache.dtype))

    def read(self, layer: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """For each entry, what its row holds in `layer` up to the entry's own place: keys,
        values (n, n_kv_heads, S, head_dim) and a validity mask (n, 1, 1, S), None when every
        entry sees all S slots."""
        step = self._step
        every = step.upto(layer)
        upto = [every[e] for e in self.entries]
        rows = [step.rows[e] for e in self.entries]
        if max(upto) == 0:  # nothing held (routing="mlp_kv": no taker yet)
            pool = step.cache.pools[layer]
            empty = pool.k.new_zeros(len(rows), pool.k.shape[2], 0, pool.k.shape[3])
            return empty, empty, None
        distinct = list(dict.fromkeys(rows))
        if len(distinct) == len(rows):  # one entry per row (decoding): no duplicates to expand
            K, V = step.cache._gather(layer, rows, upto)
        else:  # a prefill chunk: gather each row once, then one view per entry
            most = {}
            for row, n in zip(rows, upto, strict=True):
                most[row] = max(most.get(row, 0), n)
            K, V = step.cache._gather(layer, distinct, [most[r] for r in distinct])
            if len(distinct) == 1:  # one row's chunk alone: views, no copies
                K, V = K.expand(len(rows), *K.shape[1:]), V.expand(len(rows), *V.shape[1:])
            else:
                which = torch.tensor([distinct.index(r) for r in rows], device=K.device)
                K, V = K[which], V[which]
        S = K.shape[2]
        if all(n == S for n in upto):
            return K, V, None
        lens = torch.tensor(upto, device=K.device)
        valid = torch.arange(S, device=K.device)[None, :] < lens[:, None]
        return K, V, valid[:, None, None, :]

    def write_prefill(self, layer: int, k: Tensor, v: Tensor, take_BT: Tensor | None) -> None:
        """A forward in which every entry is at position 0 runs as the model's prefill of
        one-token prompts: store the entries that take the layer (all when None)."""
        if k.shape[2] != 1:
            raise ValueError(
                f"a paged step feeds one token per entry, got a prefill of {k.shape[2]} tokens"
            )
        if take_BT is None:
            self.append(layer, k, v)
            return
        sel = take_BT.view(-1).cpu().nonzero().view(-1)
        if len(sel):
            self.subset(sel).append(layer, k[sel.to(k.device)], v[sel.to(k.device)])


class PagedPrefill:
    """Empty rows run as the model's prefill (one right-padded forward, position 0 on): each
    layer's write stores, per row, the prompt tokens that take it, in order, on fresh pages."""

    def __init__(self, cache: PagedKVCache, rows: list[int]) -> None:
        if any(any(cache.lengths[row]) for row in rows):
            raise ValueError("a paged prefill is for empty rows")
        self.cache, self.rows = cache, rows
        self.max_len, self.device, self.dtype = cache.max_len, cache.device, cache.dtype

    def positions(self) -> Tensor:
        return torch.zeros(len(self.rows), dtype=torch.long)

    def advance(self, counts: Tensor | int) -> None:
        """Nothing: the engine moves each row's position after the step."""

    def write_prefill(self, layer: int, k: Tensor, v: Tensor, take_BT: Tensor | None) -> None:
        """`k`, `v`: (B, n_kv_heads, T, head_dim) of the padded prompts; store each row's tokens
        with `take_BT` set (all T when None) in the row's empty `layer`."""
        B, _, T, _ = k.shape
        cache, ps = self.cache, self.cache.page_size
        pool = cache.pools[layer]
        counts = [T] * B if take_BT is None else take_BT.sum(1).cpu().tolist()
        at = []  # each stored token's flat slot in the pool
        for row, n in zip(self.rows, counts, strict=True):
            cache._take(row, layer, -(-n // ps))
            cache.lengths[row][layer] = n
            pages = cache.tables[row][layer]
            at += [pages[j // ps] * ps + j % ps for j in range(n)]
        if not at:
            return
        k_NHD, v_NHD = k.transpose(1, 2), v.transpose(1, 2)  # (B, T, H, D)
        if take_BT is None:
            k_NHD, v_NHD = k_NHD.flatten(0, 1), v_NHD.flatten(0, 1)
        else:  # a boolean (B, T) index keeps row-major order: each row's takers in order
            take = take_BT.to(k.device)
            k_NHD, v_NHD = k_NHD[take], v_NHD[take]
        at_t = torch.tensor(at, device=cache.device)
        for buf, new in ((pool.k, k_NHD), (pool.v, v_NHD)):
            buf.view(-1, *buf.shape[2:]).index_copy_(0, at_t, new.to(cache.dtype))

    def _refuse(self, *args: object) -> None:
        raise RuntimeError("a paged prefill only writes its prompts (no decode-step calls)")

    append = read = subset = _refuse
