"""Tokenizers: bytes (256 ids and end-of-text), or byte-level BPE trained on the training split
(the `tokenizers` library), saved beside a model as ``tokenizer.json``."""

from __future__ import annotations

import hashlib
import json
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..fileio import atomic_write_text
from .corpus import default_cache_dir, hash_files, read_texts

TOKENIZER_FILE = "tokenizer.json"
EOT_TOKEN = "<|endoftext|>"
TOKENIZER_KINDS = ("byte", "bpe")


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
        tk.train_from_iterator(read_texts(paths), trainer=trainer, length=len(paths))
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
    """Restore the tokenizer saved in ``directory/tokenizer.json`` (a checkpoint; a run folder
    stands for its checkpoint, as in `load_model`)."""
    directory = Path(directory)
    path = directory if directory.is_file() else directory / TOKENIZER_FILE
    if not path.is_file() and (directory / "checkpoint" / TOKENIZER_FILE).is_file():
        path = directory / "checkpoint" / TOKENIZER_FILE
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
        hash_files(h, paths)
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
