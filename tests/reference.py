"""A slow, obviously correct loop implementation of the MoD forward pass: the tests' oracle.

It reads the parameters of a `MoDTransformer` but none of its forward code: RMSNorm, RoPE, attention
(with GQA by repeating key/value heads), SwiGLU, the routers, the top-k choice (ties to the earlier
position) and the causal decisions are all written out here with explicit loops over batch rows,
routers, tokens, heads and query positions. Everything is computed in float64.

Semantics (docs/semantics.md): for a routed sub-block and one batch row, a set S of token
positions is chosen (top-k of the raw router weight r = x @ w, or, causally, the tokens whose
decision logit is > 0); the sub-block runs on the tokens of S alone, each attending to the tokens of
S at or before its own position, rotated at its original position; token i in S becomes
x_i + g(r_i) * f_i and every other token is left as it is. With ``skipped_kv="residual"`` the
tokens of S attend instead to every token of the row at or before their position, keys and values
made from the stream each token has at the layer's input. With ``routing="mlp"`` every token of
a routed layer first takes its attention as in a dense layer (x + a), and only the MLP is routed,
its router reading x + a. With ``routing="mlp_kv"`` one router reads x and chooses S; every token
i takes x + a_i, a_i its attention over the tokens of S at or before i (keys and values from
their x, zero where there is none), then the tokens of S take (x + a) + g(r) * mlp(x + a).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from mixture_of_depths import MoDTransformer, capacity_tokens


@dataclass
class RefRoute:
    layer: int
    kind: str  # "block", "attn", "mlp" or "mlp_kv"
    mask: Tensor  # (B, T) bool: tokens that went through the sub-block
    logits: Tensor  # (B, T) raw router weights r
    target: Tensor  # (B, T) bool: top-k membership of r, per row
    predictor_logits: Tensor | None  # (B, T), predictor mode only


@dataclass
class RefOutput:
    logits: Tensor  # (B, T, V)
    routes: list[RefRoute]


def _w(linear) -> Tensor:  # noqa: ANN001
    return linear.weight.detach().to(torch.float64)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x: (D,) one token."""
    return x / math.sqrt(float((x * x).mean()) + eps) * weight


def silu(z: Tensor) -> Tensor:
    return z / (1.0 + torch.exp(-z))


def sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z))


def rotate(v: Tensor, pos: int, theta: float) -> Tensor:
    """RoPE on one head vector v (head_dim,) at absolute position `pos`: rotate the two halves.

    Pair i = (v[i], v[i + d/2]) turns by the angle pos * theta^(-2i/d).
    """
    d = v.shape[0]
    half = d // 2
    angle = torch.tensor([pos * theta ** (-(2 * i) / d) for i in range(half)], dtype=torch.float64)
    c, s = torch.cos(angle), torch.sin(angle)
    x1, x2 = v[:half], v[half:]
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c))


def topk_set(r: list[float], k: int) -> list[int]:
    """The k positions of largest r, ties broken by the lower position; returned ascending."""
    return sorted(sorted(range(len(r)), key=lambda i: (-r[i], i))[:k])


class _Params:
    """The weights of one block, read out of the model as float64 tensors."""

    def __init__(self, block, cfg) -> None:  # noqa: ANN001
        # The model fuses q/k/v (and W1/W3) into one projection; split it back by rows.
        wqkv, nq = _w(block.attn.wqkv), block.attn.n_heads * block.attn.head_dim
        nkv = block.attn.n_kv_heads * block.attn.head_dim
        self.wq, self.wk, self.wv = wqkv[:nq], wqkv[nq : nq + nkv], wqkv[nq + nkv :]
        self.wo = _w(block.attn.wo)
        self.attn_norm = block.attn_norm.weight.detach().to(torch.float64)
        self.mlp_norm = block.mlp_norm.weight.detach().to(torch.float64)
        self.w1, self.w3 = _w(block.mlp.w13).chunk(2, dim=0)
        self.w2 = _w(block.mlp.w2)
        self.eps = cfg.norm_eps
        self.theta = cfg.rope_theta
        self.H, self.KVH, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.d_model // cfg.n_heads


def attn_update(
    p: _Params,
    xs: list[Tensor],
    pos: list[int],
    keys: tuple[list[Tensor], list[int]] | None = None,
) -> list[Tensor]:
    """Attention update a_i for the tokens xs (each (D,)) at original positions pos (ascending).

    Token i attends to the tokens j of this list with pos[j] <= pos[i], and to nothing else; or,
    with `keys` = (the stream of every token of the row, their positions) (skipped_kv="residual"),
    to every token of that stream at or before pos[i], its key and value made from its own stream.
    A query with no key at or before it gets a zero update.
    """
    n = len(xs)
    H, KVH, hd = p.H, p.KVH, p.hd
    group = H // KVH  # query heads per key/value head
    q = []
    for i in range(n):
        h = rms_norm(xs[i], p.attn_norm, p.eps)
        qi = (p.wq @ h).view(H, hd)
        q.append([rotate(qi[a], pos[i], p.theta) for a in range(H)])
    kx, kpos = (xs, pos) if keys is None else keys
    k, v = [], []
    for j in range(len(kx)):
        h = rms_norm(kx[j], p.attn_norm, p.eps)
        kj = (p.wk @ h).view(KVH, hd)
        vj = (p.wv @ h).view(KVH, hd)
        # GQA: repeat every key/value head `group` times (head a reads kv head a // group).
        k.append([rotate(kj[a // group], kpos[j], p.theta) for a in range(H)])
        v.append([vj[a // group] for a in range(H)])
    out = []
    for i in range(n):
        if not any(kpos[j] <= pos[i] for j in range(len(kx))):
            out.append(torch.zeros(p.wo.shape[0], dtype=torch.float64))
            continue
        heads = []
        for a in range(H):
            visible = [j for j in range(len(kx)) if kpos[j] <= pos[i]]
            scores = [float(q[i][a] @ k[j][a]) / math.sqrt(hd) for j in visible]
            m = max(scores)
            e = [math.exp(s - m) for s in scores]
            z = sum(e)
            y = torch.zeros(hd, dtype=torch.float64)
            for w, j in zip(e, visible, strict=True):
                y = y + (w / z) * v[j][a]
            heads.append(y)
        out.append(p.wo @ torch.cat(heads))
    return out


def mlp_update(p: _Params, x: Tensor) -> Tensor:
    h = rms_norm(x, p.mlp_norm, p.eps)
    return p.w2 @ (silu(p.w1 @ h) * (p.w3 @ h))


def block_update(
    p: _Params,
    xs: list[Tensor],
    pos: list[int],
    keys: tuple[list[Tensor], list[int]] | None = None,
) -> list[Tensor]:
    """Joint block update f = a + mlp(mlp_norm(x + a)), a = attn(attn_norm(x))."""
    a = attn_update(p, xs, pos, keys)
    return [a[i] + mlp_update(p, xs[i] + a[i]) for i in range(len(xs))]


def sub_update(
    p: _Params,
    kind: str,
    xs: list[Tensor],
    pos: list[int],
    keys: tuple[list[Tensor], list[int]] | None = None,
) -> list[Tensor]:
    if kind == "block":
        return block_update(p, xs, pos, keys)
    if kind == "attn":
        return attn_update(p, xs, pos, keys)
    return [mlp_update(p, x) for x in xs]


def predictor_logit(pred, x: Tensor) -> float:  # noqa: ANN001
    w1, b1 = _w(pred.fc1), pred.fc1.bias.detach().to(torch.float64)
    w2, b2 = _w(pred.fc2), pred.fc2.bias.detach().to(torch.float64)
    return float(w2 @ silu(w1 @ x + b1) + b2)


def _add(xs: list[Tensor], fs: list[Tensor]) -> list[Tensor]:
    return [x + f for x, f in zip(xs, fs, strict=True)]


def reference_forward(model: MoDTransformer, idx: Tensor, routing: str = "topk") -> RefOutput:
    """Loop forward of `model` on `idx` (B, T); routing "topk" or "causal"."""
    cfg = model.config
    B, T = idx.shape
    k = capacity_tokens(cfg.capacity, T)
    emb = model.embed.weight.detach().to(torch.float64)
    head = model.lm_head.weight.detach().to(torch.float64)
    final_norm = model.norm.weight.detach().to(torch.float64)

    # Per row: the residual stream as a list of T vectors.
    streams = [[emb[int(idx[b, t])].clone() for t in range(T)] for b in range(B)]
    routes: list[RefRoute] = []
    for layer, block in enumerate(model.blocks):
        p = _Params(block, cfg)
        if cfg.layer_kinds[layer] == "D":
            streams = [_add(xs, block_update(p, xs, list(range(T)))) for xs in streams]
            continue
        if cfg.routing == "mlp":  # attention dense, as in a dense block; then the MLP's router
            streams = [_add(xs, attn_update(p, xs, list(range(T)))) for xs in streams]
        kinds = {"joint": ["block"], "staggered": ["attn", "mlp"], "mlp": ["mlp"],
                 "mlp_kv": ["mlp_kv"]}[cfg.routing]  # fmt: skip
        for kind in kinds:
            w = block.router[kind].weight.detach().to(torch.float64)[0]
            mask = torch.zeros(B, T, dtype=torch.bool)
            target = torch.zeros(B, T, dtype=torch.bool)
            r_bt = torch.zeros(B, T, dtype=torch.float64)
            pred_bt = torch.zeros(B, T, dtype=torch.float64)
            for b in range(B):
                xs = streams[b]
                r = [float(x @ w) for x in xs]
                chosen_topk = topk_set(r, k)
                if cfg.has_predictor:
                    pl = [predictor_logit(block.predictor[kind], x) for x in xs]
                else:
                    pl = None
                if routing == "topk":
                    chosen = chosen_topk
                else:
                    decision = r if pl is None else pl
                    thr = cfg.causal_threshold(len(routes))  # routers in forward order
                    chosen = [t for t in range(T) if decision[t] > thr]
                # "residual": the chosen tokens' queries see keys of the whole row's stream
                residual = cfg.skipped_kv == "residual" and kind != "mlp"
                keys = (xs, list(range(T))) if residual else None
                if kind == "mlp_kv":  # every token queries the chosen; then their MLP
                    takers = ([xs[t] for t in chosen], chosen)
                    streams[b] = xs = _add(xs, attn_update(p, xs, list(range(T)), takers))
                if chosen:
                    sub = "mlp" if kind == "mlp_kv" else kind
                    f = sub_update(p, sub, [xs[t] for t in chosen], chosen, keys)
                    new = list(xs)
                    for t, ft in zip(chosen, f, strict=True):
                        g = r[t] if cfg.router_gate == "raw" else sigmoid(r[t])
                        new[t] = xs[t] + g * ft
                    streams[b] = new
                for t in range(T):
                    r_bt[b, t] = r[t]
                    if pl is not None:
                        pred_bt[b, t] = pl[t]
                for t in chosen:
                    mask[b, t] = True
                for t in chosen_topk:
                    target[b, t] = True
            routes.append(
                RefRoute(
                    layer,
                    kind,
                    mask,
                    r_bt,
                    target,
                    pred_bt if cfg.has_predictor else None,
                )
            )

    logits = torch.zeros(B, T, cfg.vocab_size, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            logits[b, t] = head @ rms_norm(streams[b][t], final_norm, cfg.norm_eps)
    return RefOutput(logits, routes)


def randomise(model: torch.nn.Module, seed: int) -> None:
    """O(1) weights everywhere (the default init is tiny), so routing and gates really matter.

    Router weights are N(0, 1) so that r = x @ w is O(1) and has both signs.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            z = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if "norm" in name:
                p.copy_(1 + 0.2 * z)
            elif "router" in name:
                p.copy_(z)
            elif p.ndim == 2:
                p.copy_(z / p.shape[1] ** 0.5)
            elif p.ndim == 3:  # expert weights (experts, fan-in, fan-out)
                p.copy_(z / p.shape[1] ** 0.5)
            else:
                p.copy_(0.3 * z)


# -- Mixture-of-Recursions (docs/mor.md) ----------------------------------------------------------
def _recursion_row(
    model: MoDTransformer, xs: list[Tensor], routing: str, out: dict
) -> list[Tensor]:
    """One row through a recursive model's stack: the unique layers, the first pass of the shared
    ones for every token, then each later step on the tokens its router keeps among those still
    active, `out[step]` collecting (chosen, top-k chosen, logits, predictor logits)."""
    cfg, T = model.config, len(xs)
    ps = [_Params(b, cfg) for b in model.blocks]
    pre, shared, post = cfg.recursion_layers
    for layer in pre:
        xs = _add(xs, block_update(ps[layer], xs, list(range(T))))
    rec = model.recursion
    token = cfg.recursion_router == "token"
    if token:  # one router: each token's number of passes, the first max wins
        wd = _w(rec.router["depth"])
        z = [[float(v) for v in wd @ x] for x in xs]
        depth = [max(range(cfg.recursions), key=lambda d, zt=zt: (zt[d], -d)) for zt in z]
        prob = [
            math.exp(zt[d]) / sum(math.exp(v) for v in zt) for zt, d in zip(z, depth, strict=True)
        ]
    first: dict[int, list[Tensor]] = {}  # "share": each shared layer's input on the first pass
    active, topk_active = list(range(T)), list(range(T))
    for r in range(cfg.recursions):
        if r == 0 or r not in cfg.recursion_routed_steps:
            for layer in shared:
                first.setdefault(layer, list(xs))
                xs = _add(xs, block_update(ps[layer], xs, list(range(T))))
            continue
        if token:
            logits = [max(zt[r:]) - max(zt[:r]) for zt in z]
            chosen = [t for t in range(T) if depth[t] >= r]
            top, pl, gates = chosen, None, prob
        else:
            w = _w(rec.router[str(r)])[0]
            logits = [float(x @ w) for x in xs]
            k = capacity_tokens(cfg.recursion_capacity(r), T)
            cand = [logits[t] if t in topk_active else -math.inf for t in range(T)]
            top = topk_set(cand, k)
            pl = (
                [predictor_logit(rec.predictor[str(r)], x) for x in xs]
                if cfg.has_predictor
                else None
            )
            decision = logits if pl is None else pl
            thr = cfg.causal_threshold(cfg.recursion_routed_steps.index(r))
            chosen = top if routing == "topk" else [t for t in active if decision[t] > thr]
            gates = [sigmoid(v) if cfg.router_gate == "sigmoid" else v for v in logits]
        ys = [xs[t] for t in chosen]
        for layer in shared:
            keys = (first[layer], list(range(T))) if cfg.recursion_kv == "share" else None
            ys = _add(ys, block_update(ps[layer], ys, chosen, keys)) if ys else ys
        xs = list(xs)
        for t, y in zip(chosen, ys, strict=True):
            xs[t] = xs[t] + gates[t] * (y - xs[t])
        out[r] = (chosen, top, logits, pl)
        active, topk_active = chosen, top
    for layer in post:
        xs = _add(xs, block_update(ps[layer], xs, list(range(T))))
    return xs


def reference_recursion(model: MoDTransformer, idx: Tensor, routing: str = "topk") -> RefOutput:
    """Loop forward of a recursive `model` (shared weights applied step by step, the active set
    filtered per step) on `idx` (B, T); one route per routed step, `layer` its step number."""
    cfg = model.config
    B, T = idx.shape
    emb = model.embed.weight.detach().to(torch.float64)
    head = model.lm_head.weight.detach().to(torch.float64)
    final_norm = model.norm.weight.detach().to(torch.float64)
    steps = cfg.recursion_routed_steps
    routes = [
        RefRoute(r, "recursion", torch.zeros(B, T, dtype=torch.bool),
                 torch.zeros(B, T, dtype=torch.float64), torch.zeros(B, T, dtype=torch.bool),
                 torch.zeros(B, T, dtype=torch.float64) if cfg.has_predictor else None)
        for r in steps
    ]  # fmt: skip
    logits = torch.zeros(B, T, cfg.vocab_size, dtype=torch.float64)
    for b in range(B):
        out: dict = {}
        xs = _recursion_row(model, [emb[int(idx[b, t])].clone() for t in range(T)], routing, out)
        for route in routes:
            chosen, top, r_t, pl = out[route.layer]
            route.mask[b, chosen] = True
            route.target[b, top] = True
            route.logits[b] = torch.tensor(r_t, dtype=torch.float64)
            if pl is not None:
                route.predictor_logits[b] = torch.tensor(pl, dtype=torch.float64)
        for t in range(T):
            logits[b, t] = head @ rms_norm(xs[t], final_norm, cfg.norm_eps)
    return RefOutput(logits, routes)
