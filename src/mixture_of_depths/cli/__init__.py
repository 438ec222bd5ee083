"""The `mod` command: train, evaluate and inspect Mixture-of-Depths models.

`COMMANDS` is the command table, in the order `mod --help` lists them: each entry names the
function that declares the command's flags (in the command's own module, beside its handler) and
the handler. `main` parses, runs the handler, and turns the errors our code raises (which say
what to do) into one line and exit status 2, and a run stopped by a signal (`TrainingStopped`)
into its line and 128 + the signal's number (143 for SIGTERM, 130 for SIGINT).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from .. import __version__
from ..runtime.distributed import env_from_torchrun
from ..runtime.malloc import keep_freed_memory
from ..train import TrainingStopped
from . import (
    bench,
    calibrate,
    checkpoints,
    evaluate,
    generate,
    inspect,
    models,
    serve,
    study,
    train,
)


@dataclass(frozen=True)
class Command:
    add_parser: Callable[[Any, str], None]  # (the subparsers, the command's name)
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {
    "train": Command(train.add_train, train.run),
    "tune-routers": Command(train.add_tune_routers, train.run),
    "inspect": Command(inspect.add_parser, inspect.run),
    "eval": Command(evaluate.add_parser, evaluate.run),
    "calibrate": Command(calibrate.add_parser, calibrate.run),
    "generate": Command(generate.add_parser, generate.run),
    "serve": Command(serve.add_parser, serve.run),
    "export": Command(checkpoints.add_export, checkpoints.run_export),
    "convert": Command(checkpoints.add_convert, checkpoints.run_convert),
    "consolidate": Command(checkpoints.add_consolidate, checkpoints.run_consolidate),
    "flops": Command(models.add_flops, models.run_flops),
    "study": Command(study.add_parser, study.run),
    "bench": Command(bench.add_parser, bench.run),
    "presets": Command(models.add_presets, models.run_presets),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mod", description="Mixture-of-Depths transformers: train, evaluate, inspect."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        command.add_parser(sub, name)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        keep_freed_memory()  # reuse freed blocks: page faults took a third of a BPE step on CPU
        return COMMANDS[args.command].run(args)
    except TrainingStopped as exc:  # stopped cleanly, with a checkpoint: where, and how to resume
        if env_from_torchrun().is_main:  # under torchrun, once for the job
            print(f"mod {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code
    except (ValueError, OSError, RuntimeError) as exc:  # our errors say what to do
        print(f"mod {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def entry() -> NoReturn:
    """The `mod` executable (and ``python -m mixture_of_depths``): `main`, then `exit_with`.
    Under torchrun an error `main` does not turn into a status is printed and ends the worker
    with status 1 the same way, rather than in interpreter shutdown."""
    try:
        code = main()
    except Exception:
        if not _torchrun_worker():
            raise
        traceback.print_exc()
        code = 1
    exit_with(code)


def exit_with(code: int) -> NoReturn:
    """Exit with `code`. A torchrun worker leaves with ``os._exit`` once its output is flushed:
    its work is done and saved by then (the ranks met at a barrier and the process group is
    destroyed), but FSDP2's device mesh keeps gloo objects alive into interpreter shutdown,
    where their threads can end in any order and abort a finished rank ("terminate called
    without an active exception", exit -6), which torchrun reports as a failed job."""
    if _torchrun_worker():
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed pipe: exit all the same
                stream.flush()
        os._exit(code)
    raise SystemExit(code)


def _torchrun_worker() -> bool:
    """Whether this process is one of several torchrun workers; malformed torchrun variables
    are `train`'s error to report, not a reason to fail a command at its exit."""
    try:
        return env_from_torchrun().active
    except ValueError:
        return False


__all__ = ["COMMANDS", "Command", "build_parser", "entry", "exit_with", "main"]
