"""Training: `train(model_config, TrainConfig(...))` trains (or resumes) a run and returns its
summary; `evaluate_checkpoint` is `mod eval`.

- `config`: `TrainConfig`, the schedules (learning rate, capacity warm-up), the optimizer;
- `setup`: a new run, one from another run's weights, or one restored from its checkpoint;
- `state`: the `Run` being trained, and what of it a checkpoint keeps (`Run.state_dict`);
- `resume`: the run folder: refusing what would lose a run, resuming it exactly, starting over;
- `loop`: the steps, logs, evaluations and checkpoints;
- `signals`: SIGTERM and SIGINT stop a run after a step, with a checkpoint (`TrainingStopped`);
- `evaluate`: validation in top-k and causal routing; `report`: the lines, summary and plot;
- `tune`: router tuning and distillation from the dense twin, the capacity warm-up.

On the CPU a resumed run reproduces an uninterrupted one bit for bit (docs/reliability.md).
"""

from .config import (
    TRAIN_CHOICES,
    TRAIN_RANGES,
    TrainConfig,
    capacity_warmup_steps,
    lr_at,
    make_optimizer,
)
from .evaluate import evaluate, evaluate_checkpoint, expert_slot_shares
from .loop import TrainingDiverged, train
from .report import format_eval, format_eval_lines, format_summary, mean_expert_share, plot_metrics
from .resume import RUN_FILES, NoCheckpointError, has_checkpoint, resume_config, stream_fingerprint
from .signals import TrainingStopped
from .state import CHECKPOINT_NAME, MetricsLog, Run, pack_masks, unpack_masks

__all__ = [
    "CHECKPOINT_NAME",
    "RUN_FILES",
    "TRAIN_CHOICES",
    "TRAIN_RANGES",
    "MetricsLog",
    "NoCheckpointError",
    "Run",
    "TrainConfig",
    "TrainingDiverged",
    "TrainingStopped",
    "capacity_warmup_steps",
    "evaluate",
    "evaluate_checkpoint",
    "expert_slot_shares",
    "format_eval",
    "format_eval_lines",
    "format_summary",
    "has_checkpoint",
    "lr_at",
    "make_optimizer",
    "mean_expert_share",
    "pack_masks",
    "plot_metrics",
    "resume_config",
    "stream_fingerprint",
    "train",
    "unpack_masks",
]
