"""Token streams: a list of files as one 1-D tensor of ids (each file's tokens, then the
end-of-text id), cached as safetensors keyed by the tokenizer and the files; the two splits."""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from ..fileio import atomic_save_tensors
from .corpus import corpus_files, default_cache_dir, hash_files, read_texts, split_files
from .tokenizers import ByteTokenizer, Tokenizer, make_tokenizer

# Bump when the on-disk token layout changes so old caches are ignored, not misread.
_CACHE_FORMAT = "mod-tokens-v1"
# Group files so BPE's encode_batch can use all cores without holding the corpus twice.
_CHUNK_BYTES = 4 << 20


def _stream_dtype(tokenizer: Tokenizer) -> torch.dtype:
    return torch.uint16 if tokenizer.vocab_size <= 65536 else torch.int32


def _cache_key(files: Sequence[Path], tokenizer: Tokenizer) -> str:
    h = hashlib.sha256()
    h.update(f"{_CACHE_FORMAT}\0{tokenizer.fingerprint()}\0".encode())
    hash_files(h, files)
    return h.hexdigest()


def _load_cached(path: Path, key: str, dtype: torch.dtype) -> torch.Tensor | None:
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tokens = f.get_tensor("tokens")
    except Exception:  # any unreadable/corrupt file just means "tokenise again"
        return None
    if meta.get("key") != key or tokens.dtype != dtype or tokens.dim() != 1:
        return None
    return tokens


def _save_cached(path: Path, key: str, tokens: torch.Tensor) -> None:
    try:
        atomic_save_tensors(path, {"tokens": tokens}, {"key": key, "format": _CACHE_FORMAT})
    except OSError as e:
        # A read-only cache location should cost speed, not the run.
        warnings.warn(f"could not write token cache {path}: {e}", stacklevel=3)


def tokenize_files(
    files: Sequence[str | Path],
    tokenizer: Tokenizer,
    cache_dir: Path | None = None,
    desc: str = "",
) -> torch.Tensor:
    """Tokenise ``files`` into one 1-D stream: each file's tokens then ``eot_id``, in order.

    The result is uint16 (int32 for vocabularies over 65536); convert slices to int64 before
    use. It is cached in ``cache_dir`` (default :func:`default_cache_dir`) under a key of the
    tokenizer and every file's absolute path, size and mtime, so editing a file invalidates it.
    """
    paths = [Path(f) for f in files]
    dtype = _stream_dtype(tokenizer)
    if not paths:
        return torch.empty(0, dtype=dtype)
    key = _cache_key(paths, tokenizer)
    cache_path = Path(cache_dir if cache_dir is not None else default_cache_dir())
    cache_path = cache_path / f"tokens-{key[:16]}.safetensors"
    cached = _load_cached(cache_path, key, dtype)
    if cached is not None:
        return cached

    eot = torch.tensor([tokenizer.eot_id], dtype=dtype)
    encode_many = getattr(tokenizer, "encode_many", None) or (
        lambda texts: [torch.tensor(tokenizer.encode(t), dtype=torch.int64) for t in texts]
    )
    pieces: list[torch.Tensor] = []
    chunk: list[str] = []
    chunk_bytes = 0

    def flush(bar: tqdm) -> None:
        nonlocal chunk, chunk_bytes
        for ids in encode_many(chunk):
            pieces.append(ids.to(dtype))
            pieces.append(eot)
        bar.update(len(chunk))
        chunk, chunk_bytes = [], 0

    with tqdm(total=len(paths), desc=desc or "tokenizing", unit="file", disable=None) as bar:
        for text in read_texts(paths):
            chunk.append(text)
            chunk_bytes += len(text)
            if chunk_bytes >= _CHUNK_BYTES:
                flush(bar)
        if chunk:
            flush(bar)
    tokens = torch.cat(pieces)
    _save_cached(cache_path, key, tokens)
    return tokens


def load_splits(
    data: str | Path | None = None,
    tokenizer: Tokenizer | str | None = None,
    *,
    val_fraction: float = 0.02,
    cache_dir: Path | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Tokenizer]:
    """Files -> split -> tokenizer -> ``(train_tokens, val_tokens, tokenizer)``.

    ``tokenizer`` may be a :class:`Tokenizer`, a kind for :func:`make_tokenizer` (a "bpe"
    tokenizer is trained on the training files) or None for :class:`ByteTokenizer`. With a
    single file the token stream is split by position: the last ``val_fraction`` of its
    tokens (at least one) is validation.
    """
    files = corpus_files(data)
    train_files, val_files = split_files(files, val_fraction)
    if tokenizer is None:
        tokenizer = ByteTokenizer()
    elif isinstance(tokenizer, str):
        tokenizer = make_tokenizer(tokenizer, train_files)
    if val_files:
        train = tokenize_files(train_files, tokenizer, cache_dir, desc="tokenizing train")
        val = tokenize_files(val_files, tokenizer, cache_dir, desc="tokenizing val")
        return train, val, tokenizer
    stream = tokenize_files(train_files, tokenizer, cache_dir, desc="tokenizing")
    if len(stream) < 2:
        raise ValueError(f"data file {train_files[0]} is too short to split (empty file)")
    n_val = min(max(1, math.ceil(len(stream) * val_fraction)), len(stream) - 1)
    return stream[:-n_val], stream[-n_val:], tokenizer
