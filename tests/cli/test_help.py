"""Every `mod` help text equals its snapshot in tests/cli/help/ (taken before the layout of
docs/layout.md was built, with ``COLUMNS=100``): moving code must not change a command's
interface. A deliberate change of a flag updates the snapshots with
``MOD_UPDATE_HELP=1 pytest tests/cli/test_help.py`` (then review the diff)."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest

from mixture_of_depths.cli import COMMANDS, main
from mixture_of_depths.cli.flags import FIELD_HELP
from mixture_of_depths.config import MoDConfig
from mixture_of_depths.train.config import TrainConfig

SNAPSHOTS = Path(__file__).parent / "help"


@pytest.mark.skipif(
    sys.version_info[:2] != (3, 11), reason="argparse lays help out differently across Pythons"
)
@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_text_is_unchanged(command, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as stop:
        main([command, "--help"] if command else ["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    path = SNAPSHOTS / f"{command or 'mod'}.txt"
    if os.environ.get("MOD_UPDATE_HELP") == "1":
        path.write_text(text)
    assert text == path.read_text()


def test_every_command_has_a_snapshot():
    names = {p.stem for p in SNAPSHOTS.glob("*.txt")}
    assert names == {"mod", *COMMANDS}


@pytest.mark.parametrize("cls", [MoDConfig, TrainConfig])
def test_every_config_field_says_what_it_means_in_its_flag(cls):
    """A new field gets a line of help, and no help is left for a field that is gone."""
    names = {f.name.removeprefix("_") for f in dataclasses.fields(cls)}  # MoDConfig's _d_ff
    described = FIELD_HELP[cls.__name__]
    assert names == set(described), names ^ set(described)
    assert all(text.strip() for text in described.values())


def test_every_flag_with_a_default_says_it_in_its_help():
    """A flag whose default is a value (not None or off) shows it in `mod CMD --help` (issue 56,
    item 7): through ShowDefaults, or its own text's "(default: ...)"."""
    import argparse

    from mixture_of_depths.cli import build_parser
    from mixture_of_depths.cli.flags import ShowDefaults

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    silent = []
    for name, parser in sub.choices.items():
        for action in parser._actions:
            d = action.default
            if not action.option_strings or d is None or d is False or d == argparse.SUPPRESS:
                continue
            text = action.help or ""
            shown = text and ("default" in text or parser.formatter_class is ShowDefaults)
            if not shown:  # argparse prints nothing for a flag without help, ShowDefaults or not
                silent.append(f"mod {name} {action.option_strings[-1]} (default {d!r})")
    assert not silent, silent
