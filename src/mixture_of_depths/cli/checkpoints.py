"""`mod export`, `mod convert` and `mod consolidate`: checkpoints to and from Hugging Face
folders, and a sharded checkpoint made single-file."""

from __future__ import annotations

import argparse
import types
from pathlib import Path
from typing import Any

from ..config import FIELD_CHOICES
from ..convert import convert_folder, read_config
from ..fileio import check_out_folder
from ..runtime.checkpoint import consolidate_checkpoint, load_config, resolve_checkpoint
from .flags import OUT_CHECKPOINT


def add_export(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="write a checkpoint as a Hugging Face transformers folder (needs the [hf] extra)",
        description="Write a checkpoint as a transformers folder: config.json, model.safetensors, "
        "generation_config.json and the tokenizer. After `import mixture_of_depths.hf`, "
        "AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained load it. "
        "`mod convert --from-hf` brings it back.",
    )
    p.add_argument("checkpoint", help="checkpoint directory (e.g. runs/mod/checkpoint)")
    to = p.add_mutually_exclusive_group(required=True)
    to.add_argument("--hf", metavar="OUT", help="the folder to write (new, or empty)")
    to.add_argument(
        "--llama",
        metavar="OUT",
        help="new folder in the Llama layout, for dense models (LlamaForCausalLM loads it)",
    )


def add_convert(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="a Hugging Face folder to a checkpoint (a Llama or Mistral one becomes MoD)",
        description="Read a transformers folder and write our checkpoint. A MoD model exported "
        "by `mod export --hf` comes back exactly (needs the [hf] extra). A dense Llama or Mistral "
        "checkpoint (config.json, safetensors weights, tokenizer.json) becomes a MoD model: its "
        "weights unchanged, routers (and predictors) new, and a straight-through gate that is "
        "exactly 1 forward, so at --capacity 1.0 it computes the original's logits.",
    )
    p.add_argument("--from-hf", required=True, metavar="DIR", help="transformers model folder")
    p.add_argument("--out", required=True, help=OUT_CHECKPOINT)
    p.add_argument("--layer-pattern", default="DR", help="D dense, R routed, tiled (default: DR)")
    p.add_argument(
        "--capacity",
        type=float,
        default=0.125,
        help="share of the tokens each routed block takes (default: 0.125)",
    )
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="longest context of the MoD model (default: max_position_embeddings)",
    )
    p.add_argument(
        "--routing",
        choices=FIELD_CHOICES["routing"],
        default="joint",
        help="what the routed blocks route (default: joint, the whole block; mlp_kv: every "
        "token queries, the takers are keys and values and take the MLP)",
    )
    p.add_argument(
        "--causal-router",
        choices=FIELD_CHOICES["causal_router"],
        default="aux_loss",
        help="the new routers' causal decision: the router's logit trained by an auxiliary "
        "loss, or a predictor (default: aux_loss)",
    )
    p.add_argument("--seed", type=int, default=0, help="of the new routers (default: 0)")


def add_consolidate(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="turn a sharded checkpoint (FSDP2) into a single-file one",
        description="Read a sharded checkpoint (written by every rank of a torchrun job, the "
        "default under --parallel fsdp) into one process and write it as a single-file "
        "checkpoint: model.safetensors, the optimizer state, trainer state and tokenizer. "
        "`mod eval` and `mod generate` read both kinds; this one is the kind to share.",
    )
    p.add_argument("checkpoint", help="sharded checkpoint directory (e.g. runs/mod/checkpoint)")
    p.add_argument("out", help=OUT_CHECKPOINT)


def _hf() -> types.ModuleType:
    try:
        from .. import hf
    except ImportError as exc:
        raise RuntimeError(str(exc)) from None
    return hf


def run_export(args: argparse.Namespace) -> int:
    if args.hf:
        out = _hf().export_checkpoint(args.checkpoint, args.hf)
    else:
        out = _hf().export_llama(args.checkpoint, args.llama)
    files = ", ".join(sorted(f.name for f in out.iterdir()))
    kind = "Llama" if args.llama else "transformers"
    print(f"{out}: {kind} folder of {args.checkpoint} ({files})")
    return 0


def run_convert(args: argparse.Namespace) -> int:
    check_out_folder(Path(args.out), "--out")
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
        routing=args.routing,
        causal_router=args.causal_router,
    )
    routed = sum(kind == "R" for kind in cfg.layer_kinds)
    print(
        f"{out}: MoD checkpoint of {args.from_hf}: {cfg.n_layers} layers ({routed} routed at "
        f"capacity {cfg.capacity}, {cfg.routing} routing, new routers, straight-through gate), "
        f"d_model {cfg.d_model}"
    )
    return 0


def run_consolidate(args: argparse.Namespace) -> int:
    src = resolve_checkpoint(args.checkpoint)
    out = consolidate_checkpoint(src, args.out)
    cfg = load_config(out)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(
        f"{out}: single-file checkpoint of {src} ({cfg.n_layers} layers, d_model "
        f"{cfg.d_model}; {size / 1e6:.1f} MB)"
    )
    return 0
