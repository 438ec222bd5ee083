"""Corpus discovery, tokenizers, a cached token stream, and resumable batching.

`corpus`, `tokenizers`, `stream` and `batches` hold them; their public names are here.

Default corpus
    With no data given, the corpus is the source of the running Python's standard library:
    every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, excluding anything under
    ``site-packages``/``dist-packages``, sorted by relative path. It is roughly 1800 files
    (~30 MB) of real, varied text that every Python install already has, so training works
    offline with nothing to download. Different Python versions give different corpora.

A folder
    Every UTF-8 text file under it, recursively, sorted by relative path; hidden files and
    folders and files that look binary or are not UTF-8 are left out. A file or folder whose
    *name* is not UTF-8 is left out too, with a warning naming its bytes (one odd name in a
    large folder should not stop a run); a ``--data`` path that is itself not UTF-8 is refused.

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

from .batches import BatchSampler, eval_batches
from .corpus import corpus_files, default_cache_dir, default_corpus_files, split_files
from .stream import load_splits, tokenize_files
from .tokenizers import (
    EOT_TOKEN,
    TOKENIZER_FILE,
    TOKENIZER_KINDS,
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    load_tokenizer,
    make_tokenizer,
)

__all__ = [
    "EOT_TOKEN",
    "TOKENIZER_FILE",
    "TOKENIZER_KINDS",
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
