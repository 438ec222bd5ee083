"""`keep_freed_memory`: after it, a freed large block is reused without page faults (the
oracle: the kernel's own count of minor faults), and the user's malloc settings win."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mixture_of_depths.runtime.malloc import ENV, keep_freed_memory, user_malloc_settings

# A child process: optionally apply the setting, then allocate, fill and free a 64 MiB tensor
# (a BPE step's logits) 15 times; print whether it applied and the minor faults of the last 10.
CHILD = """
import json, resource, sys, torch
from mixture_of_depths.runtime.malloc import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "1" else False
def touch():
    t = torch.empty(4096 * 4096, dtype=torch.float32)
    t.fill_(1.0)
    del t
for _ in range(5):  # the heap grows to its working size over the first few (three here)
    touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    touch()
after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
print(json.dumps({"applied": applied, "faults": after - before}))
"""

glibc_linux = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION"),
    reason="glibc on Linux only",
)


def _child(apply: bool, **env: str) -> dict:
    drop = {ENV, *user_malloc_settings(os.environ)}
    clean = {k: v for k, v in os.environ.items() if k not in drop}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, "1" if apply else "0"],
        env={**clean, **env}, capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc_linux
def test_freed_block_is_reused_without_page_faults():
    pages = 4096 * 4096 * 4 // os.sysconf("SC_PAGE_SIZE")  # one block's pages
    plain = _child(apply=False)
    kept = _child(apply=True)
    assert not plain["applied"] and kept["applied"]
    # glibc's default maps and unmaps the block each time: every page faults again
    assert plain["faults"] > 8 * pages
    # kept: the block stays on the heap, so ten reuses fault fewer pages than one block has
    assert kept["faults"] < pages


@glibc_linux
@pytest.mark.parametrize(
    "env",
    [
        {ENV: "0"},
        {"MALLOC_MMAP_THRESHOLD_": "65536"},
        {"MALLOC_ARENA_MAX": "2"},
        {"GLIBC_TUNABLES": "glibc.malloc.mmap_max=1"},
    ],
)
def test_user_settings_win(env):
    assert not _child(apply=True, **env)["applied"]


def test_bad_setting_is_named(monkeypatch):
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ValueError, match="MOD_KEEP_FREED_MEMORY must be '0' or '1', got 'yes'"):
        keep_freed_memory()


def test_user_malloc_settings_names_only_malloc_tuning():
    env = {
        "MALLOC_TOP_PAD_": "0",
        "MALLOC_ARENA_MAX": "2",  # one of glibc's two without the trailing underscore
        "MALLOC_CONF": "x",  # jemalloc's, not glibc's
        "GLIBC_TUNABLES": "glibc.rtld.nns=2:glibc.malloc.tcache_count=0",
        "PATH": "/bin",
    }
    expected = ["GLIBC_TUNABLES", "MALLOC_ARENA_MAX", "MALLOC_TOP_PAD_"]
    assert sorted(user_malloc_settings(env)) == expected
    assert user_malloc_settings({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}) == []
