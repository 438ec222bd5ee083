"""A study named by its folder (`mod study FOLDER`): the folder is a Python package
outside the installed library whose ``__init__.py`` defines ``STUDY``, a `rounds.Round`. Its
results, report and figures live in the folder itself (``--quick``: in ``<folder>/quick``), its
runs' checkpoints in ``<folder>/runs`` (ignored by git), unless ``--out`` / ``--work`` say
otherwise: nothing lands in the current folder by accident.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ENTRY = "__init__.py"


def study_folder(path: str | Path) -> Path:
    """`path` as a study folder (absolute), or a ValueError saying what a study folder is."""
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        raise ValueError(f"study {str(path)!r}: no such folder (a study is a folder whose "
                         f"{ENTRY} defines STUDY)")  # fmt: skip
    if not (folder / ENTRY).is_file():
        raise ValueError(f"study {str(path)!r}: the folder has no {ENTRY} (a study is a folder "
                         "whose __init__.py defines STUDY)")  # fmt: skip
    return folder


def module_name(folder: Path) -> str:
    """The name the study's package is imported under: its folder's name and a hash of its
    path, so that two folders of one name never share a module."""
    digest = hashlib.sha256(str(folder).encode()).hexdigest()[:8]
    return f"mod_study_{folder.name.replace('-', '_')}_{digest}"


def package_path(folder: Path) -> tuple[Path, str]:
    """The folder to put on ``sys.path`` and the dotted name to import `folder` by: a study
    inside a chain of packages (experiments/round3, where experiments/ has an __init__.py)
    imports as ``experiments.round3``, so that its modules can import their sibling studies."""
    parts, parent = [folder.name], folder.parent
    while (parent / ENTRY).is_file() and parent.parent != parent:
        parts.insert(0, parent.name)
        parent = parent.parent
    return parent, ".".join(parts)


def load_package(path: str | Path) -> ModuleType:
    """Import the study folder `path` as a package (its modules import each other relatively),
    once per process: by its dotted name where it sits in a chain of packages (`package_path`),
    else on its own under `module_name`."""
    folder = study_folder(path)
    root, dotted = package_path(folder)
    if "." in dotted:
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        return importlib.import_module(dotted)
    name = module_name(folder)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, folder / ENTRY, submodule_search_locations=[str(folder)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_study(path: str | Path) -> Any:
    """The `rounds.Round` the study folder `path` defines as ``STUDY``."""
    module = load_package(path)
    study = getattr(module, "STUDY", None)
    if study is None:
        raise ValueError(f"study {str(path)!r}: its {ENTRY} defines no STUDY")
    return study


def out_for(path: str | Path, quick: bool) -> Path:
    """Where a study folder's results go: the folder, or ``<folder>/quick`` for a smoke run."""
    folder = study_folder(path)
    return folder / "quick" if quick else folder


def work_for(path: str | Path, quick: bool) -> Path:
    """Where a study folder's runs train: ``<out>/runs``."""
    return out_for(path, quick) / "runs"
