"""Where a checkpoint (or an exported folder) lands (fileio.staging, place_folder): an existing
empty folder is filled, never replaced (its mode, inode and links stay), a symlink's target gets
the checkpoint, a `.NAME.old` that mod did not move aside is never deleted, and a write is
still all or nothing for a reader. Commands that write to a chosen folder refuse one they
could not write to before their work (`mod calibrate --out`)."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
import torch
from helpers import TINY, tc

from mixture_of_depths import MoDConfig, MoDTransformer
from mixture_of_depths.cli import main
from mixture_of_depths.fileio import OLD_MARK
from mixture_of_depths.runtime.checkpoint import load_model, resolve_checkpoint, save_checkpoint
from mixture_of_depths.train import train

CFG = MoDConfig(**TINY)


def _save(path, seed: int = 0):  # noqa: ANN001, ANN202
    torch.manual_seed(seed)
    return save_checkpoint(path, MoDTransformer(CFG), CFG)


def _weights(path) -> torch.Tensor:  # noqa: ANN001
    return load_model(path)[0].embed.weight


def _identity(path) -> tuple[int, int]:  # noqa: ANN001
    st = os.stat(path)
    return st.st_ino, stat.S_IMODE(st.st_mode)


@pytest.mark.parametrize("mode", [0o700, 0o555])
def test_an_existing_empty_folder_is_filled_not_replaced(tmp_path, mode):
    out = tmp_path / "out"
    out.mkdir()
    os.chmod(out, mode)
    before = _identity(out)
    try:
        if os.access(out, os.W_OK):  # root writes into a read-only folder; its mode stays
            _save(out)
            assert (out / "config.json").exists() and _weights(out).shape[0] == CFG.vocab_size
        else:
            with pytest.raises(PermissionError):
                _save(out)
            assert list(out.iterdir()) == []
        assert _identity(out) == before
        assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary left beside it
    finally:
        os.chmod(out, 0o700)


def test_a_symlink_to_a_folder_gets_the_checkpoint_in_its_target(tmp_path):
    target = tmp_path / "elsewhere" / "ck"
    target.mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(target)
    _save(link)
    assert link.is_symlink() and (target / "config.json").exists()
    first = _weights(link).clone()
    _save(link, seed=1)  # replacing a checkpoint through the link: still the link, new weights
    assert link.is_symlink() and (target / "config.json").exists()
    assert not torch.equal(_weights(link), first)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "not-yet" / "ck")
    _save(dangling)
    assert dangling.is_symlink() and (tmp_path / "not-yet" / "ck" / "config.json").exists()


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_dot_old_that_is_not_ours_is_never_deleted(tmp_path, kind):
    out, old = tmp_path / "ck", tmp_path / ".ck.old"
    if kind == "file":
        old.write_text("mine")
    else:
        old.mkdir()
        (old / "notes.txt").write_text("mine")
    _save(out)  # a new checkpoint: `old` is not in the way
    with pytest.raises(FileExistsError, match=r"\.ck\.old is in the way .* left alone"):
        _save(out, seed=1)  # replacing it would need the name
    assert (old.read_text() if kind == "file" else (old / "notes.txt").read_text()) == "mine"
    assert (out / "config.json").exists()


def test_our_own_dot_old_from_a_crash_is_read_then_removed(tmp_path, monkeypatch):
    out = tmp_path / "ck"
    _save(out)
    first = _weights(out).clone()
    real = os.replace

    def crash_after_the_first_rename(src, dst):  # noqa: ANN001, ANN202
        real(src, dst)
        if str(dst).endswith(".ck.old"):
            raise KeyboardInterrupt  # killed between the two renames

    monkeypatch.setattr(os, "replace", crash_after_the_first_rename)
    with pytest.raises(KeyboardInterrupt):
        _save(out, seed=1)
    monkeypatch.setattr(os, "replace", real)
    assert not out.exists() and (tmp_path / ".ck.old" / OLD_MARK).exists()
    assert resolve_checkpoint(out) == tmp_path / ".ck.old"
    assert torch.equal(_weights(out), first)  # the previous checkpoint, whole
    _save(out, seed=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_a_write_into_a_folder_cut_short_leaves_no_checkpoint(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    import mixture_of_depths.runtime.checkpoint as ck

    def fail(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        raise OSError("injected: the write failed")

    monkeypatch.setattr(ck, "atomic_save_tensors", fail)
    with pytest.raises(OSError, match="injected"):
        _save(out)
    monkeypatch.undo()
    assert list(out.iterdir()) == []  # no config.json: no checkpoint, and still empty
    _save(out)
    assert (out / "config.json").exists()


def test_mod_calibrate_refuses_an_out_it_cannot_write_before_calibrating(
    corpus, tmp_path, capsys, monkeypatch
):
    run = tmp_path / "run"
    train(CFG, tc(corpus, run, steps=2, eval_batches=4, seq_len=32), progress=False)
    ck = str(run / "checkpoint")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    capsys.readouterr()
    import mixture_of_depths.cli.calibrate as cal

    def no_work(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("calibrated before refusing --out")

    monkeypatch.setattr(cal, "load_model", no_work)
    for out, says in (
        (a_file, f"--out {a_file} is a file, not a folder"),
        (a_file / "sub", f"--out {a_file / 'sub'}: {a_file} is a file, not a folder"),
        (run, f"--out {run} exists and is not empty"),
    ):
        assert main(["calibrate", ck, "--out", str(out)]) == 2
        assert says in capsys.readouterr().err
    locked = tmp_path / "locked"
    locked.mkdir()
    monkeypatch.setattr(os, "access", lambda path, mode: str(path) != str(locked))
    assert main(["calibrate", ck, "--out", str(locked / "new")]) == 2
    assert f"{locked} is not writable by this user" in capsys.readouterr().err
    monkeypatch.undo()
    empty = tmp_path / "empty"
    empty.mkdir()
    os.chmod(empty, 0o750)
    before = _identity(empty)
    assert main(["calibrate", ck, "--out", str(empty)]) == 0
    assert _identity(empty) == before and (empty / "config.json").exists()


def test_a_kill_while_the_old_copy_is_deleted_never_blocks_the_next_save(tmp_path, monkeypatch):
    out = tmp_path / "ck"
    _save(out)
    import mixture_of_depths.fileio as fileio

    real = fileio.shutil.rmtree

    def killed_after_the_marker(path, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        if (Path(path) / OLD_MARK).exists():  # rmtree goes in directory order: the mark first
            (Path(path) / OLD_MARK).unlink()
            raise KeyboardInterrupt
        return real(path, *a, **kw)

    monkeypatch.setattr(fileio.shutil, "rmtree", killed_after_the_marker)
    with pytest.raises(KeyboardInterrupt):
        _save(out, seed=1)
    monkeypatch.undo()
    second = _weights(out).clone()  # the new checkpoint is in place, whole
    _save(out, seed=2)  # what the kill left is mod's own, not "in the way"
    assert not torch.equal(_weights(out), second)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_replacing_a_read_only_checkpoint_folder_says_so(tmp_path, monkeypatch):
    out = tmp_path / "ck"
    _save(out)
    real = Path.touch

    def read_only(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        if self.name == OLD_MARK:  # as a folder without write permission refuses (not as root)
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **kw)

    monkeypatch.setattr(Path, "touch", read_only)
    says = rf"{re.escape(str(out))} is read-only: .* write permission"
    with pytest.raises(PermissionError, match=says):
        _save(out, seed=1)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"] and _weights(out) is not None
