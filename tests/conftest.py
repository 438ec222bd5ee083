"""Shared test settings."""

from pathlib import Path

import pytest
import torch
from helpers import write_corpus

# The test models are tiny: intra-op threads only add overhead, and on a loaded machine OpenMP
# threads contending for the same cores make a 69x32 matmul take milliseconds, not microseconds.
torch.set_num_threads(1)


@pytest.fixture()
def corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tiny corpus folder; the token cache goes under tmp_path too."""
    monkeypatch.setenv("MOD_CACHE_DIR", str(tmp_path / "cache"))
    return write_corpus(tmp_path / "corpus")
