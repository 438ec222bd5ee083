"""Expert layers: a token-choice mixture of SwiGLU experts, with optional no-op experts
(integrated MoDE) and an optional expert capacity (tokens over it are dropped: they ride the
residual stream). docs/semantics.md ("Experts") states the rules; in short:

- the router ``Linear(D, n_experts + n_noop_experts)`` is read in float32, softmaxed over all the
  experts, and each token takes its top-`experts_per_token` (ties: the lower expert index);
- a chosen real expert's output is scaled by its softmax probability, not renormalised over the
  chosen ones (so top-1 still trains the router); a no-op expert contributes exactly zero;
- with a capacity (training top-k only), each real expert takes at most
  ``ceil(factor * tokens * experts_per_token / n_experts)`` slots, first choices before second
  ones, earlier positions before later ones, then lower rows: the rest are dropped.

Computation: slots are sorted by expert and each expert runs once on its contiguous slice, and
results are added back with `index_add`. The experts run as two `torch._grouped_mm` calls where
the running torch supports them on that device and dtype (`grouped_mm_supported`), else as a loop
over experts (never over tokens), the reference path. Either way the slice bounds reach the host
once per layer call: the one host sync of an expert layer.

Names with shape suffixes: N tokens of the call, S = N * experts_per_token slots, E experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import MoDConfig
from .routing import Route, linear32


@dataclass
class ExpertRoute:
    """What one expert layer did on one call (returned, never stored on the module).

    Shapes are those of the tokens that reached the layer, (..., experts_per_token): `experts`
    the chosen expert ids (ids >= n_experts are no-op experts), `probs` their softmax
    probabilities, `kept` whether the slot ran (False: a no-op, or dropped by the capacity).
    `logits` (..., n_experts + n_noop_experts) float32 router logits; `dropped` the real-expert
    slots the capacity removed.
    """

    layer: int
    experts: Tensor
    probs: Tensor
    kept: Tensor
    dropped: Tensor
    logits: Tensor
    n_experts: int

    @property
    def real(self) -> Tensor:
        """Slots that chose a real expert (kept or dropped)."""
        return self.experts < self.n_experts


def expert_capacity(cfg: MoDConfig, tokens: int) -> int | None:
    """Slots one real expert takes when `tokens` tokens reach the layer, or None (no bound)."""
    if cfg.expert_capacity_factor is None:
        return None
    return math.ceil(cfg.expert_capacity_factor * tokens * cfg.experts_per_token / cfg.n_experts)


def count_ids(ids: Tensor, n: int) -> Tensor:
    """How often each of 0..n-1 occurs in `ids`: `bincount` without its host sync (on CUDA it
    reads the largest id to size its output)."""
    return torch.zeros(n, dtype=torch.long, device=ids.device).scatter_add_(
        0, ids, torch.ones_like(ids)
    )


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype a matmul of `x` runs in here: autocast's where it is on and casts x (it leaves
    float64 alone), else x's own."""
    t = x.device.type
    if torch.is_autocast_enabled(t) and x.dtype == torch.float32:
        return torch.get_autocast_dtype(t)
    return x.dtype


_GROUPED_MM_WORKS: dict[tuple[str, torch.dtype], bool] = {}  # (device, dtype) -> works


def grouped_mm_supported(x: Tensor, w13: Tensor, w2: Tensor) -> bool:
    """Whether the running torch has `torch._grouped_mm` for these tensors on their device: the
    op exists, the dtype is one it takes (bf16, fp16, fp32; not fp64), every row is a multiple of
    16 bytes, and a tiny call on this device and dtype worked (probed once, then cached)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    dt = _compute_dtype(x)
    if dt not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    size = torch.empty((), dtype=dt).element_size()
    if any(n * size % 16 for n in (x.shape[-1], w13.shape[-1], w2.shape[-2], w2.shape[-1])):
        return False
    key = (str(x.device), dt)
    if key not in _GROUPED_MM_WORKS:
        try:
            with torch.no_grad():
                a = torch.ones(4, 8, device=x.device, dtype=dt)
                b = torch.ones(2, 8, 8, device=x.device, dtype=dt)
                offs = torch.tensor([1, 4], device=x.device, dtype=torch.int32)
                y = torch._grouped_mm(a, b, offs=offs)
                _GROUPED_MM_WORKS[key] = bool((y == 8).all())
        except (RuntimeError, NotImplementedError):
            _GROUPED_MM_WORKS[key] = False
    return _GROUPED_MM_WORKS[key]


class ExpertMLP(nn.Module):
    """`n_experts` SwiGLU experts of hidden size `d_ff_expert`, plus `n_noop_experts` no-ops."""

    def __init__(self, cfg: MoDConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        E, D, F_ = cfg.n_experts, cfg.d_model, cfg.d_ff_expert
        self.router = nn.Linear(D, cfg.n_experts + cfg.n_noop_experts, bias=False)
        # Per expert: w13 (D, 2F) with W1 then W3 in its columns, w2 (F, D): x @ w13, h @ w2.
        self.w13 = nn.Parameter(torch.empty(E, D, 2 * F_))
        self.w2 = nn.Parameter(torch.empty(E, F_, D))

    def reset_parameters(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.router.weight, std=std)
        nn.init.normal_(self.w13, std=std)
        nn.init.normal_(self.w2, std=out_std)

    def expert(self, e: int, x_ND: Tensor) -> Tensor:
        a, b = (x_ND @ self.w13[e]).chunk(2, dim=-1)
        return (F.silu(a) * b) @ self.w2[e]

    def choose(self, x: Tensor, drop: bool) -> ExpertRoute:
        """The router's choices for tokens `x` (..., D); `drop` applies the capacity."""
        cfg = self.cfg
        logits = linear32(x, self.router)
        probs = logits.softmax(-1)
        # A stable sort: among equal probabilities the lower expert index comes first.
        order = probs.sort(dim=-1, descending=True, stable=True).indices
        experts = order[..., : cfg.experts_per_token]
        p = probs.gather(-1, experts)
        real = experts < cfg.n_experts
        kept = real.clone()
        cap = expert_capacity(cfg, x[..., 0].numel()) if drop else None
        if cap is not None:
            kept &= self._slot_rank(experts, real) < cap
        return ExpertRoute(self.layer, experts, p, kept, real & ~kept, logits, cfg.n_experts)

    def _slot_rank(self, experts: Tensor, real: Tensor) -> Tensor:
        """Each slot's place in its expert's queue: choice rank first, then position, then row."""
        k = experts.shape[-1]
        e_BTk = experts.reshape(-1, *experts.shape[-2:]) if experts.dim() > 2 else experts[None]
        B, T, _ = e_BTk.shape
        # Priority of slot (b, t, j): j * T * B + t * B + b (lower goes first).
        prio = (
            torch.arange(k, device=experts.device) * (T * B)
            + torch.arange(T, device=experts.device)[:, None] * B
            + torch.arange(B, device=experts.device)[:, None, None]
        ).reshape(-1)
        e_S = torch.where(real, experts, self.cfg.n_experts).reshape(-1)  # no-ops queue apart
        key = e_S * (k * T * B) + prio
        sorted_key, order = key.sort()
        e_sorted = sorted_key // (k * T * B)
        start = torch.searchsorted(e_sorted, e_sorted, side="left")
        rank_sorted = torch.arange(len(key), device=key.device) - start
        rank = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)
        return rank.view(experts.shape)

    def forward(self, x: Tensor, drop: bool = False) -> tuple[Tensor, ExpertRoute]:
        """``sum_j p_j * expert_j(x)`` over each token's kept real-expert slots (zero for a token
        with none), and the route."""
        route = self.choose(x, drop)
        D, k, E = x.shape[-1], self.cfg.experts_per_token, self.cfg.n_experts
        x_ND = x.reshape(-1, D)
        tok_S = torch.arange(x_ND.shape[0], device=x.device).repeat_interleave(k)
        kept_S = route.kept.reshape(-1)
        # Sort the kept slots by expert: each expert's slots are one contiguous slice.
        e_key = torch.where(kept_S, route.experts.reshape(-1), E)
        e_sorted, order = e_key.sort(stable=True)
        counts_d = count_ids(e_sorted, E + 1)[:E]
        counts = counts_d.tolist()  # the one host sync: the slices' bounds
        n_kept = sum(counts)
        if n_kept == 0:  # every slot chose a no-op or was dropped (common in decoding)
            out = torch.zeros_like(x)
            if torch.is_grad_enabled():
                # Zero gradients for the experts all the same: FSDP2 reduce-scatters a unit's
                # gradients as one buffer, and a rank whose tokens all chose no-ops would send
                # fewer bytes than its peers (a collective mismatch that aborts the job).
                out = out + 0 * (self.w13.sum() + self.w2.sum()).to(x.dtype)
            return out, route
        order = order[:n_kept]
        tok, w = tok_S[order], route.probs.reshape(-1)[order]
        x_sorted = x_ND.index_select(0, tok)
        if self.use_grouped_mm and grouped_mm_supported(x_sorted, self.w13, self.w2):
            out = self._grouped(x_sorted, counts_d)
        else:
            out = self._looped(x_sorted, counts)
        out = out.to(x.dtype) * w.to(x.dtype)[:, None]
        return torch.zeros_like(x_ND).index_add(0, tok, out).view(x.shape), route

    use_grouped_mm = True  # False: always the expert loop (the reference path)

    def _looped(self, x_sorted: Tensor, counts: list[int]) -> Tensor:
        """Each expert on its slice of the sorted slots (the reference path)."""
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                outs.append(self.expert(e, x_sorted[start : start + n]))
            start += n
        return torch.cat(outs) if outs else x_sorted.new_zeros((0, x_sorted.shape[-1]))

    def _grouped(self, x_sorted: Tensor, counts_d: Tensor) -> Tensor:
        """All experts in two grouped matmuls (`torch._grouped_mm`, offsets = slice ends)."""
        dt = _compute_dtype(x_sorted)
        offs = counts_d.cumsum(0).to(torch.int32)
        a, b = torch._grouped_mm(x_sorted.to(dt), self.w13.to(dt), offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(a) * b, self.w2.to(dt), offs=offs)

    @staticmethod
    def params(cfg: MoDConfig) -> float:
        """Weights one slot reads when it runs a real expert."""
        return 3.0 * cfg.d_model * cfg.d_ff_expert

    @staticmethod
    def router_params(cfg: MoDConfig) -> float:
        """Weights of the expert router, read by every token that reaches the layer."""
        return float(cfg.d_model * (cfg.n_experts + cfg.n_noop_experts))


def expert_share_bound(cfg: MoDConfig, tokens: int, drop: bool = True) -> float:
    """The largest share of the slots of `tokens` tokens that real experts can run: 1, or the
    capacity's bound ``n_experts * capacity / slots`` where the capacity drops (`drop`)."""
    cap = expert_capacity(cfg, tokens) if drop else None
    slots = tokens * cfg.experts_per_token
    return 1.0 if cap is None or slots == 0 else min(1.0, cfg.n_experts * cap / slots)


def balance_loss(route: ExpertRoute) -> Tensor:
    """Switch Transformer's load-balancing loss over all experts, no-op ones included (as
    zero-computation experts are in MoE++): ``n * sum_i f_i * P_i``, with f_i the share of slots
    that chose expert i and P_i its mean router probability; 1 when perfectly balanced."""
    n = route.logits.shape[-1]
    probs = route.logits.softmax(-1).reshape(-1, n)
    f = count_ids(route.experts.reshape(-1), n).to(probs.dtype)
    f = f / route.experts.numel()
    return n * (f * probs.mean(0)).sum()


def z_loss(route: ExpertRoute) -> Tensor:
    """ST-MoE's router z-loss: mean squared log-sum-exp of the router logits."""
    return route.logits.logsumexp(-1).square().mean()


def slot_shares(routes: list[ExpertRoute], n_layers: int) -> list[float]:
    """Per layer, the share of a forward's expert slots that ran a real expert (0 for a layer
    with no record, a routed block that took no token): `estimate_flops(expert_share=...)`.
    One host sync for all layers."""
    means = torch.stack([r.kept.float().mean() for r in routes]).tolist() if routes else []
    got = {r.layer: v for r, v in zip(routes, means, strict=True)}
    return [got.get(i, 0.0) for i in range(n_layers)]


def ran_real_expert(route: ExpertRoute, routes: list[Route]) -> Tensor:
    """(B, T) bool over the sequence: the tokens that ran a real expert in `route`'s layer.

    A routed block's expert layer sees only the tokens its router sent (top-k: the gathered k of
    each row, in position order; causal: every token computes, but only the takers keep the
    result), so its record is mapped back through that router's mask (`routes`, the forward's
    MoD routes); a skipper never ran an expert."""
    ran = route.kept.any(-1)
    mlps = ("block", "mlp", "mlp_kv")  # the routes that pick an MLP's tokens
    gate = [r for r in routes if r.layer == route.layer and r.kind in mlps]
    if not gate:  # a dense block: every token reached the layer
        return ran
    take = gate[0].mask.to(ran.device)
    if ran.shape == take.shape:
        return ran & take
    out = torch.zeros_like(take)
    out[take] = ran.reshape(-1)
    return out
