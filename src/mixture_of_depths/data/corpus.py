"""Where the text comes from: the default corpus (the running Python's standard library), the
files of a folder, the train/validation split by file, and the cache folder."""

from __future__ import annotations

import codecs
import hashlib
import os
import sysconfig
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

_SNIFF_BYTES = 8192


def default_corpus_files() -> list[Path]:
    """All ``*.py`` files of the running Python's standard library, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"standard library folder {root} does not exist; pass a data path")
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place: third-party packages are not part of the embedded corpus.
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages")]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath, name)
                found.append((path.relative_to(root).as_posix(), path))
    if not found:
        raise FileNotFoundError(
            f"no *.py files under the standard library folder {root} "
            "(is it shipped as bytecode only?); pass a data path"
        )
    found.sort(key=lambda item: item[0])
    return [path for _, path in found]


def _looks_like_text(path: Path) -> bool:
    """Cheap sniff of the first 8 KiB: no NUL byte and valid UTF-8 (a split char is fine)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
    except OSError:
        return False
    if b"\0" in head:
        return False
    try:
        # Unless we read the whole file, tolerate a multi-byte character cut off at 8 KiB.
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < _SNIFF_BYTES)
    except UnicodeDecodeError:
        return False
    return True


def _utf8(name: str) -> bool:
    """Whether a file name decoded from the filesystem is UTF-8: Python keeps other bytes as
    lone surrogates, which no UTF-8 encode (the split hash, the cache key, JSON, the terminal)
    takes."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def corpus_files(data: str | Path | None) -> list[Path]:
    """Resolve ``data`` to a list of text files.

    None gives :func:`default_corpus_files`; a file gives ``[file]``; a folder gives every
    text file under it, recursively, sorted by relative path, skipping hidden files and
    folders and files that look binary or are not UTF-8. Files and folders whose names are not
    UTF-8 are skipped with a warning naming their bytes; a ``data`` path itself that is not
    UTF-8 is refused.
    """
    if data is None:
        return default_corpus_files()
    path = Path(data).expanduser()
    if not _utf8(str(path)):
        raise ValueError(f"data path {os.fsencode(path)!r} is not UTF-8: rename it")
    if not path.exists():
        raise FileNotFoundError(f"data path {path} does not exist")
    if path.is_file():
        if not _looks_like_text(path):
            raise ValueError(f"data file {path} does not look like UTF-8 text")
        return [path]
    if not path.is_dir():
        raise ValueError(f"data path {path} is neither a file nor a folder")
    found: list[tuple[str, Path]] = []
    odd: list[bytes] = []  # names that are not UTF-8: skipped, and said so
    for dirpath, dirnames, filenames in os.walk(path):
        odd += [os.fsencode(Path(dirpath, d)) for d in dirnames if not (d[:1] == "." or _utf8(d))]
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and _utf8(d)]
        for name in filenames:
            file = Path(dirpath, name)
            if name.startswith(".") or not file.is_file() or not _looks_like_text(file):
                continue
            if not _utf8(name):
                odd.append(os.fsencode(file))
                continue
            found.append((file.relative_to(path).as_posix(), file))
    if odd:
        warnings.warn(
            f"data folder {path}: skipping {len(odd)} file or folder name(s) that are not UTF-8 "
            f"(rename them to use them): {', '.join(map(repr, odd[:5]))}"
            + (", ..." if len(odd) > 5 else ""),
            stacklevel=2,
        )
    if not found:
        raise ValueError(f"data folder {path} holds no text file")
    found.sort(key=lambda item: item[0])
    return [file for _, file in found]


def _split_hash(relative: str) -> float:
    digest = hashlib.sha1(relative.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_files(
    files: Sequence[str | Path], val_fraction: float = 0.02
) -> tuple[list[Path], list[Path]]:
    """Deterministically split files into (train, validation) by a hash of their path.

    A file goes to validation iff the sha1 of its path relative to the common root of all
    files, mapped to [0, 1), is below ``val_fraction``. With >= 2 files both lists are
    non-empty (the lowest-hash file is moved to validation, or the highest-hash one to
    training, if needed). A single file is returned as ``([file], [])``: it can only be split
    by position, which :func:`load_splits` does. Input order is kept within each list.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    paths = [Path(f) for f in files]
    if not paths:
        raise ValueError("split_files needs at least one file, got none")
    if len(paths) == 1:
        return paths, []
    absolute = [os.path.abspath(p) for p in paths]
    root = os.path.commonpath(absolute)
    scores = [_split_hash(Path(os.path.relpath(a, root)).as_posix()) for a in absolute]
    in_val = [s < val_fraction for s in scores]
    if not any(in_val):
        in_val[min(range(len(paths)), key=scores.__getitem__)] = True
    elif all(in_val):
        in_val[max(range(len(paths)), key=scores.__getitem__)] = False
    train = [p for p, v in zip(paths, in_val, strict=True) if not v]
    val = [p for p, v in zip(paths, in_val, strict=True) if v]
    return train, val


def default_cache_dir() -> Path:
    """``$MOD_CACHE_DIR`` if set, else ``~/.cache/mixture_of_depths``."""
    env = os.environ.get("MOD_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mixture_of_depths"


def read_texts(paths: Sequence[Path]) -> Iterator[str]:
    for path in paths:
        yield path.read_text(encoding="utf-8", errors="replace")


def hash_files(h: Any, files: Sequence[Path]) -> None:
    """Add every file's absolute path, size and mtime to hash `h` (editing a file changes it)."""
    for path in files:
        st = path.stat()
        h.update(f"{os.path.abspath(path)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
