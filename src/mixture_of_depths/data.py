"""Corpus discovery, tokenizers, a cached token stream, and resumable batching.

Default corpus
    With no data given, the corpus is the source of the running Python's standard library:
    every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, excluding anything under
    ``site-packages``/``dist-packages``, sorted by relative path. It is roughly 1800 files
    (~30 MB) of real, varied text that every Python install already has, so training works
    offline with nothing to download. Different Python versions give different corpora.

Train/validation split
    The split is by *file*, so no file contributes text to both sides: a file goes to
    validation iff ``sha1(path relative to the files' common root)`` mapped to [0, 1) is below
    ``val_fraction``. It depends only on the relative paths, not on file order, the machine
    or the moment. With two or more files both sides are guaranteed non-empty. A single file
    cannot be split by file: :func:`split_files` returns it as training only, and
    :func:`load_splits` instead splits that file's token stream by position (the last
    ``val_fraction`` of its tokens, at least one, go to validation; for the byte tokenizer
    that is exactly the last ``val_fraction`` of its bytes). A BPE tokenizer is then trained on
    the whole file, validation tail included.

Token streams
    A list of files becomes one 1-D tensor: each file's tokens followed by the end-of-text id,
    in file order, stored as ``torch.uint16`` when the vocabulary fits (else ``torch.int32``)
    and cached as safetensors keyed by the tokenizer and each file's path, size and mtime.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import math
import os
import sysconfig
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from .fileio import atomic_save_tensors, atomic_write_text

__all__ = [
    "BPETokenizer",
    "BatchSampler",
    "ByteTokenizer",
    "Tokenizer",
    "corpus_files",
    "default_cache_dir",
    "default_corpus_files",
    "eval_batches",
    "load_splits",
    "load_tokenizer",
    "make_tokenizer",
    "split_files",
    "tokenize_files",
]

TOKENIZER_FILE = "tokenizer.json"
EOT_TOKEN = "<|endoftext|>"
TOKENIZER_KINDS = ("byte", "bpe")
# Bump when the on-disk token layout changes so old caches are ignored, not misread.
_CACHE_FORMAT = "mod-tokens-v1"
_SNIFF_BYTES = 8192
# Group files so BPE's encode_batch can use all cores without holding the corpus twice.
_CHUNK_BYTES = 4 << 20


# --------------------------------------------------------------------------- corpus discovery


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


def corpus_files(data: str | Path | None) -> list[Path]:
    """Resolve ``data`` to a list of text files.

    None gives :func:`default_corpus_files`; a file gives ``[file]``; a folder gives every
    text file under it, recursively, sorted by relative path, skipping hidden files and
    folders and files that look binary or are not UTF-8.
    """
    if data is None:
        return default_corpus_files()
    path = Path(data).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"data path {path} does not exist")
    if path.is_file():
        if not _looks_like_text(path):
            raise ValueError(f"data file {path} does not look like UTF-8 text")
        return [path]
    if not path.is_dir():
        raise ValueError(f"data path {path} is neither a file nor a folder")
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            file = Path(dirpath, name)
            if name.startswith(".") or not file.is_file() or not _looks_like_text(file):
                continue
            found.append((file.relative_to(path).as_posix(), file))
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


# --------------------------------------------------------------------------------- tokenizers


class Tokenizer(ABC):
    """Text <-> token ids, with one end-of-text id that separates documents."""

    name: str
    vocab_size: int
    eot_id: int

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: list[int]) -> str: ...

    @abstractmethod
    def save(self, directory: Path) -> None:
        """Write ``directory/tokenizer.json`` so :func:`load_tokenizer` can restore it."""

    @abstractmethod
    def fingerprint(self) -> str:
        """A string that changes whenever the text -> ids mapping could change (cache key)."""

    def encode_many(self, texts: list[str]) -> list[torch.Tensor]:
        """Encode several texts to 1-D int64 tensors; subclasses override this for speed."""
        return [torch.tensor(self.encode(t), dtype=torch.int64) for t in texts]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eot_id={self.eot_id})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, plus end-of-text id 256."""

    name = "byte"
    vocab_size = 257
    eot_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i <= self.eot_id]
        if bad:
            raise ValueError(f"byte tokenizer ids must be in 0..{self.eot_id}, got {bad[0]}")
        return bytes(i for i in ids if i != self.eot_id).decode("utf-8", errors="replace")

    def save(self, directory: Path) -> None:
        atomic_write_text(Path(directory) / TOKENIZER_FILE, json.dumps({"type": "byte"}) + "\n")

    def fingerprint(self) -> str:
        return "byte"

    def encode_many(self, texts: list[str]) -> list[torch.Tensor]:
        # frombuffer views the encoded bytes directly: ~100x faster than a Python list.
        out = []
        for text in texts:
            raw = bytearray(text.encode("utf-8"))
            out.append(
                torch.frombuffer(raw, dtype=torch.uint8).to(torch.int64)
                if raw
                else torch.empty(0, dtype=torch.int64)
            )
        return out


class BPETokenizer(Tokenizer):
    """Byte-level BPE from the ``tokenizers`` package, with ``<|endoftext|>`` as end-of-text."""

    name = "bpe"

    def __init__(self, tokenizer: Any, eot_token: str = EOT_TOKEN) -> None:
        eot = tokenizer.token_to_id(eot_token)
        if eot is None:
            raise ValueError(f"BPE tokenizer has no {eot_token} token (its end-of-text)")
        # Text that happens to contain "<|endoftext|>" must stay text, not become a separator.
        tokenizer.encode_special_tokens = True
        self._tk = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eot_id, self.eot_token = eot, eot_token
        self._json = tokenizer.to_str()

    @classmethod
    def train(cls, files: Sequence[str | Path], vocab_size: int = 4096) -> BPETokenizer:
        """Train on ``files`` only (pass the training split, never validation files)."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        alphabet = pre_tokenizers.ByteLevel.alphabet()
        if vocab_size < len(alphabet) + 1:
            raise ValueError(
                f"BPE vocab_size must be >= {len(alphabet) + 1} (256 bytes + end-of-text), "
                f"got {vocab_size}"
            )
        paths = [Path(f) for f in files]
        if not paths:
            raise ValueError("BPE training needs at least one file, got none")
        tk = HFTokenizer(models.BPE())
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT_TOKEN],
            initial_alphabet=alphabet,
            show_progress=False,
        )
        # Read in Python so non-UTF-8 bytes are replaced instead of failing the Rust reader.
        tk.train_from_iterator(_read_texts(paths), trainer=trainer, length=len(paths))
        return cls(tk)

    @classmethod
    def from_str(cls, text: str, eot_token: str = EOT_TOKEN) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_str(text), eot_token)

    def encode(self, text: str) -> list[int]:
        return self._tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=True)

    def save(self, directory: Path) -> None:
        text = self._json
        if self.eot_token != EOT_TOKEN:  # another end-of-text (a converted model's): say which
            text = json.dumps({"type": "bpe", "eot": self.eot_token, "tokenizer": json.loads(text)})
        atomic_write_text(Path(directory) / TOKENIZER_FILE, text)

    def fingerprint(self) -> str:
        eot = "" if self.eot_token == EOT_TOKEN else f":{self.eot_token}"
        return "bpe:" + hashlib.sha256(self._json.encode("utf-8")).hexdigest() + eot

    def encode_many(self, texts: list[str]) -> list[torch.Tensor]:
        encodings = self._tk.encode_batch(texts, add_special_tokens=False)
        return [torch.tensor(e.ids, dtype=torch.int64) for e in encodings]


def load_tokenizer(directory: Path) -> Tokenizer:
    """Restore the tokenizer saved in ``directory/tokenizer.json``."""
    directory = Path(directory)
    path = directory if directory.is_file() else directory / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer file at {path}")
    try:
        text = path.read_text(encoding="utf-8")
        spec = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"tokenizer file {path} is corrupt or not a tokenizer: {e}") from None
    if isinstance(spec, dict) and spec.get("type") == "byte":
        return ByteTokenizer()
    if isinstance(spec, dict) and spec.get("type") == "bpe" and isinstance(spec.get("eot"), str):
        try:
            return BPETokenizer.from_str(json.dumps(spec["tokenizer"]), spec["eot"])
        except Exception as e:  # tokenizers raises its own plain Exception
            raise ValueError(f"tokenizer file {path} is corrupt or not a tokenizer: {e}") from None
    if isinstance(spec, dict) and "model" in spec:
        try:
            return BPETokenizer.from_str(text)
        except Exception as e:  # tokenizers raises its own plain Exception
            raise ValueError(f"tokenizer file {path} is corrupt or not a tokenizer: {e}") from None
    raise ValueError(
        f"tokenizer file {path} is corrupt or not a tokenizer: neither a byte nor a "
        "tokenizers-native tokenizer"
    )


def make_tokenizer(
    kind: str,
    train_files: Sequence[str | Path],
    vocab_size: int = 4096,
    cache_dir: Path | None = None,
) -> Tokenizer:
    """Build a tokenizer of ``kind`` ("byte" or "bpe"). BPE is trained on ``train_files`` once:
    the result is cached in ``cache_dir`` (default :func:`default_cache_dir`) under a key of the
    vocabulary size, the ``tokenizers`` version and every file's path, size and mtime, so runs on
    the same data share one tokenizer (and its token cache) and skip the training."""
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        import tokenizers

        paths = [Path(f) for f in train_files]
        # "bpe" names the recipe of BPETokenizer.train (byte-level, <|endoftext|>): change the
        # string when the recipe changes, so no old tokenizer is taken for a new one
        h = hashlib.sha256(f"bpe\0{vocab_size}\0{tokenizers.__version__}\0".encode())
        _hash_files(h, paths)
        cached = Path(cache_dir if cache_dir is not None else default_cache_dir())
        cached = cached / f"bpe-{h.hexdigest()[:16]}.json"
        if cached.is_file():
            try:
                return BPETokenizer.from_str(cached.read_text())
            except Exception:  # unreadable or cut short: train again
                pass
        tokenizer = BPETokenizer.train(paths, vocab_size=vocab_size)
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(cached, tokenizer._json)
        except OSError as e:  # a read-only cache costs time, not the run
            warnings.warn(f"could not write tokenizer cache {cached}: {e}", stacklevel=2)
        return tokenizer
    raise ValueError(
        f"unknown tokenizer kind {kind!r}; expected one of {', '.join(TOKENIZER_KINDS)}"
    )


# ----------------------------------------------------------------------- token stream + cache


def default_cache_dir() -> Path:
    """``$MOD_CACHE_DIR`` if set, else ``~/.cache/mixture_of_depths``."""
    env = os.environ.get("MOD_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mixture_of_depths"


def _read_texts(paths: Sequence[Path]) -> Iterator[str]:
    for path in paths:
        yield path.read_text(encoding="utf-8", errors="replace")


def _stream_dtype(tokenizer: Tokenizer) -> torch.dtype:
    return torch.uint16 if tokenizer.vocab_size <= 65536 else torch.int32


def _hash_files(h: Any, files: Sequence[Path]) -> None:
    """Add every file's absolute path, size and mtime to hash `h` (editing a file changes it)."""
    for path in files:
        st = path.stat()
        h.update(f"{os.path.abspath(path)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())


def _cache_key(files: Sequence[Path], tokenizer: Tokenizer) -> str:
    h = hashlib.sha256()
    h.update(f"{_CACHE_FORMAT}\0{tokenizer.fingerprint()}\0".encode())
    _hash_files(h, files)
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
        for text in _read_texts(paths):
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


# ----------------------------------------------------------------------------------- batching


def _check_stream(tokens: torch.Tensor, batch_size: int, seq_len: int) -> None:
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
    if tokens.dim() != 1:
        raise ValueError(f"token stream must be 1-D, got shape {tuple(tokens.shape)}")
    if len(tokens) < seq_len + 1:
        raise ValueError(
            f"token stream has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}"
        )


def _windows(
    tokens: torch.Tensor, starts: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.empty(len(starts), seq_len, dtype=torch.int64)
    y = torch.empty(len(starts), seq_len, dtype=torch.int64)
    # Row-by-row copies stay below torch's parallel grain size: one batched gather + cast spun
    # up OpenMP and was 10-50x slower on a busy 2-core machine.
    for row, s in enumerate(starts.tolist()):
        x[row].copy_(tokens[s : s + seq_len])
        y[row].copy_(tokens[s + 1 : s + seq_len + 1])
    return x, y


class BatchSampler:
    """Random (x, y) windows from a token stream; batch ``i`` depends only on (seed, i).

    That makes resuming exact: restore :meth:`state_dict` and the same batches follow, with
    no generator state to save.
    """

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0) -> None:
        _check_stream(tokens, batch_size, seq_len)
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.step = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return int64 ``(x, y)`` of shape (batch_size, seq_len), y = x shifted by one."""
        g = torch.Generator()
        # Mask into the generator's seed range so any int seed/step is accepted.
        g.manual_seed((self.seed * 1_000_003 + self.step) & 0xFFFF_FFFF_FFFF_FFFF)
        high = len(self.tokens) - self.seq_len  # last valid start is len - seq_len - 1
        starts = torch.randint(0, high, (self.batch_size,), generator=g)
        self.step += 1
        return _windows(self.tokens, starts, self.seq_len)

    def state_dict(self) -> dict[str, int]:
        return {
            "seed": self.seed,
            "step": self.step,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in ("batch_size", "seq_len"):
            if name in state and int(state[name]) != getattr(self, name):
                raise ValueError(
                    f"sampler state has {name}={state[name]}, but this sampler uses "
                    f"{getattr(self, name)}; resume with the same {name}"
                )
        self.seed = int(state["seed"])
        self.step = int(state["step"])


def eval_batches(
    tokens: torch.Tensor, batch_size: int, seq_len: int, n_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic evaluation batches of windows spread evenly over the whole stream.

    Windows never share a target token. A short stream gives fewer batches; one with at least
    seq_len + 1 tokens but room for fewer than ``batch_size`` windows gives one smaller batch.
    """
    _check_stream(tokens, batch_size, seq_len)
    if n_batches < 1:
        raise ValueError(f"n_batches must be >= 1, got {n_batches}")
    room = (len(tokens) - 1) // seq_len  # windows with disjoint targets that fit
    wanted = min(batch_size * n_batches, room)
    if wanted >= batch_size:
        wanted -= wanted % batch_size
    span = len(tokens) - seq_len - 1  # last valid start
    # Integer spacing >= seq_len because wanted <= room, so targets stay disjoint.
    starts = torch.tensor([i * span // max(wanted - 1, 1) for i in range(wanted)])
    batches = []
    for b in range(0, wanted, batch_size):
        batches.append(_windows(tokens, starts[b : b + batch_size], seq_len))
    return batches
