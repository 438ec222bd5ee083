"""Fixtures the studies' tests share: a tiny corpus, and a tokenizer cache of the test's own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture()
def tiny_corpus(monkeypatch: pytest.MonkeyPatch, tmp_path) -> str:
    """A folder of six small Python files (the corpus), with the BPE cache in `tmp_path`."""
    monkeypatch.setenv("MOD_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "data"
    data.mkdir()
    for i in range(6):
        (data / f"f{i}.py").write_text(f"def f(x):\n    return x * {i}\n" * 200)
    return str(data)


@pytest.fixture()
def corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Twelve small files of Python-like words (as the library's tests write them), with the
    token cache under `tmp_path`."""
    monkeypatch.setenv("MOD_CACHE_DIR", str(tmp_path / "cache"))
    d = tmp_path / "corpus"
    d.mkdir()
    rng = torch.Generator().manual_seed(0)
    words = "def return self import class for in if else x y ( )".split()
    for i in range(12):
        idx = torch.randint(0, len(words), (400,), generator=rng).tolist()
        (d / f"f{i:02d}.py").write_text(" ".join(words[j] for j in idx) + "\n")
    return d
