"""What round 2 measures of each ablation's trained model: where its routed compute goes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mixture_of_depths.data import eval_batches, load_splits, load_tokenizer
from mixture_of_depths.inspect import analyse
from mixture_of_depths.runtime.checkpoint import load_model


def routing_profile(ckpt: Path, data: str | None, rows: int) -> dict[str, Any]:
    """Where a trained model's compute goes on held-out text (`inspect.analyse`): the histogram
    of routed blocks taken per token against independent coins, the share of each router's takes
    that went to tokens containing a newline (and their share of the text), and Spearman's rho
    of blocks taken against the predictive entropy."""
    model, cfg = load_model(ckpt)
    tokenizer = load_tokenizer(ckpt)
    val = load_splits(data, tokenizer)[1]
    tokens = eval_batches(val, rows, cfg.max_seq_len, 1)[0][0]
    rep = analyse(model, tokens, bootstrap=200)
    newline = torch.tensor(["\n" in tokenizer.decode([int(t)]) for t in rep.tokens.tolist()])
    takes = rep.taken.double()
    T = tokens.shape[1]
    k = cfg.capacity_tokens(T)
    early = (torch.arange(len(rep.tokens)) % T < k).double()  # the first k places of each row
    per_token = takes.sum(1)
    ids, inverse = torch.unique(rep.tokens, return_inverse=True)
    by_id = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inverse, per_token)
    top = by_id.argsort(descending=True)[:8]
    return {
        # a router that takes the first k places of each row is trivially causal (1: all of
        # its takes there; k/T, 12.5%, if position does not matter)
        "takes_in_first_k_places": {
            nm: float((takes[:, j] * early).sum() / takes[:, j].sum().clamp_min(1))
            for j, nm in enumerate(rep.router_names)
        },
        "top_taken_tokens": [
            [tokenizer.decode([int(ids[i])]), float(by_id[i] / per_token.sum().clamp_min(1))]
            for i in top.tolist()
            if by_id[i] > 0
        ],
        "tokens": len(rep.tokens),
        "depth_hist": rep.depth_hist.tolist(),
        "independent_hist": rep.independent_hist.tolist(),
        "newline_share_of_text": float(newline.double().mean()),
        "newline_share_of_takes": {
            nm: float(takes[newline, j].sum() / takes[:, j].sum().clamp_min(1))
            for j, nm in enumerate(rep.router_names)
        },
        "rho_depth_entropy": rep.correlations["depth_vs_entropy"],
    }
