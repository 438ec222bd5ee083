"""Shared test settings and fixtures."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import TINY, tc, write_corpus

from mixture_of_depths import MoDConfig
from mixture_of_depths.train import train

# The test models are tiny: intra-op threads only add overhead, and on a loaded machine OpenMP
# threads contending for the same cores make a 69x32 matmul take milliseconds, not microseconds.
torch.set_num_threads(1)

# The devices an oracle test runs on: the CPU always, CUDA where there is one (marked `cuda`, so
# `pytest -m cuda` selects those variants; without a GPU they skip and cost nothing).
# MOD_TEST_CUDA_ON_CPU=1 runs the CUDA variants on "cpu:0" instead: their own logic, checked
# on a machine without a GPU (tests/cuda/devices.py reads the same switch).
CUDA_ON_CPU = os.environ.get("MOD_TEST_CUDA_ON_CPU") == "1"
CUDA = torch.cuda.is_available() or CUDA_ON_CPU
DEVICES = [
    "cpu",
    pytest.param(
        "cpu:0" if CUDA_ON_CPU else "cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="no CUDA device here")],
        id="cuda",
    ),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """The device of a device-parametrised oracle test ("cpu", or "cuda" where available)."""
    return request.param


@pytest.fixture()
def corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tiny corpus folder; the token cache goes under tmp_path too."""
    monkeypatch.setenv("MOD_CACHE_DIR", str(tmp_path / "cache"))
    return write_corpus(tmp_path / "corpus")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """A corpus and a run of 3 steps on it, shared by a test module (copy it to damage it)."""
    root = tmp_path_factory.mktemp("damaged")
    corpus = write_corpus(root / "corpus")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOD_CACHE_DIR", str(root / "cache"))
        out = root / "run"
        train(MoDConfig(**TINY), tc(corpus, out, steps=3), progress=False)
        yield corpus, out
