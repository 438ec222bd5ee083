"""Causal sampling from MoD models with a KV cache that holds only the tokens that took each block.

Top-k routing reads the whole sequence, so it cannot decide for a token that has not been seen
yet. Generation therefore uses the causal decision (docs/semantics.md): a token takes a routed
block iff its router logit (``aux_loss`` mode) or its predictor logit (``predictor`` mode) is > 0.
Prefill in ``"causal"`` mode makes exactly the decisions decoding makes, so cached generation
equals running the full causal forward again at every step (`generate_reference`, the slow path
the tests compare against). ``prefill="topk"`` routes the prompt with the paper's top-k over the
prompt instead: the cache then holds what top-k chose, which decoding would not have chosen, so it
is an approximation.

`prefill` and `decode_step` are short drivers around `MoDTransformer.forward` with a KV cache:
the model's one forward path does the work. In a decode step a routed (sub-)block runs only on the
rows whose new token takes it; rows that skip do no work there and add nothing to that layer's
cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from .cache import Cache, KVCache
from .checks import NONNEGATIVE, NONNEGATIVE_INT, Range, token_tensor
from .model import MoDTransformer
from .precision import at_least_float32
from .routing import Route

PREFILL_MODES = ("causal", "topk")
# Temperatures below this are greedy, as in vLLM: `logits / t` overflows float32 below ~1e-38
# (NaN probabilities), and long before that a draw differs from the argmax only between
# near-tied logits (docs/serving.md).
GREEDY_BELOW = 1e-5


@dataclass
class GenerationStep:
    """One sampled token for each row still generating."""

    rows: list[int]
    tokens: list[int]
    logits: Tensor | None = None  # (len(rows), vocab): what each token was sampled from


@dataclass
class GenerationOutput:
    """`tokens[b]`: the new tokens of row b (a final EOS included).

    `routing[b]` (with ``return_routing``): bool (prompt_len + len(tokens[b]), n_routers), which
    routers each token took, in the order of `router_names`; a final EOS is never fed back, so its
    row is all False. `logits[b]` (with ``return_logits``): (len(tokens[b]), vocab).
    """

    tokens: list[list[int]]
    router_names: list[str] = field(default_factory=list)
    routing: list[Tensor] | None = None
    logits: list[Tensor] | None = None


def router_names(model: MoDTransformer) -> list[str]:
    return model.route_names()


# -- input checks ---------------------------------------------------------------------------------
def right_pad(rows: Sequence[Sequence[int]], device: torch.device | str) -> tuple[Tensor, Tensor]:
    """Token lists as one right-padded batch of ids (B, longest) on `device` (the padding is
    id 0, which no real token attends to: `lengths`) and their lengths (B,) on the host. The
    one padding of prompts: `generate`, `static_generate` and the server's prefill."""
    lens = torch.tensor([len(row) for row in rows], dtype=torch.long)
    idx = torch.zeros(len(rows), int(lens.max()), dtype=torch.long)
    for b, row in enumerate(rows):
        idx[b, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    return idx.to(device), lens


def prompt_batch(
    model: MoDTransformer,
    prompts: Tensor | Sequence[Sequence[int]],
    max_new_tokens: int,
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """Right-padded (B, T) ids on `device` and host prompt lengths (B,)."""
    cfg = model.config
    if isinstance(prompts, Tensor):
        if prompts.dim() != 2:
            raise ValueError(
                f"a prompt tensor must be (batch, seq_len), got {tuple(prompts.shape)}"
            )
        rows = token_tensor(prompts, cfg.vocab_size, "prompts").tolist()
    elif isinstance(prompts, str | bytes) or not isinstance(prompts, Iterable):
        raise ValueError(
            f"prompts must be a list of token-id lists or a (batch, seq_len) tensor, got "
            f"{type(prompts).__name__} (encode text with the tokenizer first)"
        )
    else:
        rows = []
        for b, p in enumerate(prompts):
            if isinstance(p, str | bytes) or not isinstance(p, Iterable):
                raise ValueError(f"prompt {b} must be a list of token ids, got {p!r}")
            rows.append(token_tensor(list(p), cfg.vocab_size, f"prompt {b}").tolist())
    if not rows:
        raise ValueError("prompts is empty: give at least one prompt")
    for b, row in enumerate(rows):
        if not row:
            raise ValueError(f"prompt {b} is empty: each prompt needs at least one token")
        if len(row) + max_new_tokens > cfg.max_seq_len:
            raise ValueError(
                f"prompt {b} has {len(row)} tokens; with max_new_tokens={max_new_tokens} that is "
                f"{len(row) + max_new_tokens} positions, more than max_seq_len={cfg.max_seq_len}. "
                "Shorten the prompt or ask for fewer tokens."
            )
    return right_pad(rows, device)


def _check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    NONNEGATIVE.check("temperature (0 is greedy)", temperature)
    Range(lo=1, integer=True, optional=True).check("top_k", top_k)
    Range(lo=0, hi=1, lo_open=True, optional=True).check("top_p", top_p)


def sample_next(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Next token per row from logits (n, vocab): greedy at a temperature below `GREEDY_BELOW`
    (0 included), else top-k/top-p."""
    if temperature < GREEDY_BELOW:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


# -- the drivers: the model's own forward, with a cache ------------------------------------------
def routing_table(routes: list[Route], batch: int, seq_len: int, host: bool = True) -> Tensor:
    """The routes' decisions as one bool tensor (B, T, n_routers), routers in layer order, on
    the host (`host=False`: where the masks are, for a caller that reads them later)."""
    if not routes:
        return torch.zeros(batch, seq_len, 0, dtype=torch.bool)
    table = torch.stack([r.mask for r in routes], -1)
    return table.cpu() if host else table


@torch.no_grad()
def prefill(
    model: MoDTransformer,
    idx_BT: Tensor,
    lens: Tensor,
    cache: Cache,
    mode: str = "causal",
    host: bool = True,
) -> tuple[Tensor, Tensor]:
    """Run right-padded prompts (B, T) with host lengths `lens` through the model, filling the
    empty `cache`. Returns the logits at each row's last prompt token (B, vocab) and the routing
    decisions (B, T, n_routers) on the host (`host=False`: where the model made them)."""
    B, T = idx_BT.shape
    out = model(idx_BT, routing=mode, cache=cache, lengths=lens, last_only=True)
    return out.logits[:, 0], routing_table(out.routes, B, T, host)


@torch.no_grad()
def decode_step(
    model: MoDTransformer, tokens: Tensor, cache: Cache, host: bool = True
) -> tuple[Tensor, Tensor]:
    """Feed one token (ids (n,)) to each row of `cache`, any `Cache` (a `KVCache` or some of its
    rows, a `StaticKVCache`, one step's entries of the server's paged cache); returns logits
    (n, vocab) and the routing decisions (n, n_routers) on the host (`host=False`: where the
    model made them). Positions come from the cache: each row's next one. With `prefill`, the
    one driver pair of every cache."""
    out = model(tokens.to(cache.device)[:, None], routing="causal", cache=cache, last_only=True)
    return out.logits[:, 0], routing_table(out.routes, len(tokens), 1, host)[:, 0]


# -- the loop -------------------------------------------------------------------------------------
class Generation:
    """One batched generation. `steps()` yields a `GenerationStep` per sampled token.

    As it runs, `prompt_routing` (B, T, n_routers) holds the prompt's routing decisions (after the
    first step) and `token_routing[b]` the decisions of each generated token fed back so far, so a
    caller can show routing while streaming. `feed_last` also feeds the final token, for its
    routing.
    """

    def __init__(
        self,
        model: MoDTransformer,
        prompts: Tensor | Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        eos_id: int | None,
        seed: int | None,
        prefill_mode: str,
        feed_last: bool,
    ) -> None:
        if prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {prefill_mode!r}")
        NONNEGATIVE_INT.check("max_new_tokens", max_new_tokens)
        Range(integer=True, optional=True).check("seed", seed)
        Range(integer=True, optional=True).check("eos_id", eos_id)
        _check_sampling(temperature, top_k, top_p)
        self.model, self.max_new_tokens, self.eos_id = model, max_new_tokens, eos_id
        self.sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        self.feed_last, self.prefill_mode = feed_last, prefill_mode
        param = next(model.parameters())
        self.device = param.device
        self.idx, self.lens = prompt_batch(model, prompts, max_new_tokens, self.device)
        self.generator = None
        if seed is not None:
            self.generator = torch.Generator(device=self.device).manual_seed(seed)
        cfg = model.config
        total = int(self.lens.max()) + max_new_tokens
        self.cache = KVCache(cfg, len(self.lens), total, self.device, param.dtype)
        self.prompt_routing: Tensor | None = None
        self.token_routing: dict[int, list[Tensor]] = {b: [] for b in range(len(self.lens))}

    @torch.no_grad()
    def steps(self) -> Iterator[GenerationStep]:
        model = self.model
        was_training = model.training
        model.eval()
        try:
            logits, self.prompt_routing = prefill(
                model, self.idx, self.lens, self.cache, self.prefill_mode
            )
            rows = torch.arange(len(self.lens))
            for step in range(self.max_new_tokens):
                tokens = sample_next(logits, generator=self.generator, **self.sampling)
                host = tokens.cpu()
                yield GenerationStep(rows.tolist(), host.tolist(), logits)
                keep = torch.ones(len(rows), dtype=torch.bool)
                if self.eos_id is not None:
                    keep = host != self.eos_id
                last = step == self.max_new_tokens - 1
                if not keep.any() or (last and not self.feed_last):
                    return
                rows, host = rows[keep], host[keep]
                view = self.cache if len(rows) == len(self.lens) else self.cache.subset(rows)
                logits, routing = decode_step(model, host, view)
                for i, b in enumerate(rows.tolist()):
                    self.token_routing[b].append(routing[i])
                if last:
                    return
        finally:
            model.train(was_training)


def stream(
    model: MoDTransformer,
    prompts: Tensor | Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    seed: int | None = None,
    prefill: str = "causal",
) -> Iterator[GenerationStep]:
    """Like `generate`, but yields each step's tokens as soon as they are sampled.

    Arguments are checked here, before the first step (this is not a generator function).
    """
    gen = Generation(
        model,
        prompts,
        max_new_tokens,
        temperature,
        top_k,
        top_p,
        eos_id,
        seed,
        prefill,
        feed_last=False,
    )
    return gen.steps()


def generate(
    model: MoDTransformer,
    prompts: Tensor | Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    seed: int | None = None,
    prefill: str = "causal",
    return_routing: bool = False,
    return_logits: bool = False,
) -> GenerationOutput:
    """Sample `max_new_tokens` per row (fewer where a row samples `eos_id`), causally, with a KV
    cache that holds only the tokens that took each layer.

    `prompts`: a (B, T) tensor or a list of token lists of any lengths. `temperature=0` (or any
    below `GREEDY_BELOW`) is greedy.
    `seed` makes sampling reproducible. `prefill`: "causal" (exact: the decisions decoding would
    make) or "topk" (the paper's top-k over the prompt; an approximation). Prompt length plus
    `max_new_tokens` must fit in the model's `max_seq_len`, else ValueError (nothing is truncated).
    """
    gen = Generation(
        model,
        prompts,
        max_new_tokens,
        temperature,
        top_k,
        top_p,
        eos_id,
        seed,
        prefill,
        feed_last=return_routing,
    )
    B = len(gen.lens)
    tokens: list[list[int]] = [[] for _ in range(B)]
    logits: list[list[Tensor]] = [[] for _ in range(B)]
    for st in gen.steps():
        for i, (b, t) in enumerate(zip(st.rows, st.tokens, strict=True)):
            tokens[b].append(t)
            if return_logits:
                logits[b].append(st.logits[i].to(at_least_float32(st.logits.dtype)).cpu())
    out = GenerationOutput(tokens=tokens, router_names=router_names(model))
    if return_logits:
        V = model.config.vocab_size
        out.logits = [torch.stack(rows) if rows else torch.zeros(0, V) for rows in logits]
    if return_routing:
        n_r = len(out.router_names)
        out.routing = []
        for b in range(B):
            prompt = gen.prompt_routing[b, : int(gen.lens[b])]
            fed = gen.token_routing[b]
            new = torch.stack(fed) if fed else torch.zeros(0, n_r, dtype=torch.bool)
            pad = torch.zeros(len(tokens[b]) - len(new), n_r, dtype=torch.bool)  # unfed EOS
            out.routing.append(torch.cat([prompt, new, pad]))
    return out


@torch.no_grad()
def generate_reference(
    model: MoDTransformer,
    prompts: Tensor | Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_id: int | None = None,
) -> GenerationOutput:
    """Slow greedy generation without a cache: the full causal forward again at every step, row
    by row. The oracle that cached generation must equal; returns tokens, logits and routing."""
    idx, lens = prompt_batch(model, prompts, max_new_tokens, next(model.parameters()).device)
    was_training = model.training
    model.eval()
    out = GenerationOutput(tokens=[], router_names=router_names(model), routing=[], logits=[])
    try:
        for b in range(len(lens)):
            seq = idx[b : b + 1, : int(lens[b])]
            new, step_logits = [], []
            for _ in range(max_new_tokens):
                logits = model(seq, routing="causal").logits[0, -1]
                tok = int(logits.argmax())
                new.append(tok)
                step_logits.append(logits.to(at_least_float32(logits.dtype)).cpu())
                if tok == eos_id:
                    break
                seq = torch.cat([seq, seq.new_tensor([[tok]])], dim=1)
            routing = routing_table(model(seq, routing="causal").routes, 1, seq.shape[1])[0]
            if len(new) and new[-1] == eos_id:  # a final EOS is never fed back
                routing = torch.cat([routing, torch.zeros(1, routing.shape[1], dtype=torch.bool)])
            out.tokens.append(new)
            out.logits.append(
                torch.stack(step_logits) if step_logits else torch.zeros(0, model.config.vocab_size)
            )
            out.routing.append(routing)
    finally:
        model.train(was_training)
    return out


@torch.no_grad()
def prefill_calibration(model: MoDTransformer, idx: Tensor, prompt_len: int) -> dict[str, float]:
    """How much a top-k prefill disagrees with the causal decoding that follows it.

    Each row of `idx` (B, T) is split into a prompt (its first `prompt_len` tokens) and a
    continuation. The prompt is prefilled into a KV cache with top-k routing (the paper's global
    choice over the prompt) or causal routing, then the continuation is fed token by token
    (teacher-forced, causal decisions) and scored: the loss of each prefill mode on the same
    targets, a number rather than a sample. Causal prefill is the exact one (it equals the full
    causal forward); top-k prefill caches what the later tokens' decisions never saw.

    Returns ``loss_causal_prefill`` and ``loss_topk_prefill`` (mean cross-entropy, nats, over the
    T - prompt_len predicted tokens of every row), their difference ``loss_gap`` (top-k minus
    causal), and ``decisions_differ``: the share of (prompt token, routed sub-block) decisions
    that differ between the two prefills.
    """
    B, T = idx.shape
    if not 1 <= prompt_len < T:
        raise ValueError(
            f"prompt_len must be in [1, {T - 1}] for sequences of {T}, got {prompt_len}"
        )
    param = next(model.parameters())
    was_training = model.training
    model.eval()
    idx = idx.to(param.device)
    losses, tables = {}, {}
    try:
        for mode in PREFILL_MODES:
            cache = KVCache(model.config, B, T, param.device, param.dtype)
            lens = torch.full((B,), prompt_len, dtype=torch.long)
            logits, tables[mode] = prefill(model, idx[:, :prompt_len], lens, cache, mode)
            steps = [logits]
            for t in range(prompt_len, T - 1):
                logits, _ = decode_step(model, idx[:, t], cache)
                steps.append(logits)
            scores = torch.stack(steps, 1).to(at_least_float32(param.dtype))
            target = idx[:, prompt_len:]
            losses[mode] = float(F.cross_entropy(scores.flatten(0, 1), target.flatten()))
    finally:
        model.train(was_training)
    differ = (tables["topk"] != tables["causal"]).float()
    return {
        "loss_causal_prefill": losses["causal"],
        "loss_topk_prefill": losses["topk"],
        "loss_gap": losses["topk"] - losses["causal"],
        "decisions_differ": float(differ.mean()) if differ.numel() else 0.0,
    }
