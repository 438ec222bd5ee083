from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mixture_of_depths.data import (
    BatchSampler,
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    corpus_files,
    default_cache_dir,
    default_corpus_files,
    eval_batches,
    load_splits,
    load_tokenizer,
    make_tokenizer,
    split_files,
    tokenize_files,
)

UNICODE = "héllo wörld — 日本語 🙂\n\ttabs, <|endoftext|> and NUL-free text\n"


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Never touch the real ~/.cache from tests.
    monkeypatch.setenv("MOD_CACHE_DIR", str(tmp_path / "default-cache"))


def make_corpus(root: Path, n: int = 12) -> Path:
    """A small folder corpus with nested dirs, plus files that must be skipped."""
    for i in range(n):
        sub = root / f"pkg{i % 3}" / ("deep" if i % 2 else "")
        sub.mkdir(parents=True, exist_ok=True)
        body = f"# file {i}\n" + "".join(
            f"def f{i}_{j}(x):\n    return x * {j}\n" for j in range(i)
        )
        (sub / f"mod{i}.py").write_text(body + UNICODE, encoding="utf-8")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "secret.txt").write_text("hidden dir", encoding="utf-8")
    (root / ".dotfile").write_text("hidden file", encoding="utf-8")
    (root / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    return root


# ------------------------------------------------------------------------------ corpus + split


def test_default_corpus_files_is_stdlib_source() -> None:
    files = default_corpus_files()
    assert len(files) > 100
    assert any(p.name == "os.py" for p in files)
    assert all(p.suffix == ".py" for p in files)
    assert not any({"site-packages", "dist-packages"} & set(p.parts) for p in files)
    assert files == default_corpus_files()  # deterministic


def test_corpus_files_folder_skips_hidden_and_binary(tmp_path: Path) -> None:
    root = make_corpus(tmp_path / "corpus")
    files = corpus_files(root)
    names = {p.name for p in files}
    assert len(files) == 12
    assert not names & {"secret.txt", ".dotfile", "blob.bin", "latin1.txt"}
    rel = [p.relative_to(root).as_posix() for p in files]
    assert rel == sorted(rel)
    assert corpus_files(str(root)) == files
    single = root / "pkg0" / "mod0.py"
    assert corpus_files(single) == [single]


def test_text_sniff_tolerates_char_split_at_8kib(tmp_path: Path) -> None:
    f = tmp_path / "long.txt"
    f.write_bytes(b"a" * 8191 + "é".encode() + b"tail")  # "é" straddles the 8 KiB sniff
    assert corpus_files(tmp_path) == [f]


def test_corpus_files_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope"):
        corpus_files(tmp_path / "nope")
    empty = tmp_path / "empty"
    (empty / ".git").mkdir(parents=True)
    (empty / "x.bin").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match="empty"):
        corpus_files(empty)
    with pytest.raises(ValueError, match="x.bin"):
        corpus_files(empty / "x.bin")


def test_names_that_are_not_utf8_are_skipped_and_named(tmp_path: Path) -> None:
    root = make_corpus(tmp_path / "corpus")
    bad_file, bad_dir = root / os.fsdecode(b"caf\xe9.py"), root / os.fsdecode(b"d\xff")
    try:
        bad_file.write_text("x = 1\n")
        bad_dir.mkdir()
    except OSError:
        pytest.skip("this filesystem takes only UTF-8 names")
    (bad_dir / "inner.py").write_text("y = 2\n")
    with pytest.warns(UserWarning, match="2 file or folder name.s. that are not UTF-8") as seen:
        files = corpus_files(root)
    assert len(files) == 12  # the run goes on with the others
    note = str(seen[0].message)
    assert repr(os.fsencode(bad_file)) in note and repr(os.fsencode(bad_dir)) in note
    with pytest.warns(UserWarning, match="not UTF-8"):
        train, val, _ = load_splits(root, cache_dir=tmp_path / "cache")
    assert len(train) and len(val)
    with pytest.raises(ValueError, match=r"data path b'.*d\\xff' is not UTF-8"):
        corpus_files(bad_dir)  # named itself: refused, not skipped


def test_split_is_deterministic_disjoint_and_covering(tmp_path: Path) -> None:
    files = corpus_files(make_corpus(tmp_path / "corpus", n=40))
    train, val = split_files(files, val_fraction=0.2)
    assert train and val
    # Oracle: sha1 of the path relative to the common root, as a fraction of 2**64.
    root = tmp_path / "corpus"
    score = {
        f: int.from_bytes(hashlib.sha1(f.relative_to(root).as_posix().encode()).digest()[:8])
        / 2**64
        for f in files
    }
    assert 0 < sum(v < 0.2 for v in score.values()) < len(files)  # no fallback move here
    assert val == [f for f in files if score[f] < 0.2]
    assert set(train).isdisjoint(val)
    assert set(train) | set(val) == set(files)
    assert len(train) + len(val) == len(files)
    assert split_files(list(reversed(files)), 0.2) == (
        list(reversed(train)),
        list(reversed(val)),
    )
    # Depends on paths relative to the common root, so a moved corpus splits the same way.
    moved = make_corpus(tmp_path / "elsewhere" / "copy", n=40)
    train2, val2 = split_files(corpus_files(moved), 0.2)
    rel = lambda ps, r: [p.relative_to(r) for p in ps]  # noqa: E731
    assert rel(val2, moved) == rel(val, tmp_path / "corpus")
    assert rel(train2, moved) == rel(train, tmp_path / "corpus")


@pytest.mark.parametrize("fraction", [1e-9, 0.999999])
def test_split_both_sides_non_empty(tmp_path: Path, fraction: float) -> None:
    files = corpus_files(make_corpus(tmp_path / "c", n=5))
    train, val = split_files(files, fraction)
    assert len(train) >= 1 and len(val) >= 1 and len(train) + len(val) == 5
    two_train, two_val = split_files(files[:2], fraction)
    assert len(two_train) == len(two_val) == 1


def test_split_single_file_and_bad_fraction(tmp_path: Path) -> None:
    f = tmp_path / "a.txt"
    f.write_text("abc", encoding="utf-8")
    assert split_files([f]) == ([f], [])
    with pytest.raises(ValueError, match="val_fraction"):
        split_files([f, f], 1.5)


# --------------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip(tmp_path: Path) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(UNICODE)
    assert ids == list(UNICODE.encode("utf-8"))
    assert max(ids) < 256 and tok.vocab_size == 257 and tok.eot_id == 256
    assert tok.decode(ids) == UNICODE
    assert tok.decode([tok.eot_id, *ids, tok.eot_id]) == UNICODE
    assert tok.decode([0xFF]) == "\ufffd"
    assert [t.tolist() for t in tok.encode_many([UNICODE, ""])] == [ids, []]
    tok.save(tmp_path)
    assert json.loads((tmp_path / "tokenizer.json").read_text()) == {"type": "byte"}
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)


def test_bpe_trains_round_trips_and_reloads(tmp_path: Path) -> None:
    files = corpus_files(make_corpus(tmp_path / "corpus", n=12))
    tok = make_tokenizer("bpe", files, vocab_size=300)
    assert isinstance(tok, BPETokenizer) and isinstance(tok, Tokenizer)
    assert 257 <= tok.vocab_size <= 300
    text = "def f3_2(x):\n    return x * 2\n" + UNICODE + "unseen: ŝ ∑ \x7f"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # Literal "<|endoftext|>" in text is text, not the separator.
    assert tok.eot_id not in ids
    assert tok.decode([tok.eot_id, *ids]) == text
    merged = tok.encode("    return x")
    assert len(merged) < len("    return x")  # merges were learnt
    out = tmp_path / "tok"
    tok.save(out)
    assert "model" in json.loads((out / "tokenizer.json").read_text())
    again = load_tokenizer(out)
    assert isinstance(again, BPETokenizer)
    assert again.encode(text) == ids
    assert (again.vocab_size, again.eot_id) == (tok.vocab_size, tok.eot_id)
    assert again.fingerprint() == tok.fingerprint()
    assert [t.tolist() for t in tok.encode_many([text, "x"])] == [ids, tok.encode("x")]


def test_bpe_is_trained_once_per_corpus_and_cached(tmp_path: Path, monkeypatch) -> None:
    files = corpus_files(make_corpus(tmp_path / "corpus", n=6))
    cache = tmp_path / "tokcache"
    first = make_tokenizer("bpe", files, vocab_size=280, cache_dir=cache)
    assert len(list(cache.glob("bpe-*.json"))) == 1

    def no_training(*args, **kwargs):  # noqa: ANN002, ANN003
        raise AssertionError("trained again")

    monkeypatch.setattr(BPETokenizer, "train", no_training)
    again = make_tokenizer("bpe", files, vocab_size=280, cache_dir=cache)
    assert again.fingerprint() == first.fingerprint()
    with pytest.raises(AssertionError, match="trained again"):  # another size: another key
        make_tokenizer("bpe", files, vocab_size=290, cache_dir=cache)
    files[0].write_text(files[0].read_text() + "\n# edited\n")  # an edited file: another key
    with pytest.raises(AssertionError, match="trained again"):
        make_tokenizer("bpe", files, vocab_size=280, cache_dir=cache)
    monkeypatch.undo()
    make_tokenizer("bpe", files, vocab_size=280, cache_dir=cache)  # the edited corpus's entry
    assert len(list(cache.glob("bpe-*.json"))) == 2
    for f in cache.glob("bpe-*.json"):  # damaged: trained again and rewritten
        f.write_text("{cut sho")
    assert make_tokenizer("bpe", files, vocab_size=280, cache_dir=cache).vocab_size <= 280
    assert sorted(f.read_text().startswith("{cut") for f in cache.glob("bpe-*.json")) == [
        False,
        True,
    ]


def test_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"'wordpiece'.*byte.*bpe"):
        make_tokenizer("wordpiece", [])
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"type": "mystery"}')
    with pytest.raises(ValueError, match="neither"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="vocab_size"):
        BPETokenizer.train([tmp_path / "tokenizer.json"], vocab_size=100)


# ------------------------------------------------------------------------------- token stream


def test_tokenize_files_matches_per_file_encodes(tmp_path: Path) -> None:
    files = corpus_files(make_corpus(tmp_path / "corpus"))
    tok = ByteTokenizer()
    tokens = tokenize_files(files, tok, cache_dir=tmp_path / "cache")
    expected: list[int] = []
    for f in files:
        expected += tok.encode(f.read_text(encoding="utf-8")) + [tok.eot_id]
    assert tokens.dtype == torch.uint16 and tokens.dim() == 1
    assert tokens.tolist() == expected
    assert tokenize_files([], tok, cache_dir=tmp_path / "cache").numel() == 0


def test_tokenize_files_bpe_matches_per_file_encodes(tmp_path: Path) -> None:
    files = corpus_files(make_corpus(tmp_path / "corpus", n=6))
    tok = BPETokenizer.train(files, vocab_size=280)
    tokens = tokenize_files(files, tok, cache_dir=tmp_path / "cache")
    expected: list[int] = []
    for f in files:
        expected += tok.encode(f.read_text(encoding="utf-8")) + [tok.eot_id]
    assert tokens.tolist() == expected


def test_invalid_utf8_is_replaced(tmp_path: Path) -> None:
    f = tmp_path / "bad.py"
    f.write_bytes(b"ok \xff\xfe end")
    tokens = tokenize_files([f], ByteTokenizer(), cache_dir=tmp_path / "cache")
    assert ByteTokenizer().decode(tokens.tolist()) == "ok \ufffd\ufffd end"


def test_second_call_hits_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = corpus_files(make_corpus(tmp_path / "corpus"))
    cache = tmp_path / "cache"
    tok = ByteTokenizer()
    first = tokenize_files(files, tok, cache_dir=cache)
    assert len(list(cache.glob("tokens-*.safetensors"))) == 1
    assert not list(cache.glob("*.tmp"))

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("tokenised again instead of using the cache")

    monkeypatch.setattr(tok, "encode_many", boom)
    monkeypatch.setattr(tok, "encode", boom)
    assert torch.equal(tokenize_files(files, tok, cache_dir=cache), first)
    # A changed file changes the key, so the stale cache is not used.
    files[0].write_text("changed, and longer than before " * 5, encoding="utf-8")
    with pytest.raises(AssertionError, match="tokenised again"):
        tokenize_files(files, tok, cache_dir=cache)


def test_default_cache_dir_from_env(tmp_path: Path) -> None:
    assert default_cache_dir() == tmp_path / "default-cache"
    f = tmp_path / "a.txt"
    f.write_text("hello", encoding="utf-8")
    tokenize_files([f], ByteTokenizer())
    assert list((tmp_path / "default-cache").glob("tokens-*.safetensors"))


def test_corrupt_cache_falls_back_and_is_overwritten(tmp_path: Path) -> None:
    files = corpus_files(make_corpus(tmp_path / "corpus"))
    cache = tmp_path / "cache"
    tok = ByteTokenizer()
    first = tokenize_files(files, tok, cache_dir=cache)
    (path,) = cache.glob("tokens-*.safetensors")
    path.write_bytes(b"\x10\x00\x00\x00garbage that is not safetensors")
    assert torch.equal(tokenize_files(files, tok, cache_dir=cache), first)
    assert path.stat().st_size > 100  # rewritten with real data
    path.write_bytes(path.read_bytes()[:-7])  # truncated
    assert torch.equal(tokenize_files(files, tok, cache_dir=cache), first)
    # A well-formed file written for another key (a 16-hex-digit name clash) is not trusted.
    save_file({"tokens": torch.zeros(3, dtype=torch.uint16)}, path, metadata={"key": "other"})
    assert torch.equal(tokenize_files(files, tok, cache_dir=cache), first)


def test_load_splits_folder(tmp_path: Path) -> None:
    root = make_corpus(tmp_path / "corpus", n=20)
    train, val, tok = load_splits(root, val_fraction=0.2, cache_dir=tmp_path / "cache")
    assert isinstance(tok, ByteTokenizer)
    train_files, val_files = split_files(corpus_files(root), 0.2)
    assert torch.equal(val, tokenize_files(val_files, tok, cache_dir=tmp_path / "cache"))
    assert len(train) == sum(f.stat().st_size + 1 for f in train_files)
    assert int((train == tok.eot_id).sum()) == len(train_files)


def test_load_splits_single_file_by_position(tmp_path: Path) -> None:
    f = tmp_path / "one.txt"
    f.write_text("x" * 999, encoding="utf-8")
    train, val, _ = load_splits(f, val_fraction=0.1, cache_dir=tmp_path / "cache")
    assert len(train) + len(val) == 1000  # 999 bytes + eot
    assert len(val) == 100
    assert torch.equal(torch.cat([train, val]), tokenize_files([f], ByteTokenizer(), tmp_path))
    # Same files and cache dir, other tokenizer: must not be served the byte stream.
    bpe_train, bpe_val, bpe = load_splits(f, "bpe", cache_dir=tmp_path / "cache")
    assert isinstance(bpe, BPETokenizer) and len(bpe_val) >= 1 and len(bpe_train) >= 1
    assert len(bpe_train) + len(bpe_val) < 1000
    assert torch.equal(torch.cat([bpe_train, bpe_val]), tokenize_files([f], bpe, tmp_path))


# ----------------------------------------------------------------------------------- batching


def stream(n: int = 5000) -> torch.Tensor:
    # Distinct values so a window's position in the stream is recoverable.
    return torch.arange(n, dtype=torch.int32)


def test_batch_sampler_windows_are_shifted_slices() -> None:
    tokens = (torch.arange(3000) * 7 % 257).to(torch.uint16)
    sampler = BatchSampler(tokens, batch_size=4, seq_len=16, seed=3)
    all_windows = tokens.to(torch.int64).unfold(0, 17, 1)  # every valid (x|y) window
    for _ in range(5):
        x, y = sampler.next_batch()
        assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        joined = torch.cat([x, y[:, -1:]], dim=1)
        for row in joined:
            assert bool((all_windows == row).all(dim=1).any())
    ids = stream()
    sampler = BatchSampler(ids, batch_size=8, seq_len=10, seed=1)
    x, y = sampler.next_batch()
    for row_x, row_y in zip(x, y, strict=True):
        start = int(row_x[0])
        assert torch.equal(row_x, ids[start : start + 10].long())
        assert torch.equal(row_y, ids[start + 1 : start + 11].long())


def test_batch_sampler_covers_stream_ends() -> None:
    ids = torch.arange(12, dtype=torch.int32)  # 2 valid windows for seq_len 10
    sampler = BatchSampler(ids, batch_size=64, seq_len=10)
    starts = {int(s) for s in sampler.next_batch()[0][:, 0]}
    assert starts == {0, 1}


def test_batch_sampler_exact_resume() -> None:
    ids = stream()
    full = BatchSampler(ids, batch_size=4, seq_len=32, seed=7)
    reference = [full.next_batch() for _ in range(6)]

    first = BatchSampler(ids, batch_size=4, seq_len=32, seed=7)
    for _ in range(3):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))
    assert state == {"seed": 7, "step": 3, "batch_size": 4, "seq_len": 32}

    resumed = BatchSampler(ids, batch_size=4, seq_len=32, seed=0)
    resumed.load_state_dict(state)
    for x_ref, y_ref in reference[3:]:
        x, y = resumed.next_batch()
        assert torch.equal(x, x_ref) and torch.equal(y, y_ref)

    other_seed = BatchSampler(ids, batch_size=4, seq_len=32, seed=8).next_batch()
    assert not torch.equal(other_seed[0], reference[0][0])
    with pytest.raises(ValueError, match="batch_size"):
        BatchSampler(ids, batch_size=5, seq_len=32).load_state_dict(state)


def test_batch_sampler_errors() -> None:
    with pytest.raises(ValueError, match=r"10 tokens.*17"):
        BatchSampler(stream(10), batch_size=2, seq_len=16)
    with pytest.raises(ValueError, match="batch_size"):
        BatchSampler(stream(), batch_size=0, seq_len=16)
    with pytest.raises(ValueError, match="seq_len"):
        BatchSampler(stream(), batch_size=2, seq_len=0)
    with pytest.raises(ValueError, match=r"10 tokens.*17"):
        eval_batches(stream(10), 2, 16, 4)


def test_eval_batches_deterministic_and_spread() -> None:
    ids = stream(10_000)
    batches = eval_batches(ids, batch_size=4, seq_len=50, n_batches=5)
    assert len(batches) == 5
    again = eval_batches(ids, batch_size=4, seq_len=50, n_batches=5)
    for (x, y), (x2, y2) in zip(batches, again, strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert x.shape == (4, 50) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row in x:
            assert torch.equal(row, ids[int(row[0]) : int(row[0]) + 50].long())
    starts = torch.cat([x[:, 0] for x, _ in batches])
    assert int(starts[0]) == 0 and int(starts[-1]) == 10_000 - 51  # spans the whole stream
    assert bool((starts.diff() >= 50).all())  # no target token is counted twice


def test_eval_batches_short_stream() -> None:
    few = eval_batches(stream(201), batch_size=4, seq_len=50, n_batches=10)
    assert len(few) == 1 and few[0][0].shape == (4, 50)
    tiny = eval_batches(stream(51), batch_size=4, seq_len=50, n_batches=10)
    assert len(tiny) == 1 and tiny[0][0].shape == (1, 50)
    some = eval_batches(stream(50 * 9 + 1), batch_size=4, seq_len=50, n_batches=10)
    assert len(some) == 2  # 9 disjoint windows fit -> 2 full batches
