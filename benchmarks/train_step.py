"""Training-step throughput: an MoD model against its dense twin of the same size.

Three models are timed side by side in one run, on the same seed and the same batch:

- ``mod``: the preset with ``layer_pattern="DR"`` at capacity 0.125 (the paper's best);
- ``dense``: ``cfg.dense_twin()``, every block dense, otherwise identical;
- ``cap1``: the routed model at capacity 1.0, which does the dense model's work plus routing
  (router, top-k sort, gather, scatter, gate). Its excess over dense is the routing overhead.

A step is forward + backward + AdamW step. Models are interleaved round-robin (the order rotates
every round) so clock drift, thermal throttling and allocator warm-up hit all of them alike; the
median step time per model is reported. The measured MoD/dense speed-up is printed beside the
speed-up that FLOP counting predicts (`train_step_flops`) and their quotient: DESIGN.md section 4
asks for measured >= 95% of predicted, and capacity 1.0 <= 3% over dense.

The ``range`` column is (slowest - fastest) / median of a model's timed steps: a large one means
the timings were disturbed. On Linux the script also reports the share of the CPUs that other
processes used during the run and warns when it is above 10%. With ``--compile`` the first steps
compile (forward, then backward): keep ``--warmup`` at 3 or more.

    python benchmarks/train_step.py                      # preset small, defaults below
    python benchmarks/train_step.py --preset tiny --steps 2 --warmup 1
    python benchmarks/train_step.py --device cuda --compile --batch-size 32

The last line printed is one JSON object with every number, for scripts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from _common import cpu_snapshot, others_busy

from mixture_of_depths import MoDConfig, MoDTransformer

SPEEDUP_BAR = 0.95  # measured speed-up must reach this fraction of the FLOP-predicted one
CAP1_OVERHEAD_BAR = 0.03  # capacity 1.0 may cost at most this much over dense


def train_step_flops(cfg: MoDConfig, seq_len: int, batch_size: int = 1) -> float:
    """FLOPs of one training step (forward + backward = 3x forward) in top-k routing.

    Per layer, with n tokens processed (``seq_len`` in a dense block,
    ``cfg.capacity_tokens(seq_len)`` in a routed one): 2 FLOPs per multiply-add of the attention
    projections (q, k, v, o) and of the SwiGLU MLP (w1, w3, w2) for each of the n tokens; attention
    scores ``QK^T`` and values ``AV`` over the n(n+1)/2 causal query-key pairs, counted the same way
    for every block; the routers' ``x @ w`` over all ``seq_len`` tokens. Plus the lm_head over every
    token; the embedding is a lookup (0 FLOPs). Norms, RoPE, softmax, gather/scatter and the loss
    are not counted.
    """
    d, hd = cfg.d_model, cfg.head_dim
    attn_weights = 2 * d * cfg.n_heads * hd + 2 * d * cfg.n_kv_heads * hd  # wq, wo + wk, wv
    mlp_weights = 3 * d * cfg.d_ff
    routers = 1 if cfg.routing == "joint" else 2
    forward = 0.0
    for kind in cfg.layer_kinds:
        n = seq_len if kind == "D" else cfg.capacity_tokens(seq_len)
        forward += 2 * n * (attn_weights + mlp_weights)
        forward += 2 * 2 * cfg.n_heads * hd * n * (n + 1) / 2  # QK^T and AV, causal pairs
        if kind == "R":
            forward += 2 * seq_len * d * routers
    forward += 2 * seq_len * d * cfg.vocab_size  # lm_head
    return 3 * batch_size * forward


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(
        description="Training-step tokens/s of an MoD model vs its dense twin (and capacity 1.0).",
    )
    p.add_argument("--preset", default="small", help="MoDConfig preset (default: small)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (default: 8)")
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per sequence (default: the preset's max_seq_len)",
    )
    p.add_argument("--steps", type=int, default=10, help="timed steps per model (default: 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per model (default: 3)")
    p.add_argument(
        "--device",
        default="cuda" if cuda else "cpu",
        help="torch device (default: cuda if available, else cpu)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="bfloat16 runs under torch.autocast (default: bfloat16 on cuda, else float32)",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile the models")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument(
        "--capacity", type=float, default=0.125, help="capacity of the MoD model (default: 0.125)"
    )
    p.add_argument(
        "--layer-pattern", default="DR", help="layer pattern of the routed models (default: DR)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed for weights and batch (default: 0)")
    args = p.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bfloat16" if torch.device(args.device).type == "cuda" else "float32"
    for name in ("batch_size", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    return args


def make_step(
    model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype
) -> Callable[[], None]:
    """One training step: forward, backward, AdamW step, grads set to None."""
    device_type = idx.device.type
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        if dtype == torch.float32:
            ctx = contextlib.nullcontext()
        else:
            ctx = torch.autocast(device_type=device_type, dtype=dtype)
        with ctx:
            loss = model(idx, targets).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    base = MoDConfig.preset(args.preset)
    seq_len = args.seq_len if args.seq_len is not None else base.max_seq_len
    if not 1 <= seq_len <= base.max_seq_len:
        raise SystemExit(f"--seq-len {seq_len} must be in [1, max_seq_len={base.max_seq_len}]")
    mod_cfg = MoDConfig.preset(
        args.preset, layer_pattern=args.layer_pattern, capacity=args.capacity
    )
    configs = {
        "mod": mod_cfg,
        "dense": mod_cfg.dense_twin(),
        "cap1": MoDConfig.preset(args.preset, layer_pattern=args.layer_pattern, capacity=1.0),
    }

    gen = torch.Generator().manual_seed(args.seed)
    data = torch.randint(0, base.vocab_size, (args.batch_size, seq_len + 1), generator=gen)
    idx, targets = data[:, :-1].to(device), data[:, 1:].to(device)

    steps, params = {}, {}
    for name, cfg in configs.items():
        torch.manual_seed(args.seed)
        model = MoDTransformer(cfg).to(device).train()
        params[name] = model.num_params()
        if args.compile:
            model = torch.compile(model)
        steps[name] = make_step(model, idx, targets, dtype)

    names = list(steps)
    snapshot = cpu_snapshot()
    times: dict[str, list[float]] = {name: [] for name in names}
    for rnd in range(args.warmup + args.steps):
        order = names[rnd % len(names) :] + names[: rnd % len(names)]  # rotate each round
        for name in order:
            sync()
            t0 = time.perf_counter()
            steps[name]()
            sync()
            if rnd >= args.warmup:
                times[name].append(time.perf_counter() - t0)

    busy = others_busy(snapshot, cpu_snapshot())
    tokens = args.batch_size * seq_len
    ms = {name: 1e3 * statistics.median(times[name]) for name in names}
    spread = {name: 1e3 * (max(times[name]) - min(times[name])) / ms[name] for name in names}
    tps = {name: tokens / (ms[name] / 1e3) for name in names}
    flops = {name: train_step_flops(cfg, seq_len, args.batch_size) for name, cfg in configs.items()}
    speedup = tps["mod"] / tps["dense"]
    predicted = flops["dense"] / flops["mod"]
    fraction = speedup / predicted
    overhead = ms["cap1"] / ms["dense"] - 1

    labels = {
        "mod": f"MoD {args.layer_pattern} c={args.capacity:g}",
        "dense": "dense twin",
        "cap1": f"routed {args.layer_pattern} c=1.0",
    }
    print(
        f"train step (fwd+bwd+AdamW): preset={args.preset} batch={args.batch_size} "
        f"seq_len={seq_len} device={device.type} dtype={args.dtype} compile={args.compile} "
        f"threads={torch.get_num_threads()} steps={args.steps} warmup={args.warmup}"
    )
    header = (
        f"{'model':<18} {'params':>11} {'ms/step':>9} {'tokens/s':>11} {'vs dense':>9} "
        f"{'GFLOP/step':>11} {'range':>7}"
    )
    print(header)
    print("-" * len(header))
    for name in names:
        print(
            f"{labels[name]:<18} {params[name]:>11,} {ms[name]:>9.1f} {tps[name]:>11,.0f} "
            f"{tps[name] / tps['dense']:>8.3f}x {flops[name] / 1e9:>11.2f} "
            f"{100 * spread[name]:>6.1f}%"
        )
    print(
        f"MoD/dense speed-up: measured {speedup:.3f}, FLOP-predicted {predicted:.3f}, "
        f"X/Y = {fraction:.3f}"
    )
    print(f"capacity-1.0 overhead vs dense: {100 * overhead:+.1f}%")
    if device.type == "cpu" and busy is not None and busy > 0.1:
        print(
            f"note: other processes kept {100 * busy:.0f}% of the CPUs busy during the run, so "
            "these numbers are noisy"
        )

    result = {
        "preset": args.preset,
        "batch_size": args.batch_size,
        "seq_len": seq_len,
        "device": device.type,
        "dtype": args.dtype,
        "compile": args.compile,
        "threads": torch.get_num_threads(),
        "steps": args.steps,
        "warmup": args.warmup,
        "capacity": args.capacity,
        "layer_pattern": args.layer_pattern,
        "capacity_tokens": mod_cfg.capacity_tokens(seq_len),
        **{f"{name}_params": params[name] for name in names},
        **{f"{name}_ms_per_step": ms[name] for name in names},
        **{f"{name}_range_rel": spread[name] for name in names},
        **{f"{name}_tokens_per_s": tps[name] for name in names},
        **{f"{name}_flops_per_step": flops[name] for name in names},
        "speedup_measured": speedup,
        "speedup_flop_predicted": predicted,
        "speedup_fraction_of_predicted": fraction,
        "speedup_bar": SPEEDUP_BAR,
        "cap1_overhead": overhead,
        "cap1_overhead_bar": CAP1_OVERHEAD_BAR,
        "cpu_busy_others": busy,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
