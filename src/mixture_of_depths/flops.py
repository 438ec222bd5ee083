"""Analytic FLOPs and KV-cache bytes of a MoD model, per layer, beside its dense twin.

Conventions (those of `torch.utils.flop_counter.FlopCounterMode`): a multiply-add is 2 FLOPs; only
matrix products count (projections, attention products, router, predictor, LM head); norms, RoPE,
softmax, activations, gathers and the embedding lookup count 0. The `forward` total of the top-k
forward pass counts attention as FlopCounterMode does: the full QK^T and AV products over the n
tokens a block processes, with no causal discount (``2 * 2 * n * n * heads * head_dim`` per
sequence). The causal-effective attention (only the n(n+1)/2 query-key pairs a causal mask keeps)
is given separately as `attention_causal`. A routed block processes
``n = capacity_tokens(capacity, seq_len)`` tokens in top-k mode.

Training is forward + backward: a matmul's backward computes the gradients of both its inputs,
twice its forward FLOPs, except where an input needs none: the predictor reads a detached stream,
so its first layer's backward only computes the weight gradient.

Decode is an expectation per generated token at a given context length, from the share of tokens
that take each routed layer (`take_rate`, the capacity by default): a routed layer costs its router
(and predictor) always, and its block and attention over the keys it caches only when taken.

With ``skipped_kv="residual"`` a routed layer also projects the key and value of every token that
skips it (training and decode), its queries attend over all tokens' keys, and it caches every
token: KV bytes per token as a dense layer's. With ``routing="mlp"`` a routed layer's attention is
a dense layer's (every token, every key, every token cached) and only its MLP is routed. With
``routing="mlp_kv"`` every token projects a query and the output, the takers alone a key and a
value (and the MLP), and each query reads the takers' keys: the top-k forward multiplies its T
queries by the k takers' keys (mlp_kv.py); a routed layer caches its takers.

Every figure is a sum of the layer kinds' own cost functions (`model.BLOCKS[kind].cost`, priced by
the modules in layers.py), so a new block kind brings its FLOPs with it. A recursive model
(Mixture-of-Recursions, docs/mor.md) is priced per application of a layer (`layer_schedule`) by
recursion.py's cost functions: a routed step's tokens, its router, its keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .checks import POSITIVE_INT, Range
from .config import LAYER_KINDS, MoDConfig
from .experts import expert_share_bound
from .layers import Attention
from .model import BLOCKS
from .recursion import decode_flops, forward_costs


@dataclass
class LayerFlops:
    """FLOPs of one layer for one forward pass over a batch (top-k routing)."""

    layer: int
    kind: str  # "D" dense or "R" routed; "r<step>" a routed recursion step's application
    tokens: int  # queries of the block's attention per sequence (all, with "mlp" or "mlp_kv")
    matmul: float  # q/k/v/o projections and the MLP
    attention: float  # QK^T and AV, full products (FlopCounterMode's count)
    attention_causal: float  # QK^T and AV over the query-key pairs a causal mask keeps
    router: float  # MoD's routers and the expert router
    predictor: float
    expert_share: float | None = None  # share of the expert slots that ran a real expert

    @property
    def forward(self) -> float:
        return self.matmul + self.attention + self.router + self.predictor


@dataclass
class FlopReport:
    config: MoDConfig
    seq_len: int
    batch_size: int
    layers: list[LayerFlops]
    lm_head: float
    embedding: float = 0.0  # a lookup
    take_rate: list[float] = field(default_factory=list)  # per routed layer, for decode
    decode_context: int = 0
    decode_per_token: float = 0.0
    kv_bytes_per_token: float = 0.0  # bytes per token of context, all layers
    bytes_per_element: int = 2
    dense: FlopReport | None = None

    @property
    def forward(self) -> float:
        """Top-k forward pass, counted as FlopCounterMode counts it."""
        return sum(lf.forward for lf in self.layers) + self.lm_head + self.embedding

    @property
    def forward_causal(self) -> float:
        """The forward pass with only the causal half of each attention product."""
        return self.forward - sum(lf.attention - lf.attention_causal for lf in self.layers)

    @property
    def train(self) -> float:
        """One training step's forward + backward (see the module docstring)."""
        predictor_fc1 = sum(lf.predictor for lf in self.layers) * self._predictor_fc1_share
        return 3 * self.forward - predictor_fc1

    @property
    def train_causal(self) -> float:
        """`train` with only the causal half of each attention product: the work a causal
        attention kernel that skips masked blocks does, and what speed predictions use."""
        return self.train - 3 * (self.forward - self.forward_causal)

    @property
    def forward_per_token(self) -> float:
        return self.forward / (self.batch_size * self.seq_len)

    @property
    def _predictor_fc1_share(self) -> float:
        """The predictor's first layer reads a detached stream: no input gradient there."""
        d, h = self.config.d_model, self.config.predictor_hidden
        return d * h / (d * h + h) if self.config.has_predictor else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = {
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "forward": self.forward,
            "forward_causal": self.forward_causal,
            "forward_per_token": self.forward_per_token,
            "train": self.train,
            "train_causal": self.train_causal,
            "lm_head": self.lm_head,
            "embedding": self.embedding,
            "decode_context": self.decode_context,
            "decode_per_token": self.decode_per_token,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "take_rate": self.take_rate,
            "layers": [{**asdict(lf), "forward": lf.forward} for lf in self.layers],
        }
        if self.dense is not None:
            out["dense"] = self.dense.to_dict()
        return out


# The sub-blocks, (attention, MLP) by index, that only a route kind's takers run: "mlp_kv"'s
# attention runs every token's query (its takers are the keys alone).
ROUTED_SUBBLOCKS = {"block": (0, 1), "attn": (0,), "mlp": (1,), "mlp_kv": (1,)}


def _take_rates(cfg: MoDConfig, take_rate: float | list[float] | None) -> list[float]:
    n_routed = len(cfg.recursion_routed_steps or cfg.routed_layers)
    if cfg.recursive and take_rate is None:  # each step's capacity (token choice: balanced)
        return [cfg.recursion_capacity(r) for r in cfg.recursion_routed_steps]
    if take_rate is None:
        takes = [cfg.capacity] * n_routed
    elif isinstance(take_rate, int | float):
        takes = [float(take_rate)] * n_routed
    else:
        takes = [float(t) for t in take_rate]
    if len(takes) != n_routed or not all(0 <= t <= 1 for t in takes):
        raise ValueError(
            f"take_rate must be one share in [0, 1] or one per routed layer or recursion step "
            f"({n_routed}), got {take_rate!r}"
        )
    return takes


def _expert_shares(cfg: MoDConfig, share: float | list[float] | None) -> list[float] | None:
    if share is None:
        return None
    if not cfg.has_experts:
        raise ValueError(f"expert_share is for expert layers (n_experts > 0), got {share!r}")
    shares = [float(share)] * cfg.n_layers if isinstance(share, int | float) else list(share)
    if len(shares) != cfg.n_layers or not all(0 <= s <= 1 for s in shares):
        raise ValueError(
            f"expert_share must be one share in [0, 1] or one per layer ({cfg.n_layers}), "
            f"got {share!r}"
        )
    return shares


def estimate_flops(
    config: MoDConfig,
    seq_len: int,
    batch_size: int = 1,
    *,
    take_rate: float | list[float] | None = None,
    decode_context: int | None = None,
    bytes_per_element: int = 2,
    with_dense: bool = True,
    expert_share: float | list[float] | None = None,
) -> FlopReport:
    """FLOPs of `config` on `batch_size` sequences of `seq_len` tokens, per layer and in total:
    the sum of each layer kind's own cost function (`BLOCKS[kind].cost`).

    `take_rate`: share of generated tokens that take each routed layer, for the decode figures
    (default: the capacity). `decode_context`: context length of the decode estimate (default:
    `seq_len`). `bytes_per_element`: of the KV cache (2 for bf16). With `with_dense`, the dense
    twin's report is attached as `.dense`.

    `expert_share` (expert layers only): the share of token slots that ran a real expert, one
    share or one per layer; the rest chose a no-op expert or were dropped and cost nothing.
    Default: the bound, the most the layers can run: 1, or with a capacity factor the
    capacity's ``n_experts * capacity / slots`` (training's top-k forward drops; decoding does
    not, so with a capacity factor the decode figure assumes 1, given shares or not). Pass
    measured shares for the FLOPs a run actually spent.
    """
    POSITIVE_INT.check("seq_len", seq_len)
    POSITIVE_INT.check("batch_size", batch_size)
    Range(lo=1, integer=True, optional=True).check("decode_context", decode_context)
    cfg, B, T = config, batch_size, seq_len
    takes = _take_rates(cfg, take_rate)
    given = _expert_shares(cfg, expert_share)
    context = seq_len if decode_context is None else decode_context
    if cfg.recursive:
        layers = _recursion_flops(cfg, B, T)
        decode, cached = _recursion_decode(cfg, takes, context)
    else:
        layers = [_layer_flops(cfg, i, B, T, given) for i in range(cfg.n_layers)]
        decode, cached = _decode_estimate(cfg, takes, context, given)
    lm_head_tok = 2 * cfg.d_model * cfg.vocab_size
    report = FlopReport(
        config=cfg,
        seq_len=T,
        batch_size=B,
        layers=layers,
        lm_head=B * T * lm_head_tok,
        take_rate=takes,
        decode_context=context,
        decode_per_token=decode,
        kv_bytes_per_token=sum(cached) * Attention.kv_entry(cfg) * bytes_per_element,
        bytes_per_element=bytes_per_element,
    )
    if with_dense and (not cfg.is_dense or cfg.has_experts or cfg.recursive):
        report.dense = estimate_flops(
            cfg.dense_twin(),
            seq_len,
            batch_size,
            decode_context=context,
            bytes_per_element=bytes_per_element,
            with_dense=False,
        )
    return report


def _layer_flops(cfg: MoDConfig, i: int, B: int, T: int, given: list[float] | None) -> LayerFlops:
    """Layer `i`'s FLOPs on B sequences of T tokens, top-k (FlopCounterMode's count) and with
    the attention pairs a causal mask keeps."""
    kind = cfg.layer_kinds[i]
    block = BLOCKS[kind]
    share = None
    if cfg.has_experts:  # the tokens of the whole batch that reach the expert layer
        mlp_tokens = cfg.capacity_tokens(T) if LAYER_KINDS[kind].routed else T
        share = expert_share_bound(cfg, B * mlp_tokens) if given is None else given[i]
    es = 1.0 if share is None else share
    # top-k, full attention products (FlopCounterMode's count)
    full = block.cost(cfg, T, expert_share=es)
    n = full.attn_tokens
    # the pairs a causal mask keeps: n(n+1)/2 among n tokens; about half of each query's
    # keys when the keys are all T tokens ("residual"), the chosen queries spread evenly
    keys = full.kv_entries / n if n else 0.0
    causal = block.cost(cfg, T, keys=(keys + 1) / 2, expert_share=es)
    return LayerFlops(
        layer=i,
        kind=kind,
        tokens=int(n),
        matmul=B * full.matmul,
        attention=B * full.attention,
        attention_causal=B * causal.attention,
        router=B * full.router,
        predictor=B * full.predictor,
        expert_share=share,
    )


def _recursion_flops(cfg: MoDConfig, B: int, T: int) -> list[LayerFlops]:
    """A recursive model's applications of its layers, in forward order."""
    out = []
    for (layer, step), (full, causal) in zip(
        cfg.layer_schedule, forward_costs(cfg, T), strict=True
    ):
        routed = step in cfg.recursion_routed_steps
        out.append(
            LayerFlops(
                layer=layer,
                kind=f"r{step}" if routed else "D",
                tokens=int(full.attn_tokens),
                matmul=B * full.matmul,
                attention=B * full.attention,
                attention_causal=B * causal.attention,
                router=B * full.router,
                predictor=B * full.predictor,
            )
        )
    return out


def _recursion_decode(
    cfg: MoDConfig, takes: list[float], context: int
) -> tuple[float, list[float]]:
    """FLOPs per decoded token and the share of the context each KV-cache layer holds."""
    by_step = dict(zip(cfg.recursion_routed_steps, takes, strict=True))
    per_app = [by_step.get(r, 1.0) for _, r in cfg.layer_schedule]
    flops = decode_flops(cfg, per_app, context) + 2.0 * cfg.d_model * cfg.vocab_size
    full = set(cfg.full_kv_layers)
    cached = [
        1.0 if i in full else (0.0 if cfg.recursion_kv == "share" else p)
        for i, p in enumerate(per_app)
    ]
    return flops, cached


def _decode_estimate(
    cfg: MoDConfig, takes: list[float], context: int, given: list[float] | None
) -> tuple[float, list[float]]:
    """FLOPs per decoded token at `context`, and the share of the context each layer caches.

    A new token takes each routed layer with probability p (its take-rate) and attends over the
    keys the layer caches: all of the context where every token stores a key (dense layers;
    routed ones with skipped_kv="residual" or routing="mlp"), else the same share p of it."""
    it, routed = iter(takes), set(cfg.routed_layers)
    p_layer = [next(it) if i in routed else 1.0 for i in range(cfg.n_layers)]
    full_kv = set(cfg.full_kv_layers)
    cached = [1.0 if i in full_kv else p for i, p in enumerate(p_layer)]
    # Decoding never drops: given shares that include capacity drops would undercount it.
    decode_share = given if cfg.expert_capacity_factor is None else None
    # (attention, MLP) shares; with routing="mlp" or "mlp_kv" every token queries
    attn_all = cfg.routing in ("mlp", "mlp_kv")
    takes_pp = [(1.0 if attn_all else p, p) for p in p_layer]
    decode, _ = decode_cost(cfg, takes_pp, cached, context, expert_share=decode_share)
    return decode, cached


def layer_shares(cfg: MoDConfig, per_router: Sequence[float]) -> list[tuple[float, float]]:
    """Per layer (attention share, MLP share) of the tokens that run it, from per-router shares in
    router order (`Topology.routes`, ``generate.router_names``): (1, 1) for a dense layer, (r, r)
    for joint routing, (r_attn, r_mlp) for staggered routing, (1, r_mlp) for MLP-only routing,
    (1, r) for ``routing="mlp_kv"`` (every token queries; the takers' share keys and runs the
    MLP). A recursive model's layers are all dense here (its steps are priced apart)."""
    shares = [[1.0, 1.0] for _ in range(cfg.n_layers)]
    if cfg.recursive:
        return [(a, m) for a, m in shares]
    for (layer, kind), r in zip(cfg.topology.routes, per_router, strict=True):
        for i in ROUTED_SUBBLOCKS[kind]:
            shares[layer][i] = r
    return [(a, m) for a, m in shares]


def decode_cost(
    cfg: MoDConfig,
    take: Sequence[tuple[float, float]],
    cached: Sequence[float],
    context: float,
    *,
    busy: Sequence[tuple[float, float]] | None = None,
    batch_size: int = 1,
    element_size: int = 2,
    expert_share: Sequence[float] | None = None,
) -> tuple[float, float]:
    """(FLOPs per decoded token, bytes read per decode step of `batch_size` rows), from each layer
    kind's cost function.

    Per layer: `take` (attention, MLP) shares of the decoded tokens that run it (`layer_shares`),
    `cached` the share of the `context` it holds, `busy` the shares of steps in which some row
    ran its attention and its MLP (its weights are read once per such step: at batch 8 and 12.5%
    about 1 - 0.875^8 = 66%; default: `take`, right at batch 1). Bytes: the weights read (the
    predictors every step; a router every step in aux-loss mode, in predictor mode only when some
    row takes its sub-block) plus each attending row's cached keys and values, plus the lm_head.
    Small-batch decoding is bound by these bytes more than by its FLOPs. `expert_share`: per
    layer, the share of expert slots that run a real expert (default 1: decoding never drops).
    """
    busy = take if busy is None else busy
    flops = 2.0 * cfg.d_model * cfg.vocab_size  # lm_head
    elements = float(cfg.d_model * cfg.vocab_size)
    shares = [1.0] * cfg.n_layers if expert_share is None else expert_share
    rows = zip(cfg.layer_kinds, take, busy, cached, shares, strict=True)
    for kind, (a, m), (ba, bm), c, es in rows:
        cost = BLOCKS[kind].cost
        work = cost(cfg, 1, attn=a, mlp=m, keys=c * context, expert_share=es)
        flops += work.flops
        # weights alone: keys left out (keys=0 would be a layer holding nothing, where an
        # "mlp_kv" layer projects no query)
        weights = cost(cfg, 1, attn=ba, mlp=bm, expert_share=es).params
        elements += weights + batch_size * work.kv_entries * Attention.kv_entry(cfg)
    return flops, elements * element_size


def _recursion_line(cfg: MoDConfig) -> str:
    caps = cfg.recursion_capacities
    steps = "token choice" if caps is None else ", ".join(f"{c:.1%}" for c in caps)
    return (
        f"; recursions {cfg.recursions} ({cfg.recursion_sharing}, recursion_kv "
        f"{cfg.recursion_kv}), step capacities: {steps}; kind r<step>: a routed step"
    )


def format_report(report: FlopReport) -> str:
    """A human table: per layer, totals, and the dense twin beside the model."""

    def g(x: float) -> str:
        return f"{x / 1e9:10.3f}"

    cfg = report.config
    lines = [
        f"FLOPs (GFLOP) for batch {report.batch_size} x {report.seq_len} tokens, top-k forward, "
        f"layers {cfg.layer_kinds}, capacity {cfg.capacity}, routing {cfg.routing}"
        + ("" if cfg.is_dense or cfg.recursive else f", skipped_kv {cfg.skipped_kv}")
        + (_recursion_line(cfg) if cfg.recursive else ""),
        f"{'layer':>5} {'kind':>4} {'tokens':>6} {'matmul':>10} {'attention':>10} "
        f"{'attn causal':>11} {'router':>10} {'predictor':>10} {'forward':>10}",
    ]
    for lf in report.layers:
        lines.append(
            f"{lf.layer:>5} {lf.kind:>4} {lf.tokens:>6} {g(lf.matmul)} {g(lf.attention)} "
            f"{g(lf.attention_causal):>11} {g(lf.router)} {g(lf.predictor)} {g(lf.forward)}"
        )
    lines.append(f"{'':>5} {'head':>4} {'':>6} {g(report.lm_head)}   (LM head; embedding 0)")
    rows = [
        ("forward (as FlopCounterMode)", report.forward, "forward"),
        ("forward, causal attention", report.forward_causal, "forward_causal"),
        ("training step (fwd + bwd)", report.train, "train"),
        ("forward per token", report.forward_per_token, "forward_per_token"),
        (
            f"decode per token @ {report.decode_context}",
            report.decode_per_token,
            "decode_per_token",
        ),
    ]
    d = report.dense
    lines.append("")
    lines.append(f"{'total':<30} {'this model':>14} {'dense twin':>14} {'ratio':>8}")
    for label, value, attr in rows:
        if d is None:
            lines.append(f"{label:<30} {value:>14.4g}")
        else:
            dv = getattr(d, attr)
            lines.append(f"{label:<30} {value:>14.4g} {dv:>14.4g} {value / dv:>8.3f}")
    kv = report.kv_bytes_per_token
    if d is None:
        lines.append(f"{'KV-cache bytes per token':<30} {kv:>14.4g}")
    else:
        lines.append(
            f"{'KV-cache bytes per token':<30} {kv:>14.4g} {d.kv_bytes_per_token:>14.4g} "
            f"{kv / d.kv_bytes_per_token:>8.3f}"
        )
    if cfg.has_experts:
        lines.append(
            f"experts: {cfg.n_experts} real (+{cfg.n_noop_experts} no-op), top-"
            f"{cfg.experts_per_token}; share of slots run by a real expert per layer "
            + ", ".join(f"{lf.expert_share:.1%}" for lf in report.layers)
            + " (as given, else the bound: the most the layers can run)"
        )
    if report.take_rate:
        lines.append("decode assumes take-rates " + ", ".join(f"{t:.1%}" for t in report.take_rate))
    return "\n".join(lines)
