"""Router tuning: training a converted (or any) MoD model's routers and predictors with the rest
frozen, by the LM loss and, optionally, distillation from the frozen dense model.

The pieces `train` uses when a run starts from a checkpoint (`TrainConfig.init_from`):

- `freeze_all_but_routers`: only ``.router.`` and ``.predictor.`` parameters train;
- `dense_teacher`: the model with every block dense and the same weights (for a converted model:
  exactly the original pretrained model), frozen;
- `Distilled`: the student's forward with ``distill * KL(teacher || student)`` added to its loss
  (per token, summed over the vocabulary, averaged over tokens);
- `capacity_at` / `set_capacity`: a capacity schedule from 1.0 down to the target over the first
  steps (warm-up, as router-tuning work does), so that routers start from the dense model's
  behaviour and learn what to drop as the budget tightens. Evaluation runs at the target.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import MoDConfig
from ..model import MoDOutput, MoDTransformer
from ..precision import at_least_float32


def is_router_param(name: str) -> bool:
    return ".router." in name or ".predictor." in name


def freeze_all_but_routers(model: nn.Module) -> int:
    """Freeze every parameter but the routers' and predictors'; returns how many still train."""
    n = 0
    for name, p in model.named_parameters():
        p.requires_grad_(is_router_param(name))
        n += p.numel() if p.requires_grad else 0
    if n == 0:
        raise ValueError(
            "the model has no routers to tune: give it routed blocks (layer_pattern R)"
        )
    return n


def dense_teacher(model: MoDTransformer) -> MoDTransformer:
    """A frozen copy of `model` with every block dense (routers and predictors dropped): for a
    model converted from a dense checkpoint, with the straight-through gate, the original."""
    cfg = model.config.dense_twin()
    teacher = MoDTransformer(cfg).to(next(model.parameters()).device)
    state = {k: v for k, v in model.state_dict().items() if not is_router_param(k)}
    missing, unexpected = teacher.load_state_dict(state, strict=False)
    if set(missing) - ({"lm_head.weight"} if cfg.tie_embeddings else set()) or unexpected:
        raise ValueError(f"dense twin does not match: missing {missing}, unexpected {unexpected}")
    teacher = teacher.to(next(model.parameters()).dtype).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def kl_to_teacher(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """KL(teacher || student) per token (summed over the vocabulary), averaged over tokens."""
    dtype = at_least_float32(student_logits.dtype)
    log_s = F.log_softmax(student_logits.to(dtype), -1)
    log_t = F.log_softmax(teacher_logits.to(dtype), -1)
    return (log_t.exp() * (log_t - log_s)).sum(-1).mean()


class Distilled(nn.Module):
    """`student(x, y)` with the distillation term added to its loss (`out.distill_loss`)."""

    def __init__(self, student: MoDTransformer, teacher: MoDTransformer, weight: float) -> None:
        super().__init__()
        self.student, self.weight = student, weight
        self._teacher = [teacher]  # not a submodule: never trained, saved or wrapped

    def forward(self, x: Tensor, y: Tensor, routing: str = "topk") -> MoDOutput:
        out = self.student(x, y, routing=routing)
        with torch.no_grad():
            target = self._teacher[0](x, routing="topk").logits
        out.distill_loss = kl_to_teacher(out.logits, target)
        out.loss = out.loss + self.weight * out.distill_loss
        return out


def warmup_steps(ratio: float, steps: int) -> int:
    """The steps of a capacity warm-up over `ratio` of `steps` (at least one where ratio > 0)."""
    return max(1, round(ratio * steps)) if ratio > 0 else 0


def capacity_at(step: int, target: float, warmup: int) -> float:
    """Linear from 1.0 at step 0 to `target` at step `warmup`, then `target` (rounded to 6
    decimals: capacities are read as the decimals they print as)."""
    if warmup <= 0 or step >= warmup:
        return target
    return round(1.0 - (1.0 - target) * step / warmup, 6)


def set_capacity(model: nn.Module, capacity: float) -> MoDConfig:
    """Give `model` and every block of it the config with `capacity` (the routed blocks read it
    for their top-k)."""
    root = model.config
    if root.capacity == capacity:
        return root
    cfg = dataclasses.replace(root, capacity=capacity)
    model.config = cfg
    for m in model.modules():
        if isinstance(getattr(m, "cfg", None), MoDConfig):
            m.cfg = cfg
    return cfg
