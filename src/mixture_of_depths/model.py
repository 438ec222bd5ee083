"""The Mixture-of-Depths transformer: RMSNorm, RoPE, attention, SwiGLU MLP, routers, blocks, model.

Semantics (see DESIGN.md section 1). In a routed block the router reads the residual stream,
``r = x @ w``; in top-k mode the ``k = capacity_tokens(capacity, T)`` highest-scoring tokens of each
row, sorted by position, are gathered, run through the block (attending only among themselves, at
their original rotary positions), and scattered back as ``x + g(r) * f`` where ``f`` is the block's
update; every other token leaves bit for bit unchanged. In causal mode each token decides for
itself (``sigmoid(logit) > 0.5``, i.e. ``logit > 0``, from the router or the predictor), so the
decision for a token never depends on later tokens.

Names with shape suffixes: B batch, T full sequence, K routed subset, D model width, H heads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import MoDConfig

ROUTING_CHOICES = ("topk", "causal")

# Generation's hook into attention: (new k, new v, mask) -> (keys, values, mask) to attend to.
KVHook = Callable[[Tensor, Tensor, Tensor | None], tuple[Tensor, Tensor, Tensor | None]] | None


def route_name(layer: int, kind: str) -> str:
    return str(layer) if kind == "block" else f"{layer}.{kind}"


@dataclass
class Route:
    """What one router did on one forward pass (returned, never stored on the module).

    `mask` (B, T) bool: the tokens this router sent through its sub-block. `logits` (B, T): raw
    router weights r. `target` (B, T) bool: top-k membership, the aux-loss target (equal to `mask`
    in top-k mode). `predictor_logits` (B, T): the causal predictor's logits, predictor mode only.
    """

    layer: int
    kind: str  # "block" (joint routing), "attn" or "mlp" (staggered routing)
    mask: Tensor
    logits: Tensor
    target: Tensor
    predictor_logits: Tensor | None = None

    @property
    def name(self) -> str:
        """``"<layer>"`` for joint routing, ``"<layer>.<kind>"`` for staggered routing."""
        return route_name(self.layer, self.kind)

    @property
    def decision_logits(self) -> Tensor:
        """Logits of the causal decision: the predictor's in predictor mode, else the router's."""
        return self.logits if self.predictor_logits is None else self.predictor_logits


@dataclass
class MoDOutput:
    logits: Tensor
    loss: Tensor | None = None
    lm_loss: Tensor | None = None
    aux_loss: Tensor | None = None
    routes: list[Route] = field(default_factory=list)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(
    head_dim: int,
    seq_len: int,
    theta: float,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """Rotary tables (seq_len, head_dim): ``cat(cos, cos)`` and ``cat(-sin, sin)`` of the angles.

    Computed in float64 and rounded once to `dtype`. Built per forward rather than kept as buffers,
    so `model.to(torch.bfloat16)` cannot round the angles of far positions and a float64 model
    gets float64 rotations. The signed, doubled layout makes `apply_rope` four ops.
    """
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    )
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64, device=device), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((cos, cos), -1).to(dtype), torch.cat((-sin, sin), -1).to(dtype)


def apply_rope(x_BHKd: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each pair (x[i], x[i + d/2]) by its angle: ``x1 cos - x2 sin, x2 cos + x1 sin``.

    cos/sin from `rope_tables`, broadcast to (B or 1, 1, K, d). Computed in at least float32.
    """
    x = x_BHKd.to(cos.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((x2, x1), -1) * sin).type_as(x_BHKd)


class Attention(nn.Module):
    def __init__(self, cfg: MoDConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        # One projection for q, k and v (rows in that order): one matmul instead of three.
        self.wqkv = nn.Linear(
            cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=False
        )
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def qkv(self, x_BKD: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys (both rotated) and values, shaped (B, heads, K, head_dim)."""
        B, K, _ = x_BKD.shape
        H, Hkv = self.n_heads, self.n_kv_heads
        qkv = self.wqkv(x_BKD).view(B, K, H + 2 * Hkv, self.head_dim).transpose(1, 2)
        qk, v = qkv.split((H + Hkv, Hkv), dim=1)
        q, k = apply_rope(qk, cos, sin).split((H, Hkv), dim=1)  # rotate q and k in one go
        return q, k, v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None) -> Tensor:
        """SDPA then the output projection.

        `attn_mask` None means causal: query i sees keys <= i when queries and keys are the same
        tokens, and a single query (a decode step) sees every key it is given.
        """
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            is_causal=attn_mask is None and q.shape[-2] > 1,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        B, _, K, _ = q.shape
        return self.wo(y.transpose(1, 2).reshape(B, K, self.n_heads * self.head_dim))

    def forward(
        self, x_BKD: Tensor, cos: Tensor, sin: Tensor, attn_mask: Tensor | None, kv: KVHook = None
    ) -> Tensor:
        q, k, v = self.qkv(x_BKD, cos, sin)
        if kv is not None:  # generation: store the new keys/values, attend to what the cache holds
            k, v, attn_mask = kv(k, v, attn_mask)
        return self.attend(q, k, v, attn_mask)


class MLP(nn.Module):
    """SwiGLU: w2(silu(x W1) * x W3), with W1 and W3 in one projection `w13` (rows: W1, then W3)."""

    def __init__(self, cfg: MoDConfig) -> None:
        super().__init__()
        self.w13 = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        a, b = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(a) * b)


class Predictor(nn.Module):
    """Small MLP that predicts top-k membership causally from the router's (detached) input."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = F.silu(_linear32(x, self.fc1))
        return _linear32(h, self.fc2).squeeze(-1)


def _linear32(x: Tensor, lin: nn.Linear) -> Tensor:
    """`lin(x)` in at least float32, also under bf16 autocast or in a bf16 model.

    Routing decisions compare logits with each other (top-k) and with 0 (causal): in bf16 they
    would tie often and flip between training (autocast) and generation (no autocast).
    """
    if x.dtype == lin.weight.dtype == torch.float32 and not torch.is_autocast_enabled(
        x.device.type
    ):
        return F.linear(x, lin.weight, lin.bias)  # already float32: skip the context (decode)
    dt = torch.promote_types(x.dtype, torch.float32)
    bias = None if lin.bias is None else lin.bias.to(dt)
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x.to(dt), lin.weight.to(dt), bias)


def topk_indices(r_BT: Tensor, k: int) -> Tensor:
    """Indices (B, k) of the k largest router weights per row, sorted ascending by position.

    A stable descending sort breaks ties by position (earlier wins), so exactly k tokens are chosen
    and the choice is deterministic; sorting the chosen indices keeps the subsequence causal.
    """
    order = torch.sort(r_BT, dim=-1, descending=True, stable=True).indices[:, :k]
    return order.sort(dim=-1).values


def positions_mask(idx_BK: Tensor, seq_len: int) -> Tensor:
    return torch.zeros(idx_BK.shape[0], seq_len, dtype=torch.bool, device=idx_BK.device).scatter(
        1, idx_BK, True
    )


def causal_attention_mask(take_BT: Tensor) -> Tensor:
    """(B, 1, T, T) mask: query i sees key j iff j <= i and j took the block.

    The diagonal is always open so rows of tokens that skip (whose outputs are discarded) are never
    fully masked: a fully masked softmax row would give NaN and poison the backward pass.
    """
    T = take_BT.shape[1]
    eye = torch.eye(T, dtype=torch.bool, device=take_BT.device)
    lower = torch.ones(T, T, dtype=torch.bool, device=take_BT.device).tril()
    return ((lower & take_BT[:, None, :]) | eye).unsqueeze(1)


class Block(nn.Module):
    """A pre-norm transformer block, dense or routed (joint or staggered)."""

    def __init__(self, cfg: MoDConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.routed = cfg.layer_kinds[layer] == "R"
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)
        if self.routed:
            self.route_kinds = ("block",) if cfg.routing == "joint" else ("attn", "mlp")
            self.router = nn.ModuleDict(
                {kind: nn.Linear(cfg.d_model, 1, bias=False) for kind in self.route_kinds}
            )
            if cfg.causal_router == "predictor":
                self.predictor = nn.ModuleDict(
                    {
                        kind: Predictor(cfg.d_model, cfg.predictor_hidden)
                        for kind in self.route_kinds
                    }
                )

    def update(
        self,
        kind: str,
        x_BKD: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        kv: KVHook = None,
    ) -> Tensor:
        """The update f(x~) of sub-block `kind` ("block", "attn" or "mlp"); the outer residual is
        added by the caller. For the whole block, f = a + mlp(mlp_norm(x~ + a))."""
        if kind == "mlp":
            return self.mlp(self.mlp_norm(x_BKD))
        a_BKD = self.attn(self.attn_norm(x_BKD), cos, sin, mask, kv)
        if kind == "attn":
            return a_BKD
        return a_BKD + self.mlp(self.mlp_norm(x_BKD + a_BKD))

    def router_weight(self, kind: str, x_BTD: Tensor) -> Tensor:
        """The raw router weight r = x @ w (B, T), in at least float32."""
        if self.cfg.router_scores == "random":  # ablation: scores that know nothing
            return torch.randn(x_BTD.shape[:-1], device=x_BTD.device)
        return _linear32(x_BTD, self.router[kind]).squeeze(-1)

    def router_logits(self, kind: str, x_BTD: Tensor) -> tuple[Tensor, Tensor | None]:
        """Raw router weights r (B, T) and, in predictor mode, the predictor's logits (float32
        at least)."""
        r_BT = self.router_weight(kind, x_BTD)
        if self.cfg.causal_router != "predictor":
            return r_BT, None
        # Stop-gradient: the predictor learns from its own BCE and never shapes the LM.
        return r_BT, self.predictor[kind](x_BTD.detach())

    def gate(self, r: Tensor, like: Tensor) -> Tensor:
        """g(r) in the dtype of the stream `like`, so the update keeps the stream's dtype."""
        if self.cfg.router_scores == "random":
            return torch.ones_like(r, dtype=like.dtype)
        return (torch.sigmoid(r) if self.cfg.router_gate == "sigmoid" else r).to(like.dtype)

    def forward(
        self, x_BTD: Tensor, cos_T: Tensor, sin_T: Tensor, routing: str
    ) -> tuple[Tensor, list[Route]]:
        if not self.routed:
            return x_BTD + self.update("block", x_BTD, cos_T, sin_T, None), []
        routes = []
        for kind in self.route_kinds:  # ("block",) joint, or ("attn", "mlp") staggered
            x_BTD, route = self.route(kind, x_BTD, cos_T, sin_T, routing)
            routes.append(route)
        return x_BTD, routes

    def route(
        self, kind: str, x_BTD: Tensor, cos_T: Tensor, sin_T: Tensor, routing: str
    ) -> tuple[Tensor, Route]:
        B, T, D = x_BTD.shape
        r_BT, pred_BT = self.router_logits(kind, x_BTD)
        k = self.cfg.capacity_tokens(T)
        idx_BK = topk_indices(r_BT, k)
        topk_BT = positions_mask(idx_BK, T)
        if routing == "topk":
            mask_BT = topk_BT
            if k > 0:
                # Flat row indices into (B*T, D): index_select/index_copy move whole rows, which
                # is several times cheaper than gather/scatter with a D-expanded index.
                rows_N = (idx_BK + T * torch.arange(B, device=idx_BK.device)[:, None]).flatten()
                x_ND = x_BTD.reshape(B * T, D)
                x_BKD = x_ND.index_select(0, rows_N).view(B, k, D)
                # Original positions: rotary tables indexed by the chosen tokens' positions.
                cos_BK, sin_BK = cos_T[idx_BK].unsqueeze(1), sin_T[idx_BK].unsqueeze(1)
                # idx sorted ascending, so a plain causal mask over K is causal in the sequence.
                f_BKD = self.update(kind, x_BKD, cos_BK, sin_BK, None)
                g_BK1 = self.gate(r_BT.gather(1, idx_BK), x_BKD).unsqueeze(-1)
                y_ND = (x_BKD + g_BK1 * f_BKD).reshape(B * k, D)
                x_BTD = x_ND.index_copy(0, rows_N, y_ND).view(B, T, D)
        else:
            mask_BT = (r_BT if pred_BT is None else pred_BT) > 0
            f_BTD = self.update(kind, x_BTD, cos_T, sin_T, causal_attention_mask(mask_BT))
            x_BTD = torch.where(
                mask_BT.unsqueeze(-1), x_BTD + self.gate(r_BT, x_BTD).unsqueeze(-1) * f_BTD, x_BTD
            )
        return x_BTD, Route(self.layer, kind, mask_BT, r_BT, topk_BT, pred_BT)


class MoDTransformer(nn.Module):
    """Decoder-only MoD transformer (dense when `layer_pattern` has no 'R')."""

    def __init__(self, config: MoDConfig) -> None:
        super().__init__()
        self.config = cfg = config
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        resid_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        for block in self.blocks:
            nn.init.normal_(block.attn.wo.weight, std=resid_std)
            nn.init.normal_(block.mlp.w2.weight, std=resid_std)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=self.config.init_std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=self.config.init_std)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def check_input(self, idx: Tensor) -> None:
        """Shape, dtype, length and token-range checks with clear messages."""
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (batch, seq_len), got {tuple(idx.shape)}")
        if idx.dtype.is_floating_point or idx.dtype == torch.bool or idx.is_complex():
            raise ValueError(f"idx must hold integer token ids, got dtype {idx.dtype}")
        B, T, V = idx.shape[0], idx.shape[1], self.config.vocab_size
        if B < 1:
            raise ValueError(f"batch size must be >= 1, got idx of shape {tuple(idx.shape)}")
        if T < 1 or T > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {T} is outside [1, max_seq_len={self.config.max_seq_len}]"
            )
        if torch.compiler.is_compiling():  # a value check would break the graph
            return
        if idx.device.type == "cpu":
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= V:
                bad = lo if lo < 0 else hi
                raise ValueError(f"token id {bad} out of range: ids must be in [0, vocab_size={V})")
        else:  # no host sync on accelerators: an async device assert instead
            torch._assert_async(((idx >= 0) & (idx < V)).all(), f"token ids must be in [0, {V})")

    def forward(
        self, idx: Tensor, targets: Tensor | None = None, routing: str = "topk"
    ) -> MoDOutput:
        """Logits for `idx` (B, T); losses when `targets` (B, T, ignore index -100) is given.

        routing="topk": the paper's expert-choice top-k per sequence (training; exactly k per row).
        routing="causal": each token decides for itself; no decision reads a later token.
        """
        if routing not in ROUTING_CHOICES:
            raise ValueError(f"routing must be one of {ROUTING_CHOICES}, got {routing!r}")
        self.check_input(idx)
        if targets is not None and targets.shape != idx.shape:
            raise ValueError(
                f"targets shape {tuple(targets.shape)} must equal idx shape {tuple(idx.shape)}"
            )
        T = idx.shape[1]
        x_BTD = self.embed(idx)
        cos_T, sin_T = rope_tables(
            self.config.head_dim,
            T,
            self.config.rope_theta,
            idx.device,
            torch.promote_types(x_BTD.dtype, torch.float32),
        )
        routes: list[Route] = []
        for block in self.blocks:
            x_BTD, block_routes = block(x_BTD, cos_T, sin_T, routing)
            routes.extend(block_routes)
        logits = self.lm_head(self.norm(x_BTD))
        aux_loss = router_aux_loss(routes, logits)
        out = MoDOutput(logits=logits, aux_loss=aux_loss, routes=routes)
        if targets is not None:
            out.lm_loss = F.cross_entropy(
                logits.to(_loss_dtype(logits)).flatten(0, 1), targets.flatten(), ignore_index=-100
            )
            out.loss = out.lm_loss + self.config.aux_loss_weight * aux_loss
        return out


def _loss_dtype(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)  # bf16 -> float32, float64 stays


def router_aux_loss(routes: list[Route], like: Tensor) -> Tensor:
    """Mean over routers of the BCE between causal-decision logits and per-row top-k membership."""
    dtype = _loss_dtype(like)
    if not routes:
        return like.new_zeros((), dtype=dtype)
    losses = [
        F.binary_cross_entropy_with_logits(r.decision_logits.to(dtype), r.target.to(dtype))
        for r in routes
    ]
    return torch.stack(losses).mean()


@torch.no_grad()
def routing_accuracy(routes: list[Route]) -> dict[str, float]:
    """Share of tokens whose causal decision (logit > 0) agrees with top-k membership, per router.

    Keys are ``"<layer>"`` for joint routing and ``"<layer>.<kind>"`` for staggered routing.
    """
    acc = {}
    for r in routes:
        acc[r.name] = ((r.decision_logits > 0) == r.target).float().mean().item()
    return acc
