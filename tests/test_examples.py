"""examples/: every script runs and prints what its ``# -> ...`` comments say
(tests/printed.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from printed import run_checked

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = sorted(EXAMPLES.glob("*.py"))


def test_there_are_examples():
    assert len(SCRIPTS) >= 3


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_an_example_prints_what_its_comments_say(script, tmp_path, monkeypatch):
    monkeypatch.setenv("MOD_CACHE_DIR", str(tmp_path / "cache"))  # its token cache apart
    assert run_checked(script.read_text(), str(script)) == []
