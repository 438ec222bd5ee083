"""How `mod` leaves: a torchrun worker skips interpreter shutdown (where gloo objects kept alive
by FSDP2's device mesh could abort a finished rank), with its output flushed and its status
kept; a plain process exits normally, its atexit handlers run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import atexit, sys
from mixture_of_depths.cli import exit_with
atexit.register(lambda: print("atexit ran"))
print("done", end="")
sys.stderr.write("note")
exit_with(3)
"""


@pytest.mark.parametrize("torchrun", [False, True])
def test_exit_with_keeps_the_status_and_output_and_skips_shutdown_only_under_torchrun(torchrun):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    if torchrun:
        env.update(WORLD_SIZE="2", RANK="1", LOCAL_RANK="1")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 3
    assert proc.stderr == "note"
    assert proc.stdout == ("done" if torchrun else "doneatexit ran\n")
