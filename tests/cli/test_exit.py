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


def _run(script: str, **env_vars: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(env_vars)
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("torchrun", [False, True])
def test_exit_with_keeps_the_status_and_output_and_skips_shutdown_only_under_torchrun(torchrun):
    proc = _run(SCRIPT, **(dict(WORLD_SIZE="2", RANK="1", LOCAL_RANK="1") if torchrun else {}))
    assert proc.returncode == 3
    assert proc.stderr == "note"
    assert proc.stdout == ("done" if torchrun else "doneatexit ran\n")


def test_malformed_torchrun_variables_do_not_fail_a_finished_command():
    """Only `train` reads them to join a job; at exit they mean "not a worker"."""
    proc = _run(SCRIPT, RANK="3")  # no WORLD_SIZE: env_from_torchrun refuses RANK 3 of 1
    assert (proc.returncode, proc.stdout) == (3, "doneatexit ran\n")


def test_an_uncaught_error_ends_a_torchrun_worker_with_status_1_and_its_traceback():
    script = """
import atexit
import mixture_of_depths.cli as cli
atexit.register(lambda: print("atexit ran"))
def boom():
    raise KeyError("boom")
cli.main = boom
cli.entry()
"""
    proc = _run(script, WORLD_SIZE="2", RANK="0", LOCAL_RANK="0")
    assert proc.returncode == 1 and "KeyError: 'boom'" in proc.stderr
    assert "atexit ran" not in proc.stdout  # left with os._exit, past interpreter shutdown
    plain = _run(script)  # outside torchrun: Python's own handling of the error
    assert plain.returncode == 1 and "atexit ran" in plain.stdout


def test_mod_version_prints_the_package_version():
    from mixture_of_depths import __version__

    got = subprocess.run([sys.executable, "-m", "mixture_of_depths", "--version"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert got.returncode == 0 and got.stdout == f"mod {__version__}\n"
