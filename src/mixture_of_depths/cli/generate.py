"""`mod generate`: sample causally from a checkpoint, streaming, optionally coloured by the
routed blocks each token took."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

import torch

from ..data import load_tokenizer
from ..generate import Generation, router_names, stream
from ..runtime.checkpoint import load_model, resolve_checkpoint
from ..runtime.device import resolve_device
from .flags import add_checkpoint, checkpoint_arg


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="sample text causally from a checkpoint, streaming",
        description="Sample from a trained model with causal routing and a KV cache that holds "
        "only the tokens that took each routed block.",
    )
    add_checkpoint(p, "checkpoint directory (or a run folder)")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="0 (or below 1e-5) is greedy (default: 0.8)",
    )
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


# 256-colour ANSI shades from cold (no routed block taken) to hot (all taken).
_HEAT = (244, 39, 45, 48, 118, 226, 214, 208, 202, 196)


def _heat(count: int, total: int) -> int:
    return _HEAT[0] if count == 0 else _HEAT[1 + round((count / total) * (len(_HEAT) - 2))]


# C0 controls but tab and newline, DEL, C1 controls: a model can emit any byte, and written raw to
# a terminal they would move the cursor, retitle the window or clear the screen.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def visible(text: str) -> str:
    """`text` with control characters other than newline and tab as escapes (``\\x1b``)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _shown(out: Any) -> Any:
    """What text goes through on its way to `out`: `visible` on a terminal; unchanged into a
    file or a pipe, where the model's text is the data asked for."""
    isatty = getattr(out, "isatty", None)
    return visible if isatty is not None and isatty() else str


def _paint(text: str, count: int, total: int) -> str:
    return f"\x1b[38;5;{_heat(count, total)}m{text}\x1b[0m"


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    ckpt = resolve_checkpoint(checkpoint_arg(args, "generate"))
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
    safe = _shown(out)
    out.write(safe(args.prompt))
    ids: list[int] = []
    shown = ""
    for st in steps:
        if st.tokens[0] == tokenizer.eot_id:
            break
        ids.append(st.tokens[0])
        text = tokenizer.decode(ids)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            out.write(safe(text[len(shown) :]))
            out.flush()
            shown = text
    out.write(safe(tokenizer.decode(ids)[len(shown) :]) + "\n")


def _stream_routing(
    args: argparse.Namespace, model: Any, tokenizer: Any, prompt: list, n: int
) -> None:
    """Print each token coloured by how many routed blocks it took, then a legend and the share
    of tokens per routed layer. A token is printed once its own routing is known, i.e. once it
    has been fed through the model at the next step: the coloured stream runs one token behind."""
    import torch

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
    safe = _shown(out)  # the model's text only: the colours around it are ours
    pending: list[int] = []

    def emit(tok: int, routing: torch.Tensor) -> None:
        pending.append(tok)
        piece = tokenizer.decode(pending)
        if not piece.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            out.write(_paint(safe(piece), int(routing.sum()), len(names)))
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
    cfg = model.config
    shares = ", ".join(f"{cfg.recursion_capacity(r):.1%}" for r in cfg.recursion_routed_steps)
    capacity = (  # a recursion step's own share of all tokens, or MoD's one capacity
        f"step capacities {shares}" if cfg.recursive and cfg.recursion_router == "expert"
        else f"balanced depths {shares}" if cfg.recursive
        else f"capacity {cfg.capacity:.1%}"
    )  # fmt: skip
    out.write(
        "share of tokens per routed layer: "
        + ", ".join(f"L{name} {t:.0%}" for name, t in zip(names, took, strict=True))
        + f" ({capacity})\n"
    )
