"""Atomic file writes (temp file, fsync, rename) and JSON helpers: a standalone utility.

Everything the project writes goes through here, so a crash leaves either the old file or the new
one, never a mixture, and nothing is ever unpickled.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file


def umask_mode(default: int = 0o666) -> int:
    """The mode a plain open() would give: mkstemp/mkdtemp create 0600/0700 files."""
    mask = os.umask(0)
    os.umask(mask)
    return default & ~mask


def plain_modes(root: Path) -> None:
    """Give folder `root` and everything under it the modes a plain mkdir/open would: a folder
    made by mkdtemp is 0700, and writers that stage through mkstemp (safetensors') leave 0600."""
    os.chmod(root, umask_mode(0o777))
    for path in Path(root).rglob("*"):
        if not path.is_symlink():
            os.chmod(path, umask_mode(0o777 if path.is_dir() else 0o666))


def fsync_dir(path: Path) -> None:
    """Make renames inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class DiskFullError(OSError):
    """A file could not be written because its filesystem is full (ENOSPC, or a quota)."""

    def __init__(self, path: Path, detail: str = "") -> None:
        super().__init__(f"could not write {path}: the disk is full (ENOSPC){detail}")
        self.errno = errno.ENOSPC
        self.path = Path(path)


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` says the disk is full: an OSError, or safetensors' Rust writer's
    ``SafetensorError("... No space left on device (os error 28)")``, which is no OSError."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(exc, SafetensorError) and any(
        f"(os error {n})" in str(exc) for n in (errno.ENOSPC, errno.EDQUOT)
    )


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """`write(tmp)` into a temp file beside `path`, fsync it, then rename it over `path`.
    A full disk is a `DiskFullError` naming `path` (the old file, if any, stays)."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        write(tmp)
        with open(tmp, "rb+") as f:  # on disk before the rename makes it visible
            os.fsync(f.fileno())
        os.chmod(tmp, umask_mode())
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if is_disk_full(exc) and not isinstance(exc, DiskFullError):
            raise DiskFullError(path) from exc
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def atomic_save_tensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None
) -> None:
    cpu = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    atomic_write(path, lambda tmp: save_file(cpu, tmp, metadata))


def strict(obj: Any) -> Any:
    """`obj` with every NaN or infinite float replaced by None: JSON has no token for them, and
    strict parsers (JavaScript's, jq, Go's) reject Python's bare ``NaN``."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [strict(v) for v in obj]
    return obj


def json_text(obj: Any, **kwargs: Any) -> str:
    """Strict JSON text: non-finite floats become null (see `strict`); never ``NaN``."""
    return json.dumps(strict(obj), allow_nan=False, **kwargs)


def write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json_text(obj, indent=2, sort_keys=True) + "\n")


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


# Marks a `.NAME.old` folder as the previous NAME that `place_folder` moved aside: only such a
# folder is ever deleted (a user's `.NAME.old` is not ours to remove).
OLD_MARK = ".moved-aside-by-mod"


def _temps(folder: Path) -> str:
    return f".{folder.name}.*.tmp"  # what `staging` makes for `folder`


def empty_folder(folder: Path) -> bool:
    """Whether `folder` holds nothing but what writes of it cut short left."""
    return all(p.match(_temps(folder)) for p in Path(folder).iterdir())


def staging(final: Path) -> tuple[Path, Path]:
    """Where folder `final` goes (a symlink's target) and a new temporary folder to write it in
    on the same filesystem: inside `final` when that is an existing empty folder, so that
    `place_folder` fills it and it keeps its owner, mode and links; else beside it. Temporary
    folders of earlier writes cut short go first (one writer per folder is assumed)."""
    final = Path(final)
    place = final.resolve() if final.is_symlink() else final
    for where in (place.parent, place):
        if where.is_dir():
            remove_temps(where, _temps(place))
    into = place.is_dir() and not any(place.iterdir())
    if not into:
        place.parent.mkdir(parents=True, exist_ok=True)
    where = place if into else place.parent
    return place, Path(tempfile.mkdtemp(dir=where, prefix=f".{place.name}.", suffix=".tmp"))


def place_folder(tmp: Path, final: Path) -> None:
    """Make the complete folder `tmp` (from `staging(final)`) the folder `final`, atomically
    for a reader: an empty `final` gets `tmp`'s files moved in, `config.json` last (a folder
    without it is no checkpoint); else `tmp` is renamed into place, the previous `final` kept as
    `.NAME.old` (marked as ours) until the new one is there. A `.NAME.old` that is not ours is
    never deleted: replacing `final` beside one is refused."""
    fsync_dir(tmp)
    if tmp.parent == final:
        for name in sorted(os.listdir(tmp), key=lambda n: n == "config.json"):
            os.replace(tmp / name, final / name)
        os.rmdir(tmp)
        fsync_dir(final)
        return
    old = final.with_name(f".{final.name}.old")
    ours = old.is_dir() and not old.is_symlink() and (old / OLD_MARK).exists()
    if final.exists():
        if ours:  # `final` is whole, so the copy a crash left may go
            _discard(old, final)
        elif old.exists() or old.is_symlink():
            raise FileExistsError(
                f"{old} is in the way of replacing {final}: it is not a previous copy that mod "
                "moved aside, so it is left alone; move it elsewhere"
            )
        _mark(final, old)
        os.replace(final, old)
        ours = True
    # (If only our `old` exists, a crash hit between the renames: it stays until `tmp` is placed.)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if ours:
        _discard(old, final)


def _mark(final: Path, old: Path) -> None:
    """Mark `final` as ours before it is moved aside as `old`: a file inside it, so the folder
    must be writable (a clear error naming it where it is not, not one naming the mark)."""
    try:
        (final / OLD_MARK).touch()
    except PermissionError as exc:
        raise PermissionError(
            f"cannot replace {final}: {final} is read-only: mod marks the previous copy (a file "
            f"{OLD_MARK} inside it) before moving it aside as {old.name}, which needs write "
            f"permission on the folder (chmod u+w {final}), or save elsewhere"
        ) from exc


def _discard(old: Path, final: Path) -> None:
    """Delete our moved-aside copy `old`, renamed first to a temporary name of `final`'s (which
    `staging` removes): `rmtree` goes in directory order, so a kill mid-way could otherwise
    leave `.NAME.old` without its mark, which every later save would take for the user's."""
    doomed = Path(tempfile.mkdtemp(dir=old.parent, prefix=f".{final.name}.", suffix=".tmp"))
    os.replace(old, doomed)  # over the empty folder mkdtemp made: one atomic rename
    shutil.rmtree(doomed, ignore_errors=True)


def check_out_folder(out: Path, flag: str = "--out") -> None:
    """Refuse, before any work, a folder a command could not write its output to: a file, a
    folder holding anything, a place under a file, or one this user cannot write to."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {out} is a file, not a folder: give a new or empty folder")
    if out.is_dir() and not empty_folder(out):
        raise ValueError(f"{flag} {out} exists and is not empty: give a new or empty folder")
    where = out.resolve()
    while not where.exists():
        where = where.parent
    if not where.is_dir():
        raise ValueError(f"{flag} {out}: {where} is a file, not a folder")
    if not os.access(where, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {out}: {where} is not writable by this user")


def remove_temps(folder: Path, pattern: str) -> None:
    """Remove the temporary files and folders matching `pattern` in `folder`: what writes cut
    short by a crash left (``atomic_write``'s temp files, a checkpoint's copy folder)."""
    for tmp in Path(folder).glob(pattern):
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
