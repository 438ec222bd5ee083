"""`mod inspect`: where the compute went, token by token: pictures, numbers and a page."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..config import MoDConfig
from ..data import ByteTokenizer, Tokenizer, eval_batches, load_splits, load_tokenizer
from ..fileio import atomic_write_text, json_text
from ..inspect import (
    PICTURES,
    analyse,
    class_table,
    extremes,
    html_page,
    plot,
    report_json,
    report_md,
    rho_text,
)
from ..probes import attention_reach, copy_probe, format_copy_probe, format_reach
from ..runtime.checkpoint import load_config, load_model, read_json_file, resolve_checkpoint
from ..runtime.device import resolve_device
from .flags import ShowDefaults


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="where the compute went, token by token: pictures and numbers",
        formatter_class=ShowDefaults,
        description="Route held-out text through a checkpoint in causal and top-k routing and "
        "write routing.png, depth_hist.png, skip_runs.png, entropy.png, report.md, report.json and "
        "index.html: blocks taken per token against independent per-router coins, the longest "
        "runs of skipped blocks and their loss, Spearman's rho of blocks taken against entropy "
        "and loss, the share routed by token class, and the copy probe (in-context copying of "
        "a repeated random sequence, with each router's take-rate on each copy), and how far "
        "back each layer's attention looks.",
    )
    p.add_argument("checkpoint", help="checkpoint directory, or a run folder (e.g. runs/mod)")
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
    p.add_argument("--device", default="auto", help="auto: cuda if there is one, else cpu")


# What `mod inspect` writes: a folder holding only these (and its own write's leftovers) is a
# previous output, rewritten in place; anything else in --out is not ours to overwrite.
OUTPUTS = ("index.html", "report.md", "report.json", *PICTURES)
_HEADINGS = {"report.md": "# Where the compute went", "index.html": "<!doctype html><html><head>"
             "<meta charset='utf-8'><title>mod inspect</title>",
             "report.json": '{\n  "tool": "mod inspect"'}  # fmt: skip


def _ours(entry: Path) -> bool:
    """Whether `entry` of an --out folder is a file a previous `mod inspect` wrote there."""
    name = entry.name
    if name.startswith(".") and any(name.startswith(f".{o}.") for o in OUTPUTS):
        return entry.is_file()  # a temporary of an interrupted write
    if name not in OUTPUTS or not entry.is_file() or entry.is_symlink():
        return False
    head = _HEADINGS.get(name)
    if head is None:
        return True
    with open(entry, "rb") as f:
        return f.read(len(head.encode())) == head.encode()


def check_out(out: Path) -> None:
    """Refuse an --out that is a file, or a folder holding anything but a previous output of
    `mod inspect` (export and convert refuse any non-empty folder; inspect may be rerun in place,
    so its own outputs are recognised: their names, and the headings of its two text files)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    if not out.is_dir():
        return
    foreign = sorted(e.name for e in out.iterdir() if not _ours(e))
    if foreign:
        raise FileExistsError(
            f"--out {out} holds files that are not a previous mod inspect's output "
            f"({', '.join(map(repr, foreign[:3]))}{', ...' if len(foreign) > 3 else ''}): "
            "nothing written; give a new or empty folder as --out"
        )


def check_baseline(
    args: argparse.Namespace, tokenizer: Tokenizer, cfg: MoDConfig, tokens: int = 0
) -> None:
    """Refuse a --baseline that cannot score the inspected tokens, naming it, before any work:
    another tokenizer or vocabulary, or (given the `tokens` per row) a shorter context."""
    base = resolve_checkpoint(args.baseline)
    base_tok = load_tokenizer(base)
    if base_tok.fingerprint() != tokenizer.fingerprint():
        raise ValueError(
            f"--baseline {args.baseline} has another tokenizer ({base_tok!r}) than "
            f"{args.checkpoint} ({tokenizer!r}): a per-token comparison needs the same tokens"
        )
    base_cfg = load_config(base)
    if base_cfg.vocab_size != cfg.vocab_size:
        raise ValueError(
            f"--baseline {args.baseline} has vocab_size {base_cfg.vocab_size}, {args.checkpoint} "
            f"{cfg.vocab_size}: a per-token comparison needs the same vocabulary"
        )
    if tokens > base_cfg.max_seq_len:
        shorter = "a shorter --text, or " if args.text is not None else ""
        raise ValueError(
            f"--baseline {args.baseline} has max_seq_len {base_cfg.max_seq_len}, shorter than the "
            f"{tokens} tokens per row inspected: give {shorter}a baseline of at least {tokens}"
        )


def run(args: argparse.Namespace) -> int:

    if args.rows < 1:
        raise ValueError(f"--rows must be >= 1, got {args.rows}")
    ckpt = resolve_checkpoint(args.checkpoint)
    out = Path(args.out) if args.out else ckpt.parent / "inspect"
    check_out(out)
    device = resolve_device(args.device)
    model, cfg = load_model(ckpt, map_location=device)
    tokenizer = load_tokenizer(ckpt)
    if args.baseline is not None:
        check_baseline(args, tokenizer, cfg)
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
    baseline = None
    if args.baseline is not None:
        check_baseline(args, tokenizer, cfg, tokens.shape[1])
        baseline = load_model(args.baseline, map_location=device)[0]
    # Each stage takes seconds to a minute: a bar on stderr (on a terminal) says which runs.
    bar = tqdm(total=4, desc="inspect", unit="stage", disable=None, leave=False)
    bar.set_postfix_str("routing, statistics and bootstrap")
    report = analyse(model, tokens, baseline=baseline)
    bar.update(1), bar.set_postfix_str("copy probe")
    copy = copy_probe(model)  # random tokens: the same numbers whatever text was inspected
    bar.update(1), bar.set_postfix_str("attention reach")
    reach = attention_reach(model, tokens.to(device))
    bar.update(1), bar.set_postfix_str("pictures and page")
    write_outputs(out, report, tokenizer, copy, tokens.shape[1], reach)
    bar.update(1), bar.close()
    c = report.correlations
    print(
        f"{out}: index.html, report.md, report.json, routing.png, depth_hist.png, skip_runs.png, "
        f"entropy.png ({len(report.tokens)} tokens; rho depth~entropy "
        f"{rho_text(report, 'depth_vs_entropy')}, depth~loss {rho_text(report, 'depth_vs_loss')}"
        + (
            f", depth~baseline loss {rho_text(report, 'depth_vs_baseline_loss')}"
            if "depth_vs_baseline_loss" in c
            else ""
        )
        + ")"
    )
    print(format_copy_probe(copy))
    print(format_reach(reach))
    return 0


def write_outputs(
    out: Path,
    report: Any,
    tokenizer: Tokenizer,
    copy: dict[str, Any],
    row_len: int,
    reach: list[dict[str, Any]] | None = None,
) -> None:
    """The pictures, report.md, report.json and the page, into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    pictures = plot(report, out, row_len)

    def tokenizer_text(i: int) -> str:
        if isinstance(tokenizer, ByteTokenizer):  # one byte of a character may not decode alone
            return "" if i == tokenizer.eot_id else bytes([i]).decode("latin-1")
        return tokenizer.decode([i])

    is_byte = isinstance(tokenizer, ByteTokenizer)
    classes = class_table(report, None if is_byte else tokenizer_text)
    extreme = None if is_byte else extremes(report)
    text = report_md(
        report, classes, extreme, lambda i: repr(tokenizer_text(i)), copy=copy, reach=reach
    )
    atomic_write_text(out / "report.md", text)
    doc = report_json(report, copy, reach)
    atomic_write_text(out / "report.json", json_text(doc, indent=2) + "\n")
    images = {p.stem: p for p in pictures}
    atomic_write_text(out / "index.html", html_page(report, tokenizer_text, images, text))
