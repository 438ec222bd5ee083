"""`mod generate`: sample causally from a checkpoint, streaming, optionally coloured by the
routed blocks each token took."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import torch

from ..data import load_tokenizer
from ..generate import Generation, router_names
from ..runtime.checkpoint import load_model, resolve_checkpoint
from ..runtime.device import resolve_device
from .flags import ShowDefaults, add_checkpoint, checkpoint_arg


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="sample text causally from a checkpoint, streaming",
        formatter_class=ShowDefaults,
        description="Sample from a trained model with causal routing and a KV cache that holds "
        "only the tokens that took each routed block.",
    )
    add_checkpoint(p, "checkpoint directory (or a run folder)")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample at most")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="0 (or below 1e-5) is greedy (default: 0.8)",
    )
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="makes the sample reproducible")
    p.add_argument(
        "--prefill",
        choices=("causal", "topk"),
        default="causal",
        help="how the prompt is routed: causal, as decoding decides, or the paper's top-k "
        "(an approximation)",
    )
    p.add_argument(
        "--show-routing",
        action="store_true",
        help="colour each token by how many routed blocks it took, with a legend and the "
        "take-rates on stdout (without it the take-rates go to stderr)",
    )
    p.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="--show-routing's colours: auto (on a terminal, unless NO_COLOR is set), always "
        "(e.g. into less -R), never (default: auto)",
    )
    p.add_argument("--device", default="auto", help="auto: cuda if there is one, else cpu")


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


def _tty(out: Any) -> bool:
    isatty = getattr(out, "isatty", None)
    return isatty is not None and bool(isatty())


def _shown(out: Any) -> Any:
    """What text goes through on its way to `out`: `visible` on a terminal; unchanged into a
    file or a pipe, where the model's text is the data asked for."""
    return visible if _tty(out) else str


def _painter(args: argparse.Namespace, out: Any) -> Callable[[str, int, int], str]:
    """What colours a piece of text by its routed blocks: ANSI colours with --color always, or
    with auto on a terminal when NO_COLOR is unset or empty (no-color.org); else nothing."""
    auto = _tty(out) and not os.environ.get("NO_COLOR")
    on = args.color == "always" or (args.color == "auto" and auto)
    return _paint if on else lambda text, count, total: text


def _paint(text: str, count: int, total: int) -> str:
    return f"\x1b[38;5;{_heat(count, total)}m{text}\x1b[0m"


def take_rate_line(model: Any, routing: torch.Tensor) -> str:
    """Each router's share of the tokens fed through the model (`routing`: (tokens, routers)
    bool, the prompt's and the generated tokens' decisions), beside what it was fitted to."""
    cfg = model.config
    names, n = router_names(model), routing.shape[0]
    took = routing.sum(0).tolist()
    rates = ", ".join(
        f"L{name} {t}/{n} {t / max(n, 1):.1%}" for name, t in zip(names, took, strict=True)
    )
    shares = ", ".join(f"{cfg.recursion_capacity(r):.1%}" for r in cfg.recursion_routed_steps)
    capacity = (  # a recursion step's own share of all tokens, or MoD's one capacity
        f"step capacities {shares}" if cfg.recursive and cfg.recursion_router == "expert"
        else f"balanced depths {shares}" if cfg.recursive
        else f"capacity {cfg.capacity:.1%}"
    )  # fmt: skip
    fitted = "calibrated" if cfg.causal_thresholds else "0, uncalibrated"
    return (
        f"take-rates over the {n} tokens fed (prompt and generated): {rates} ({capacity}; "
        f"causal thresholds {fitted})"
    )


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
    if not router_names(model):
        what = "nothing to colour" if show else "no take-rates to report"
        print(f"note: a dense model has no routed blocks: {what}", file=sys.stderr)
        show = False
    gen = Generation(
        model,
        [prompt],
        n_new,
        args.temperature,
        args.top_k,
        args.top_p,
        tokenizer.eot_id,
        args.seed,
        args.prefill,
        feed_last=True,  # every token's routing, for the take-rates
    )
    (_stream_routing if show else _stream_text)(args, gen, tokenizer)
    return 0


def _routing(gen: Generation) -> torch.Tensor:
    """The decisions of the prompt and of each generated token fed back (a final EOS is not)."""
    prompt = gen.prompt_routing[0, : int(gen.lens[0])]
    return torch.cat([prompt, *[r[None] for r in gen.token_routing[0]]])


def _stream_text(args: argparse.Namespace, gen: Generation, tokenizer: Any) -> None:
    """Print the prompt, then each sampled token as soon as it is sampled; then, on stderr, the
    take-rates."""
    out = sys.stdout
    safe = _shown(out)
    out.write(safe(args.prompt))
    ids: list[int] = []
    shown = ""
    for st in gen.steps():
        if st.tokens[0] == tokenizer.eot_id:
            break
        ids.append(st.tokens[0])
        text = tokenizer.decode(ids)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            out.write(safe(text[len(shown) :]))
            out.flush()
            shown = text
    out.write(safe(tokenizer.decode(ids)[len(shown) :]) + "\n")
    out.flush()
    if router_names(gen.model):
        print(take_rate_line(gen.model, _routing(gen)), file=sys.stderr)


def _stream_routing(args: argparse.Namespace, gen: Generation, tokenizer: Any) -> None:
    """Print each token coloured by how many routed blocks it took, then a legend and the
    take-rates. A token is printed once its own routing is known, i.e. once it has been fed
    through the model at the next step: the coloured stream runs one token behind."""
    names = router_names(gen.model)
    prompt = gen.idx[0, : int(gen.lens[0])].tolist()
    out = sys.stdout
    safe = _shown(out)  # the model's text only: the colours around it are ours
    paint = _painter(args, out)
    pending: list[int] = []

    def emit(tok: int, routing: torch.Tensor) -> None:
        pending.append(tok)
        piece = tokenizer.decode(pending)
        if not piece.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            out.write(paint(safe(piece), int(routing.sum()), len(names)))
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
    out.write("\n\n")
    legend = " ".join(paint(f"{c}", c, len(names)) for c in range(len(names) + 1))
    out.write(f"routed blocks taken per token (of {len(names)}): {legend}\n")
    out.write(take_rate_line(gen.model, _routing(gen)) + "\n")
