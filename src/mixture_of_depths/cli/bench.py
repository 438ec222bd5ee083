"""`mod bench`: speed and memory, MoD against its dense twin (the flags and the run are
`bench.suite`'s)."""

from __future__ import annotations

import argparse
from typing import Any

from ..bench.suite import add_arguments
from ..bench.suite import run as run_suite
from .flags import ShowDefaults


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="speed and memory, MoD against its dense twin, beside the FLOP-predicted ratios",
        formatter_class=ShowDefaults,
        description="Training step over capacities and lengths, one block, peak memory, decode, "
        "eager vs compiled; human tables, then one line of JSON.",
    )
    add_arguments(p)


def run(args: argparse.Namespace) -> int:
    run_suite(args)
    return 0
