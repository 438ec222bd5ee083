"""The `mod` command: train, evaluate and inspect Mixture-of-Depths models."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any

from .config import FIELD_CHOICES, PRESETS, MoDConfig
from .fileio import json_text
from .malloc import keep_freed_memory

DEFAULT_PRESET = "small"


def _field_type(annotation: Any) -> Any:
    """The scalar type of a dataclass field annotation such as ``int | None``."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def _add_dataclass_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    skip: set[str],
    preset: bool = False,
    choices: dict[str, tuple[str, ...]] = FIELD_CHOICES,
) -> None:
    """One flag per field, default None so that only flags the user gave override anything.

    With `preset`, the flags override a model preset: their help shows what the default preset
    gives (a preset sets d_model, layers, heads...; d_ff and n_kv_heads follow from them), not the
    dataclass's own defaults, which no preset uses.
    """
    hints = typing.get_type_hints(cls)
    base = MoDConfig.preset(DEFAULT_PRESET) if preset else None
    from_preset = {k for p in PRESETS.values() for k in p} | {"d_ff", "n_kv_heads"}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        typ = _field_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        if base is not None:
            default = getattr(base, f.name)
            if f.name in from_preset:
                default = f"from --preset; {DEFAULT_PRESET}: {default}"
            if f.name == "aux_loss_weight":  # None resolves by the causal router
                default = "0.1 with the predictor, 0.01 with aux_loss"
        if typ is bool:
            parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"(default: {default})",
            )
        elif f.name in choices:
            parser.add_argument(
                flag,
                choices=choices[f.name],
                default=None,
                help=f"(default: {default})",
            )
        else:
            parser.add_argument(
                flag,
                type=typ,
                default=None,
                metavar=typ.__name__.upper(),
                help=f"(default: {default})",
            )


def _given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def build_parser() -> argparse.ArgumentParser:
    from .train import TRAIN_CHOICES, TrainConfig

    parser = argparse.ArgumentParser(
        prog="mod", description="Mixture-of-Depths transformers: train, evaluate, inspect."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "train",
        help="train a model (default: a small MoD model on the Python standard library)",
        description="Train a MoD (or dense) language model. Model flags override the preset; "
        "with --resume the model comes from the checkpoint in --out.",
    )
    p.add_argument(
        "--preset",
        default=None,
        choices=sorted(PRESETS),
        help=f"model preset (default: {DEFAULT_PRESET})",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its last checkpoint, exactly",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="start over even if --out already holds a run"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the final summary as JSON")
    model_group = p.add_argument_group("model (MoDConfig fields)")
    _add_dataclass_flags(model_group, MoDConfig, skip={"vocab_size"}, preset=True)
    train_group = p.add_argument_group("training")
    _add_dataclass_flags(train_group, TrainConfig, skip=set(), choices=TRAIN_CHOICES)

    p = sub.add_parser(
        "tune-routers",
        help="train only the routers (and predictors) of a checkpoint, the rest frozen",
        description="A new run from CHECKPOINT's weights (e.g. a dense model converted by `mod "
        "convert`) that trains only its routers and predictors, by the LM loss (through the "
        "straight-through gate) and the causal-router loss; --distill W adds W x KL(frozen dense "
        "model || MoD model); the capacity goes from 1.0 down to the model's over the first 10% "
        "of the steps (--capacity-warmup-ratio) or N steps (--capacity-warmup N). The same as "
        "`mod train --init-from CHECKPOINT --tune routers`.",
    )
    p.add_argument("checkpoint", help="checkpoint to start from")
    p.add_argument("--resume", action="store_true", help="continue this run in --out")
    p.add_argument("--overwrite", action="store_true", help="start over in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the final summary as JSON")
    p.set_defaults(preset=None)
    _add_dataclass_flags(p, TrainConfig, skip={"init_from"}, choices=TRAIN_CHOICES)

    p = sub.add_parser(
        "inspect",
        help="where the compute went, token by token: pictures and numbers",
        description="Route held-out text through a checkpoint in causal and top-k routing and "
        "write routing.png, depth_hist.png, skip_runs.png, entropy.png and report.md: blocks "
        "taken per token against independent per-router coins, the longest runs of skipped "
        "blocks and their loss, Spearman's rho of blocks taken against entropy and loss, and the "
        "share routed by token class.",
    )
    p.add_argument("checkpoint", help="checkpoint directory (e.g. runs/mod/checkpoint)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--data", default=None, help="text file or folder: its validation split "
                     "(default: the run's data)")  # fmt: skip
    src.add_argument("--text", default=None, help="inspect this text instead")
    p.add_argument("--out", default=None, help="(default: <checkpoint>/../inspect)")
    p.add_argument("--rows", type=int, default=8, help="held-out rows (default: 8)")
    p.add_argument(
        "--baseline",
        default=None,
        metavar="CHECKPOINT",
        help="a dense twin trained on the same tokenizer (e.g. runs/dense/checkpoint): adds each "
        "token's excess loss over it, by skip run and by blocks taken",
    )
    p.add_argument("--device", default="auto")

    p = sub.add_parser("eval", help="validation loss (top-k and causal) and routing accuracy")
    p.add_argument("checkpoint", help="checkpoint directory (e.g. runs/mod/checkpoint)")
    p.add_argument("--data", default=None, help="text file or folder (default: the run's data)")
    p.add_argument(
        "--batches",
        type=int,
        default=None,
        help="validation batches (default: the run's eval_batches)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="(default: the run's batch size, so the numbers match its last eval)",
    )
    p.add_argument(
        "--prefill-calibration",
        action="store_true",
        help="also score the second half of the first validation batch teacher-forced after "
        "prefilling the first half causally and with top-k, and count the prompt decisions that "
        "differ (MoD models; docs/semantics.md, KV strategies)",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true", help="print the result as JSON")

    p = sub.add_parser(
        "generate",
        help="sample text causally from a checkpoint, streaming",
        description="Sample from a trained model with causal routing and a KV cache that holds "
        "only the tokens that took each routed block.",
    )
    p.add_argument("--checkpoint", required=True, help="checkpoint directory")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default: 0.8)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="makes the sample reproducible")
    p.add_argument("--prefill", choices=("causal", "topk"), default="causal")
    p.add_argument(
        "--show-routing",
        action="store_true",
        help="colour each token by how many routed blocks it took, with a legend",
    )
    p.add_argument("--device", default="auto")

    p = sub.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face transformers folder (needs the [hf] extra)",
        description="Write a checkpoint as a transformers folder: config.json, model.safetensors, "
        "generation_config.json and the tokenizer. After `import mixture_of_depths.hf`, "
        "AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained load it. "
        "`mod convert --from-hf` brings it back.",
    )
    p.add_argument("checkpoint", help="checkpoint directory (e.g. runs/mod/checkpoint)")
    to = p.add_mutually_exclusive_group(required=True)
    to.add_argument("--hf", metavar="OUT", help="new folder of our model type (must not exist)")
    to.add_argument(
        "--llama",
        metavar="OUT",
        help="new folder in the Llama layout, for dense models (LlamaForCausalLM loads it)",
    )

    p = sub.add_parser(
        "convert",
        help="a Hugging Face folder to a checkpoint (a Llama or Mistral one becomes MoD)",
        description="Read a transformers folder and write our checkpoint. A MoD model exported "
        "by `mod export --hf` comes back exactly (needs the [hf] extra). A dense Llama or Mistral "
        "checkpoint (config.json, safetensors weights, tokenizer.json) becomes a MoD model: its "
        "weights unchanged, routers (and predictors) new, and a straight-through gate that is "
        "exactly 1 forward, so at --capacity 1.0 it computes the original's logits.",
    )
    p.add_argument("--from-hf", required=True, metavar="DIR", help="transformers model folder")
    p.add_argument("--out", required=True, help="new checkpoint directory (must not exist)")
    p.add_argument("--layer-pattern", default="DR", help="D dense, R routed, tiled (default: DR)")
    p.add_argument("--capacity", type=float, default=0.125, help="(default: 0.125)")
    p.add_argument(
        "--max-seq-len", type=int, default=None, help="(default: max_position_embeddings)"
    )
    p.add_argument(
        "--causal-router",
        choices=FIELD_CHOICES["causal_router"],
        default="aux_loss",
        help="(default: aux_loss)",
    )
    p.add_argument("--seed", type=int, default=0, help="of the new routers (default: 0)")

    p = sub.add_parser(
        "consolidate",
        help="turn a sharded checkpoint (FSDP2) into a single-file one",
        description="Read a sharded checkpoint (written by every rank of a torchrun job, the "
        "default under --parallel fsdp) into one process and write it as a single-file "
        "checkpoint: model.safetensors, the optimizer state, trainer state and tokenizer. "
        "`mod eval` and `mod generate` read both kinds; this one is the kind to share.",
    )
    p.add_argument("checkpoint", help="sharded checkpoint directory (e.g. runs/mod/checkpoint)")
    p.add_argument("out", help="new checkpoint directory (must not exist or be empty)")

    p = sub.add_parser(
        "flops",
        help="FLOPs per layer and KV-cache bytes, beside the dense twin",
        description="Analytic FLOPs of a model (training, top-k forward, decode) per layer, "
        "counted the way torch's FlopCounterMode counts them, beside its dense twin.",
    )
    p.add_argument(
        "--preset",
        default=None,
        choices=sorted(PRESETS),
        help=f"model preset (default: {DEFAULT_PRESET})",
    )
    p.add_argument("--checkpoint", default=None, help="take the model config from a checkpoint")
    p.add_argument("--seq-len", type=int, default=None, help="(default: the model's max_seq_len)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument(
        "--take-rate",
        type=float,
        default=None,
        help="share of generated tokens taking each routed layer (default: capacity)",
    )
    p.add_argument(
        "--decode-context",
        type=int,
        default=None,
        help="context length for the decode estimate (default: --seq-len)",
    )
    p.add_argument(
        "--expert-share",
        type=float,
        default=None,
        help="expert layers: share of token slots that run a real expert (default: the bound, "
        "1 or the capacity factor's)",
    )
    p.add_argument("--json", action="store_true")
    _add_dataclass_flags(
        p.add_argument_group("model (MoDConfig fields)"),
        MoDConfig,
        skip={"max_seq_len"},
        preset=True,
    )

    p = sub.add_parser(
        "study",
        help="the isoFLOP studies: MoD against dense, or MoD/MoE/MoDE (--plan mode), at equal "
        "training FLOPs (resumable)",
        description="Train dense and MoD models of several sizes to fixed training-FLOP budgets, "
        "plus ablations, and write results.jsonl, report.md and plots. Rerun to resume.",
    )
    p.add_argument(
        "--plan",
        default="isoflop",
        choices=["isoflop", "mode", "kv", "convert", "round2"],
        help="isoflop: MoD against dense over sizes, with ablations; mode: dense, MoD, MoE, MoE "
        "with dropping, staged and integrated MoDE; kv: the KV strategies (skipped_kv none and "
        "residual) at two capacities and two lengths; convert: a pretrained dense model "
        "converted to MoD, untrained, router-tuned, distilled, fully fine-tuned (docs/convert; "
        "needs the [hf] extra); round2: the second round on BPE tokens: routing ablations with "
        "compute-matched random baselines and diagnostics, then the grid at 256 and 1024 tokens "
        "of context with the winning causal router (docs/study/round2) (default: %(default)s)",
    )
    p.add_argument(
        "--max-runs",
        type=int,
        default=None,
        help="round2: stop after this many new runs, per worker (rerun to go on)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="results, report, plots (default: docs/study, or docs/study/<plan> for --plan "
        "mode and kv)",
    )
    p.add_argument(
        "--work",
        default=None,
        help="run folders (default: runs/study, or runs/study-<plan> for --plan mode and kv)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="round2: train this many runs at once, in separate processes sharing the cores "
        "(each with cores/workers threads): small models use one thread better than two "
        "(default: %(default)s)",
    )
    p.add_argument("--quick", action="store_true", help="tiny budgets and models: a smoke run")
    p.add_argument("--data", default=None, help="text file or folder (default: Python's stdlib)")
    p.add_argument("--keep-checkpoints", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)

    from .bench.suite import add_arguments as add_bench_arguments

    p = sub.add_parser(
        "bench",
        help="speed and memory, MoD against its dense twin, beside the FLOP-predicted ratios",
        description="Training step over capacities and lengths, one block, peak memory, decode, "
        "eager vs compiled; human tables, then one line of JSON.",
    )
    add_bench_arguments(p)

    p = sub.add_parser("presets", help="list the model presets")
    p.add_argument("--json", action="store_true")
    return parser


def cmd_train(args: argparse.Namespace) -> int:
    from .distributed import env_from_torchrun, restarted
    from .train import TrainConfig, format_summary, has_checkpoint, resume_config, train

    model_over = _given(args, MoDConfig)
    train_over = _given(args, TrainConfig)
    if restarted():
        # torchrun restarted the job after a worker died: go on from the last complete
        # checkpoint, or start over the folder the dead attempt began (nothing was saved yet).
        out = Path(train_over.get("out", TrainConfig.out))
        args.resume, args.overwrite = has_checkpoint(out), not has_checkpoint(out)
        print(
            f"note: restarted by torchrun; {'resuming' if args.resume else 'starting over'}",
            file=sys.stderr,
        )
    if getattr(args, "command", "") == "tune-routers":
        train_over = {"tune": "routers", "out": "runs/tuned", **train_over}
        train_over["init_from"] = args.checkpoint
    if (args.resume or train_over.get("init_from")) and (model_over or args.preset):
        print(
            "note: the model comes from the checkpoint; model flags are ignored",
            file=sys.stderr,
        )
    if args.resume:
        tc = resume_config(train_over.get("out", TrainConfig.out), train_over)
        summary = train(None, tc, resume=True, progress=not args.no_progress)
    elif train_over.get("init_from"):
        tc = TrainConfig(**train_over)
        summary = train(None, tc, overwrite=args.overwrite, progress=not args.no_progress)
    else:
        cfg = MoDConfig.preset(args.preset or DEFAULT_PRESET, **model_over)
        tc = TrainConfig(**train_over)
        summary = train(cfg, tc, overwrite=args.overwrite, progress=not args.no_progress)

    if env_from_torchrun().is_main:  # under torchrun, rank 0 reports for the job
        print(json_text(summary) if args.json else format_summary(summary))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from .train import evaluate_checkpoint, format_eval_lines

    res = evaluate_checkpoint(
        args.checkpoint,
        data=args.data,
        n_batches=args.batches,
        batch_size=args.batch_size,
        device=args.device,
        prefill_calibration=args.prefill_calibration,
    )
    if args.json:
        print(json_text(res))
        return 0
    print(f"checkpoint: {res['checkpoint']}")
    print("\n".join(format_eval_lines(res)))
    return 0


# 256-colour ANSI shades from cold (no routed block taken) to hot (all taken).
_HEAT = (244, 39, 45, 48, 118, 226, 214, 208, 202, 196)


def _heat(count: int, total: int) -> int:
    return _HEAT[0] if count == 0 else _HEAT[1 + round((count / total) * (len(_HEAT) - 2))]


def _paint(text: str, count: int, total: int) -> str:
    return f"\x1b[38;5;{_heat(count, total)}m{text}\x1b[0m"


def cmd_generate(args: argparse.Namespace) -> int:
    from .checkpoint import load_model, resolve_checkpoint
    from .data import load_tokenizer
    from .generate import router_names
    from .train import resolve_device

    device = resolve_device(args.device)
    ckpt = resolve_checkpoint(args.checkpoint)
    model, cfg = load_model(ckpt, map_location=device)
    tokenizer = load_tokenizer(ckpt)
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise ValueError("--prompt encodes to no tokens: give some text")
    room = cfg.max_seq_len - len(prompt)
    if room < 1:
        raise ValueError(
            f"the prompt is {len(prompt)} tokens; the model's max_seq_len is {cfg.max_seq_len}"
        )
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    n_new = min(args.max_new_tokens, room)
    if n_new < args.max_new_tokens:
        print(
            f"note: max_new_tokens cut to {n_new} to fit max_seq_len={cfg.max_seq_len}",
            file=sys.stderr,
        )
    show = args.show_routing
    if show and not router_names(model):
        print("note: a dense model has no routed blocks: nothing to colour", file=sys.stderr)
        show = False
    (_stream_routing if show else _stream_text)(args, model, tokenizer, prompt, n_new)
    return 0


def _stream_text(
    args: argparse.Namespace, model: Any, tokenizer: Any, prompt: list, n: int
) -> None:
    """Print the prompt, then each sampled token as soon as it is sampled."""
    from .generate import stream

    steps = stream(
        model,
        [prompt],
        n,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_id=tokenizer.eot_id,
        seed=args.seed,
        prefill=args.prefill,
    )
    out = sys.stdout
    out.write(args.prompt)
    ids: list[int] = []
    shown = ""
    for st in steps:
        if st.tokens[0] == tokenizer.eot_id:
            break
        ids.append(st.tokens[0])
        text = tokenizer.decode(ids)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            out.write(text[len(shown) :])
            out.flush()
            shown = text
    out.write(tokenizer.decode(ids)[len(shown) :] + "\n")


def _stream_routing(
    args: argparse.Namespace, model: Any, tokenizer: Any, prompt: list, n: int
) -> None:
    """Print each token coloured by how many routed blocks it took, then a legend and the share
    of tokens per routed layer. A token is printed once its own routing is known, i.e. once it
    has been fed through the model at the next step: the coloured stream runs one token behind."""
    import torch

    from .generate import Generation, router_names

    names = router_names(model)
    gen = Generation(
        model,
        [prompt],
        n,
        args.temperature,
        args.top_k,
        args.top_p,
        tokenizer.eot_id,
        args.seed,
        args.prefill,
        feed_last=True,
    )
    out = sys.stdout
    pending: list[int] = []

    def emit(tok: int, routing: torch.Tensor) -> None:
        pending.append(tok)
        piece = tokenizer.decode(pending)
        if not piece.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            out.write(_paint(piece, int(routing.sum()), len(names)))
            out.flush()
            pending.clear()

    new_ids: list[int] = []
    fed = gen.token_routing[0]  # grows as generated tokens are fed back
    printed = 0

    def flush_fed() -> None:
        nonlocal printed
        for j in range(printed, len(fed)):
            emit(new_ids[j], fed[j])
        printed = len(fed)

    for i, st in enumerate(gen.steps()):
        if i == 0:
            for tok, routing in zip(prompt, gen.prompt_routing[0], strict=True):
                emit(tok, routing)
        new_ids.append(st.tokens[0])
        flush_fed()
    flush_fed()  # the final token, fed after the last step
    routing_all = torch.cat([gen.prompt_routing[0], *[r[None] for r in fed]])
    out.write("\n\n")
    legend = " ".join(_paint(f"{c}", c, len(names)) for c in range(len(names) + 1))
    took = routing_all.float().mean(0).tolist()
    out.write(f"routed blocks taken per token (of {len(names)}): {legend}\n")
    out.write(
        "share of tokens per routed layer: "
        + ", ".join(f"L{name} {t:.0%}" for name, t in zip(names, took, strict=True))
        + f" (capacity {model.config.capacity:.1%})\n"
    )


def cmd_flops(args: argparse.Namespace) -> int:
    from .flops import estimate_flops, format_report

    if args.checkpoint is not None:
        from .checkpoint import load_config

        cfg = load_config(args.checkpoint)
    else:
        cfg = MoDConfig.preset(args.preset or DEFAULT_PRESET, **_given(args, MoDConfig))
    report = estimate_flops(
        cfg,
        cfg.max_seq_len if args.seq_len is None else args.seq_len,
        args.batch_size,
        take_rate=args.take_rate,
        decode_context=args.decode_context,
        expert_share=args.expert_share,
    )
    print(json_text(report.to_dict()) if args.json else format_report(report))
    return 0


def cmd_study(args: argparse.Namespace) -> int:
    from .study import ISOFLOP, study
    from .study_kv import PLAN as KV
    from .study_mode import PLAN as MODE

    if args.workers != 1 and args.plan != "round2":
        raise ValueError(f"--workers applies to --plan round2 only, got {args.workers} with "
                         f"--plan {args.plan}")  # fmt: skip
    if args.plan == "convert":
        from .study_convert import OUT
        from .study_convert import run as convert_study

        results = convert_study(
            args.out, args.work, args.quick, args.data, progress=not args.no_progress
        )
        out = args.out or (OUT + ("-quick" if args.quick else ""))
        print(f"{len(results)} models in {out}/results.jsonl; report: {out}/report.md")
        return 0
    if args.plan == "round2":
        from .study_round2 import OUT as R2
        from .study_round2 import run as round2

        if args.max_runs is not None and args.max_runs < 1:
            raise ValueError(f"--max-runs must be >= 1, got {args.max_runs}")
        out = args.out or (R2 + ("-quick" if args.quick else ""))
        if args.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {args.workers}")
        if args.workers > 1:
            return _study_workers(args, out)
        results = round2(
            args.out,
            args.work,
            args.quick,
            args.data,
            not args.no_progress,
            args.max_runs,
            worker=args.worker_index,
        )
        print(f"{len(results)} runs in {out}/results.jsonl; report: {out}/report.md")
        return 0
    plan = {"isoflop": ISOFLOP, "mode": MODE, "kv": KV}[args.plan]
    results = study(
        args.out,
        args.work,
        quick=args.quick,
        data=args.data,
        keep_checkpoints=args.keep_checkpoints,
        progress=not args.no_progress,
        plan=plan,
    )
    out = args.out or plan.out
    print(f"{len(results)} runs in {out}/results.jsonl; report: {out}/report.md")
    return 0


def _study_workers(args: argparse.Namespace, out: str) -> int:
    """`mod study --plan round2 --workers N`: N processes of the study, each claiming its own
    runs (`study_round2.run`), with the cores split between them. Each prints a line per run
    it finishes; a bar per process would garble the terminal."""
    import signal
    import subprocess

    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))  # the cores this process may use
    else:
        cores = os.cpu_count() or 1
    if args.workers > cores:
        raise ValueError(f"--workers must be at most the {cores} cores here, got {args.workers}")
    threads = max(1, cores // args.workers)
    cmd = [sys.executable, "-m", "mixture_of_depths", "study", "--plan", "round2", "--no-progress"]
    for flag, value in (("--out", args.out), ("--work", args.work), ("--data", args.data),
                        ("--max-runs", args.max_runs)):  # fmt: skip
        if value is not None:
            cmd += [flag, str(value)]
    if args.quick:
        cmd.append("--quick")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    print(f"{args.workers} workers, {threads} thread(s) each; results in {out}/results.jsonl",
          flush=True)  # fmt: skip
    procs = [
        subprocess.Popen([*cmd, "--worker-index", str(i)], env=env) for i in range(args.workers)
    ]

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)  # a kill stops the workers too
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        for p in procs:  # a terminal's Ctrl-C reached them too; a kill did not
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    bad = [c for c in codes if c != 0]
    if bad:
        print(f"mod study: {len(bad)} of {args.workers} workers failed (exit {bad[0]})",
              file=sys.stderr)  # fmt: skip
        return bad[0]
    print(f"report: {out}/report.md")
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    from .model import MoDTransformer

    rows = {}
    for name in sorted(PRESETS):
        cfg = MoDConfig.preset(name)
        import torch

        with torch.device("meta"):
            n = MoDTransformer(cfg).num_params()
        rows[name] = {**PRESETS[name], "params": n}
    if args.json:
        print(json_text(rows))
    else:
        for name, row in rows.items():
            cfg = MoDConfig.preset(name)
            experts = ""
            if cfg.has_experts:
                experts = (
                    f" experts={cfg.n_experts}+{cfg.n_noop_experts} no-op "
                    f"top-{cfg.experts_per_token} d_ff_expert={cfg.d_ff_expert}"
                    + (
                        ""
                        if cfg.expert_capacity_factor is None
                        else f" expert_capacity_factor={cfg.expert_capacity_factor}"
                    )
                )
            print(
                f"{name:21s} {row['params'] / 1e6:6.2f}M params  d_model={cfg.d_model} "
                f"n_layers={cfg.n_layers} n_heads={cfg.n_heads}/{cfg.n_kv_heads} "
                f"max_seq_len={cfg.max_seq_len} layers={cfg.layer_kinds} capacity={cfg.capacity}"
                + experts
            )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench.suite import run

    run(args)
    return 0


def _hf() -> types.ModuleType:
    try:
        from . import hf
    except ImportError as exc:
        raise RuntimeError(str(exc)) from None
    return hf


def cmd_export(args: argparse.Namespace) -> int:
    if args.hf:
        out = _hf().export_checkpoint(args.checkpoint, args.hf)
    else:
        out = _hf().export_llama(args.checkpoint, args.llama)
    files = ", ".join(sorted(f.name for f in out.iterdir()))
    kind = "Llama" if args.llama else "transformers"
    print(f"{out}: {kind} folder of {args.checkpoint} ({files})")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from .convert import convert_folder, read_config

    if read_config(args.from_hf).get("model_type") == "mixture_of_depths":
        out = _hf().import_pretrained(args.from_hf, args.out)
        print(f"{out}: checkpoint of {args.from_hf}")
        return 0
    out, cfg = convert_folder(
        args.from_hf,
        args.out,
        args.layer_pattern,
        args.capacity,
        args.max_seq_len,
        args.seed,
        causal_router=args.causal_router,
    )
    routed = sum(kind == "R" for kind in cfg.layer_kinds)
    print(
        f"{out}: MoD checkpoint of {args.from_hf}: {cfg.n_layers} layers ({routed} routed at "
        f"capacity {cfg.capacity}, new routers, straight-through gate), d_model {cfg.d_model}"
    )
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    import torch

    from .checkpoint import load_model, read_json_file, resolve_checkpoint
    from .data import ByteTokenizer, eval_batches, load_splits, load_tokenizer
    from .inspect import analyse, class_table, extremes, html_page, plot, report_md
    from .train import resolve_device

    if args.rows < 1:
        raise ValueError(f"--rows must be >= 1, got {args.rows}")
    ckpt = resolve_checkpoint(args.checkpoint)
    device = resolve_device(args.device)
    model, cfg = load_model(ckpt, map_location=device)
    tokenizer = load_tokenizer(ckpt)
    baseline = None
    if args.baseline is not None:
        base_ckpt = resolve_checkpoint(args.baseline)
        base_tok = load_tokenizer(base_ckpt)
        if base_tok.fingerprint() != tokenizer.fingerprint():
            raise ValueError(
                f"--baseline {args.baseline} has another tokenizer ({base_tok!r}) than "
                f"{args.checkpoint} ({tokenizer!r}): a per-token comparison needs the same tokens"
            )
        baseline = load_model(base_ckpt, map_location=device)[0]
    if args.text is not None:
        ids = tokenizer.encode(args.text)
        if len(ids) > cfg.max_seq_len:
            print(
                f"note: --text is {len(ids)} tokens; only the first {cfg.max_seq_len} (the "
                "model's max_seq_len) are inspected",
                file=sys.stderr,
            )
            ids = ids[: cfg.max_seq_len]
        if not ids:
            raise ValueError("--text encodes to no tokens: give some text")
        tokens = torch.tensor([ids])
    else:
        data = args.data
        if data is None and (ckpt / "trainer.json").exists():
            data = read_json_file(ckpt / "trainer.json").get("train_config", {}).get("data")
        val = load_splits(data, tokenizer)[1]
        tokens = eval_batches(val, args.rows, cfg.max_seq_len, 1)[0][0]
    report = analyse(model, tokens, baseline=baseline)
    out = Path(args.out) if args.out else ckpt.parent / "inspect"
    out.mkdir(parents=True, exist_ok=True)
    pictures = plot(report, out, tokens.shape[1])

    def tokenizer_text(i: int) -> str:
        if isinstance(tokenizer, ByteTokenizer):  # one byte of a character may not decode alone
            return "" if i == tokenizer.eot_id else bytes([i]).decode("latin-1")
        return tokenizer.decode([i])

    is_byte = isinstance(tokenizer, ByteTokenizer)
    classes = class_table(report, None if is_byte else tokenizer_text)
    extreme = None if is_byte else extremes(report)
    text = report_md(report, classes, extreme, lambda i: repr(tokenizer_text(i)))
    from .fileio import atomic_write_text

    atomic_write_text(out / "report.md", text)
    images = {p.stem: p for p in pictures}
    atomic_write_text(out / "index.html", html_page(report, tokenizer_text, images, text))
    c = report.correlations
    print(
        f"{out}: index.html, report.md, routing.png, depth_hist.png, skip_runs.png, entropy.png "
        f"({len(report.tokens)} tokens; rho depth~entropy {c['depth_vs_entropy']['rho']:+.3f}, "
        f"depth~loss {c['depth_vs_loss']['rho']:+.3f}"
        + (
            f", depth~baseline loss {c['depth_vs_baseline_loss']['rho']:+.3f}"
            if "depth_vs_baseline_loss" in c
            else ""
        )
        + ")"
    )
    return 0


def cmd_consolidate(args: argparse.Namespace) -> int:
    from .checkpoint import consolidate_checkpoint, load_config, resolve_checkpoint

    src = resolve_checkpoint(args.checkpoint)
    out = consolidate_checkpoint(src, args.out)
    cfg = load_config(out)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(
        f"{out}: single-file checkpoint of {src} ({cfg.n_layers} layers, d_model "
        f"{cfg.d_model}; {size / 1e6:.1f} MB)"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {
        "train": cmd_train,
        "tune-routers": cmd_train,
        "eval": cmd_eval,
        "generate": cmd_generate,
        "consolidate": cmd_consolidate,
        "inspect": cmd_inspect,
        "export": cmd_export,
        "convert": cmd_convert,
        "flops": cmd_flops,
        "study": cmd_study,
        "bench": cmd_bench,
        "presets": cmd_presets,
    }
    try:
        keep_freed_memory()  # reuse freed blocks: page faults took a third of a BPE step on CPU
        return handlers[args.command](args)
    except (ValueError, OSError, RuntimeError) as exc:  # our errors say what to do
        print(f"mod {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
