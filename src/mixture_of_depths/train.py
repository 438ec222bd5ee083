"""Training loop, evaluation in both routing modes, checkpoints and exact resume.

`train(model_config, train_config)` trains a `MoDTransformer` on a token stream with AdamW, linear
warm-up then cosine decay, and gradient clipping before the optimizer step. Every `eval_every` steps
it measures validation loss in top-k and causal routing and the routing accuracy of each router
(causal decision vs top-k membership), logs a JSON line to ``<out>/metrics.jsonl`` and writes an
atomic checkpoint to ``<out>/checkpoint``. `resume=True` continues from that checkpoint and
reproduces the losses of an uninterrupted run: weights, AdamW moments and the data position are all
restored, and batches are a pure function of (seed, step).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .checkpoint import load_model, load_optimizer_state, resolve_checkpoint, save_checkpoint
from .config import MoDConfig
from .data import BatchSampler, Tokenizer, eval_batches, load_splits, load_tokenizer
from .fileio import atomic_write_text, read_json, write_json
from .model import MoDOutput, MoDTransformer
from .precision import autocast_for
from .routing import routing_accuracy

CHECKPOINT_NAME = "checkpoint"


@dataclass
class TrainConfig:
    """Everything about a training run that is not the model."""

    out: str = "runs/mod"
    data: str | None = None  # None: the Python standard library's source (embedded, no download)
    tokenizer: str = "byte"  # "byte" or "bpe" (trained on the training split, saved with the model)
    bpe_vocab_size: int = 4096
    batch_size: int = 16
    seq_len: int | None = None  # None: the model's max_seq_len
    steps: int = 800
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 200
    eval_batches: int = 8
    log_every: int = 10
    seed: int = 0
    device: str = "auto"  # "auto": cuda if available, else cpu
    compile: bool = False

    def __post_init__(self) -> None:
        for name in ("batch_size", "steps", "eval_every", "eval_batches", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len is not None and self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip must be >= 0 (0 disables clipping), got {self.grad_clip}")
        if self.tokenizer not in ("byte", "bpe"):
            raise ValueError(f"tokenizer must be 'byte' or 'bpe', got {self.tokenizer!r}")


def lr_at(step: int, tc: TrainConfig) -> float:
    """Linear warm-up to `lr` over `warmup_steps` steps, then cosine decay that reaches
    `lr * min_lr_ratio` exactly at the last step (`steps - 1`)."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    span = tc.steps - 1 - tc.warmup_steps  # steps from the first decayed one to the last
    progress = 1.0 if span <= 0 else min(1.0, (step - tc.warmup_steps) / span)
    return tc.lr * (
        tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def make_optimizer(model: torch.nn.Module, tc: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms, biases, or router vectors)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_router = ".router." in name
        (decay if p.dim() >= 2 and not is_router else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": tc.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2))


@torch.no_grad()
def evaluate(
    model: MoDTransformer, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> dict[str, Any]:
    """Validation loss in top-k and causal routing; routing accuracy and take-rate per router.

    Routing accuracy compares each token's causal decision with its top-k membership on the top-k
    forward. The take-rate is the share of tokens that chose a router in the causal forward; it
    should sit near the configured capacity when the causal router has learned top-k.
    """
    was_training = model.training
    model.eval()
    sums: dict[str, float] = {"topk": 0.0, "causal": 0.0}
    acc: dict[str, float] = {}
    take: dict[str, float] = {}
    dense = model.config.is_dense
    try:
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            with autocast_for(device):
                out = model(x, y, routing="topk")
            sums["topk"] += out.lm_loss.item()
            for key, a in routing_accuracy(out.routes).items():
                acc[key] = acc.get(key, 0.0) + a
            if dense:  # both modes are the same computation for a dense model
                sums["causal"] += out.lm_loss.item()
                continue
            with autocast_for(device):
                out = model(x, y, routing="causal")
            sums["causal"] += out.lm_loss.item()
            for r in out.routes:
                take[r.name] = take.get(r.name, 0.0) + r.mask.float().mean().item()
    finally:
        model.train(was_training)
    n = max(1, len(batches))
    return {
        "val_loss_topk": sums["topk"] / n,
        "val_loss_causal": sums["causal"] / n,
        "routing_accuracy": {k: v / n for k, v in acc.items()},
        "causal_take_rate": {k: v / n for k, v in take.items()},
    }


class MetricsLog:
    """Append-only JSONL log; on resume it drops records written after the checkpoint's step."""

    def __init__(self, path: Path, keep_until_step: int | None) -> None:
        self.path = path
        if keep_until_step is None:
            atomic_write_text(path, "")
        elif path.exists():
            kept = [
                line
                for line in path.read_text().splitlines()
                if _step_of(line) is not None and _step_of(line) <= keep_until_step
            ]
            atomic_write_text(path, "".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def _step_of(line: str) -> int | None:
    """The step of a log line, None for a line cut short by a crash (it can only be the last)."""
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return None


# Training settings a resumed run must share with the run it continues, or it is not the same run.
# (`steps` may change, e.g. to train longer; the LR schedule then follows the new length.)
_RESUME_FIXED = (
    "data",
    "tokenizer",
    "bpe_vocab_size",
    "batch_size",
    "seq_len",
    "lr",
    "min_lr_ratio",
    "warmup_steps",
    "weight_decay",
    "beta1",
    "beta2",
    "grad_clip",
    "seed",
)


def _check_resume_config(saved: dict[str, Any], tc: TrainConfig) -> None:
    changed = [
        f"{k}: {saved.get(k)!r} -> {getattr(tc, k)!r}"
        for k in _RESUME_FIXED
        if k in saved and saved[k] != getattr(tc, k)
    ]
    if changed:
        raise ValueError(
            "resume must continue the same run, but these settings differ from the checkpoint's: "
            + "; ".join(changed)
            + ". Start a new run with a new --out instead."
        )


def stream_fingerprint(tokens: torch.Tensor) -> str:
    """sha256 of a token stream, to check that a resumed run reads the same data."""
    data = tokens.contiguous().view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).hexdigest()


def _prepare_data(
    tc: TrainConfig, tokenizer: Tokenizer | None
) -> tuple[torch.Tensor, torch.Tensor, Tokenizer]:
    if tokenizer is None and tc.tokenizer == "bpe":
        from .data import corpus_files, make_tokenizer, split_files

        train_files, _ = split_files(corpus_files(tc.data))
        tokenizer = make_tokenizer("bpe", train_files, vocab_size=tc.bpe_vocab_size)
    return load_splits(tc.data, tokenizer)


@dataclass
class _Run:
    """What a training run holds while it trains (built by `_start`)."""

    tc: TrainConfig
    out_dir: Path
    device: torch.device
    model: MoDTransformer
    model_config: MoDConfig
    opt: torch.optim.AdamW
    sampler: BatchSampler
    val: list[tuple[torch.Tensor, torch.Tensor]]
    tokenizer: Tokenizer
    fingerprint: str
    log: MetricsLog
    start_step: int
    elapsed: float  # training seconds so far (evaluation and checkpoints excluded)
    step_fn: Any = None
    lm_params: list[torch.nn.Parameter] = dataclasses.field(default_factory=list)
    predictor_params: list[torch.nn.Parameter] = dataclasses.field(default_factory=list)
    window_t: float = 0.0  # start of the current tokens/s window
    window_tokens: int = 0

    @property
    def ckpt_dir(self) -> Path:
        return self.out_dir / CHECKPOINT_NAME

    @property
    def seq_len(self) -> int:
        return self.tc.seq_len or self.model_config.max_seq_len

    @property
    def tokens_per_step(self) -> int:
        return self.tc.batch_size * self.seq_len


def _load_resume(tc: TrainConfig) -> tuple[Path, dict[str, Any]]:
    """The checkpoint to resume from and its trainer state, checked against `tc`."""
    ckpt = resolve_checkpoint(Path(tc.out) / CHECKPOINT_NAME)
    trainer_state = read_json(ckpt / "trainer.json")
    for key in ("step", "sampler", "train_config"):
        if key not in trainer_state:
            raise ValueError(f"{ckpt / 'trainer.json'} has no {key!r}: cannot resume exactly")
    _check_resume_config(trainer_state["train_config"], tc)
    return ckpt, trainer_state


def _start(model_config: MoDConfig | None, tc: TrainConfig, resume: bool, overwrite: bool) -> _Run:
    """Set up a new run, or restore one exactly from its checkpoint (`resume`)."""
    out_dir = Path(tc.out)
    device = resolve_device(tc.device)
    ckpt, trainer_state, tokenizer = None, None, None
    if resume:
        ckpt, trainer_state = _load_resume(tc)
        model, model_config = load_model(ckpt, map_location=device)
        tokenizer = load_tokenizer(ckpt)
    elif not overwrite and (
        (out_dir / CHECKPOINT_NAME / "config.json").exists() or (out_dir / "metrics.jsonl").exists()
    ):
        raise ValueError(
            f"{out_dir} already holds a run: resume it (--resume), start over (--overwrite), "
            "or pick another --out"
        )
    torch.manual_seed(tc.seed)
    train_tokens, val_tokens, tokenizer = _prepare_data(tc, tokenizer)
    fingerprint = stream_fingerprint(train_tokens)
    if trainer_state is not None and trainer_state.get("data_fingerprint", fingerprint) != (
        fingerprint
    ):
        raise ValueError(
            "the training data differ from the checkpoint's (another Python's standard library, "
            "or edited files?): a resumed run would read other tokens at the same step"
        )
    assert model_config is not None
    if model_config.vocab_size != tokenizer.vocab_size:
        if resume:
            raise ValueError(
                f"checkpoint vocab_size {model_config.vocab_size} does not match its "
                f"tokenizer's {tokenizer.vocab_size}"
            )
        model_config = dataclasses.replace(model_config, vocab_size=tokenizer.vocab_size)
    seq_len = tc.seq_len or model_config.max_seq_len
    if seq_len > model_config.max_seq_len:
        raise ValueError(
            f"seq_len {seq_len} exceeds the model's max_seq_len {model_config.max_seq_len}"
        )
    if not resume:
        model = MoDTransformer(model_config).to(device)
    model.train()
    opt = make_optimizer(model, tc)
    sampler = BatchSampler(train_tokens, tc.batch_size, seq_len, seed=tc.seed)
    if resume:
        opt_state = load_optimizer_state(ckpt)
        if opt_state is None:
            raise ValueError(f"{ckpt} has no optimizer state: cannot resume exactly")
        opt.load_state_dict(opt_state)
        sampler.load_state_dict(trainer_state["sampler"])
    try:
        val = eval_batches(val_tokens, tc.batch_size, seq_len, tc.eval_batches)
    except ValueError as exc:
        raise ValueError(
            f"the validation split is too short for seq_len {seq_len} ({exc}); use a smaller "
            "--seq-len or more data"
        ) from exc
    start_step = int(trainer_state["step"]) if trainer_state else 0
    log = MetricsLog(out_dir / "metrics.jsonl", start_step if resume else None)
    if not resume:
        write_json(
            out_dir / "run.json", {"model": model_config.to_dict(), "train": dataclasses.asdict(tc)}
        )
    run = _Run(
        tc=tc,
        out_dir=out_dir,
        device=device,
        model=model,
        model_config=model_config,
        opt=opt,
        sampler=sampler,
        val=val,
        tokenizer=tokenizer,
        fingerprint=fingerprint,
        log=log,
        start_step=start_step,
        elapsed=float(trainer_state.get("elapsed_s", 0.0)) if trainer_state else 0.0,
        step_fn=torch.compile(model) if tc.compile else model,
    )
    # The predictor is clipped on its own: its gradient must not rescale the LM's update.
    for name, param in model.named_parameters():
        (run.predictor_params if ".predictor." in name else run.lm_params).append(param)
    return run


def _train_step(run: _Run, step: int) -> tuple[MoDOutput, torch.Tensor, float]:
    """One optimizer step: the batch of `step`, forward, backward, clipping, AdamW. Returns the
    output, the (pre-clip) gradient norm of the LM parameters and the learning rate."""
    tc = run.tc
    lr = lr_at(step, tc)
    for group in run.opt.param_groups:
        group["lr"] = lr
    x, y = run.sampler.next_batch()
    x, y = x.to(run.device, non_blocking=True), y.to(run.device, non_blocking=True)
    with autocast_for(run.device):
        out = run.step_fn(x, y)
    out.loss.backward()
    # Clip before the step: clipping after it would be a no-op on this update.
    max_norm = tc.grad_clip if tc.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(run.lm_params, max_norm)
    if run.predictor_params:
        torch.nn.utils.clip_grad_norm_(run.predictor_params, max_norm)
    run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    run.window_tokens += run.tokens_per_step
    return out, grad_norm, lr


def _log_step(
    run: _Run, done: int, out: MoDOutput, grad_norm: torch.Tensor, lr: float, bar: tqdm
) -> None:
    """A JSON line of the step's losses, learning rate, gradient norm and tokens/s."""
    now = time.perf_counter()
    tok_s = run.window_tokens / max(now - run.window_t, 1e-9)
    run.elapsed += now - run.window_t
    run.window_t, run.window_tokens = now, 0
    rec = {
        "step": done,
        "loss": out.loss.item(),
        "lm_loss": out.lm_loss.item(),
        "aux_loss": out.aux_loss.item(),
        "lr": lr,
        "grad_norm": grad_norm.item(),
        "tokens_per_s": tok_s,
        "tokens": done * run.tokens_per_step,
    }
    run.log.write(rec)
    bar.set_postfix(  # no forced redraw: the bar's own mininterval decides
        loss=f"{rec['lm_loss']:.3f}",
        aux=f"{rec['aux_loss']:.3f}",
        tok_s=f"{tok_s:,.0f}",
        refresh=False,
    )


def _evaluate_and_save(run: _Run, done: int, bar: tqdm) -> dict[str, Any]:
    """Validation in both routing modes, logged, then an atomic checkpoint; the time this takes
    is kept out of the tokens/s window."""
    t0 = time.perf_counter()
    ev = evaluate(run.model, run.val, run.device)
    run.log.write({"step": done, **ev})
    bar.write(format_eval(done, ev))
    save_checkpoint(
        run.ckpt_dir,
        run.model,
        run.model_config,
        optimizer=run.opt,
        tokenizer=run.tokenizer,
        trainer_state={
            "step": done,
            "sampler": run.sampler.state_dict(),
            "data_fingerprint": run.fingerprint,
            "elapsed_s": run.elapsed,
            "train_config": dataclasses.asdict(run.tc),
        },
    )
    run.window_t += time.perf_counter() - t0
    return ev


def _finish(run: _Run, last_eval: dict[str, Any]) -> dict[str, Any]:
    """The run's summary (also written to summary.json) and its loss plot."""
    tc = run.tc
    summary = {
        "out": str(run.out_dir),
        "checkpoint": str(run.ckpt_dir),
        "steps": tc.steps,
        "tokens": tc.steps * run.tokens_per_step,
        "train_time_s": run.elapsed,
        "params": run.model.num_params(),
        "layer_kinds": run.model_config.layer_kinds,
        "capacity": run.model_config.capacity,
        **last_eval,
    }
    write_json(run.out_dir / "summary.json", summary)
    try:
        plot_metrics(run.out_dir / "metrics.jsonl", run.out_dir / "loss.png")
        summary["plot"] = str(run.out_dir / "loss.png")
    except Exception as exc:  # a plot is a convenience: never lose a finished run over it
        summary["plot_error"] = repr(exc)
    return summary


def train(
    model_config: MoDConfig | None,
    tc: TrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Train (or resume) and return a summary. With `resume`, `model_config` may be None.

    A new run refuses an `out` that already holds a checkpoint unless `overwrite`. On the CPU a
    resumed run reproduces an uninterrupted one bit for bit; on CUDA, nondeterministic kernels
    (flash-attention backward, index_add) make even two uninterrupted runs differ slightly.
    """
    run = _start(model_config, tc, resume, overwrite)
    last_eval: dict[str, Any] = {}
    bar = tqdm(
        total=tc.steps,
        initial=run.start_step,
        disable=not progress,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        # In a log file (CI, nohup) a redraw every 0.1 s is noise: one line every 30 s instead.
        mininterval=0.1 if sys.stderr.isatty() else 30.0,
    )
    run.window_t = time.perf_counter()
    for step in range(run.start_step, tc.steps):
        out, grad_norm, lr = _train_step(run, step)
        done = step + 1
        if done % tc.log_every == 0 or done == tc.steps:
            _log_step(run, done, out, grad_norm, lr, bar)
        bar.update(1)
        if done % tc.eval_every == 0 or done == tc.steps:
            last_eval = _evaluate_and_save(run, done, bar)
    bar.close()
    if not last_eval:  # resumed at the final step: nothing left to train
        last_eval = evaluate(run.model, run.val, run.device)
    return _finish(run, last_eval)


def format_eval(step: int, ev: dict[str, Any]) -> str:
    parts = [
        f"step {step}: val loss top-k {ev['val_loss_topk']:.4f}, causal {ev['val_loss_causal']:.4f}"
    ]
    if ev["routing_accuracy"]:
        acc = ", ".join(f"L{k} {v:.1%}" for k, v in ev["routing_accuracy"].items())
        parts.append(f"routing accuracy {acc}")
    if ev["causal_take_rate"]:
        take = ", ".join(f"L{k} {v:.1%}" for k, v in ev["causal_take_rate"].items())
        parts.append(f"causal take-rate {take}")
    return " | ".join(parts)


def format_eval_lines(ev: dict[str, Any]) -> list[str]:
    """Validation loss in both modes, then routing accuracy and take-rate per router."""
    lines = [
        f"validation loss (nats/token): top-k {ev['val_loss_topk']:.4f}   "
        f"causal {ev['val_loss_causal']:.4f}"
    ]
    for k, v in ev["routing_accuracy"].items():
        take = ev["causal_take_rate"].get(k)
        extra = f", causal take-rate {take:.1%}" if take is not None else ""
        lines.append(f"routing accuracy layer {k}: {v:.2%}{extra}")
    return lines


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"trained {s['steps']} steps, {s['tokens']:,} tokens in {s['train_time_s']:.0f} s "
        f"({s['params'] / 1e6:.2f}M parameters, layers {s['layer_kinds']}, "
        f"capacity {s['capacity']})",
        *format_eval_lines(s),
    ]
    lines.append(f"checkpoint: {s['checkpoint']}")
    if "plot" in s:
        lines.append(f"loss curve: {s['plot']}")
    return "\n".join(lines)


def plot_metrics(metrics_path: Path, png_path: Path) -> None:
    """Training and validation loss curves to a PNG (matplotlib, headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train_rows = [r for r in rows if "lm_loss" in r]
    eval_rows = [r for r in rows if "val_loss_topk" in r]
    routed = bool(eval_rows and eval_rows[-1]["routing_accuracy"])
    fig, axes = plt.subplots(
        1, 2 if routed else 1, figsize=(12 if routed else 7, 4), dpi=120, squeeze=False
    )
    ax = axes[0, 0]
    ax.plot(
        [r["step"] for r in train_rows],
        [r["lm_loss"] for r in train_rows],
        lw=1,
        label="train LM loss (top-k)",
    )
    for key, style in (("val_loss_topk", "o-"), ("val_loss_causal", "s--")):
        ax.plot(
            [r["step"] for r in eval_rows],
            [r[key] for r in eval_rows],
            style,
            label=key.replace("_", " "),
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    if routed:  # causal decision vs top-k, per router: how honest causal sampling will be
        ax = axes[0, 1]
        for name in eval_rows[-1]["routing_accuracy"]:
            ax.plot(
                [r["step"] for r in eval_rows],
                [100 * r["routing_accuracy"].get(name, float("nan")) for r in eval_rows],
                "o-",
                label=f"layer {name}",
            )
        ax.set_xlabel("step")
        ax.set_ylabel("routing accuracy (%)")
        ax.set_title("causal decision vs top-k membership", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    tmp = png_path.with_name(f".{png_path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(png_path)


def evaluate_checkpoint(
    checkpoint: str | Path,
    data: str | None = None,
    n_batches: int | None = None,
    batch_size: int | None = None,
    device: str = "auto",
) -> dict[str, Any]:
    """`mod eval`: validation loss in both modes and routing accuracy of a saved model."""
    dev = resolve_device(device)
    ckpt = resolve_checkpoint(checkpoint)
    model, cfg = load_model(ckpt, map_location=dev)
    tokenizer = load_tokenizer(ckpt)
    # Evaluate as the run did: its data and its sequence length (k = floor(capacity * T)).
    saved = {}
    if (ckpt / "trainer.json").exists():
        saved = read_json(ckpt / "trainer.json").get("train_config", {})
    if data is None:
        data = saved.get("data")
    seq_len = saved.get("seq_len") or cfg.max_seq_len
    batch_size = batch_size or saved.get("batch_size") or TrainConfig.batch_size
    n_batches = n_batches or saved.get("eval_batches") or TrainConfig.eval_batches
    _, val_tokens, _ = load_splits(data, tokenizer)
    batches = eval_batches(val_tokens, batch_size, seq_len, n_batches)
    return {"checkpoint": str(ckpt), **evaluate(model, batches, dev)}
