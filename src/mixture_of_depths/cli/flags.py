"""Flags shared by the commands: one flag per field of a config dataclass, and what the user
gave of them."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from typing import Any

from ..config import FIELD_CHOICES, PRESETS, MoDConfig
from .fieldhelp import MODEL_HELP, TRAIN_HELP

DEFAULT_PRESET = "small"
# --out names the folder a command creates: a run folder for the commands that train (the
# checkpoint in OUT/checkpoint, beside the logs and summary), the checkpoint itself for those
# that write a model; every command that reads a checkpoint takes either (README, "Command line").
OUT_CHECKPOINT = (
    "the checkpoint folder to write (new, or empty): the checkpoint itself, not a run folder "
    "as mod train's --out; commands that read a checkpoint take either"
)
FIELD_HELP = {"MoDConfig": MODEL_HELP, "TrainConfig": TRAIN_HELP}  # by class name


class ShowDefaults(argparse.HelpFormatter):
    """Help that gives each flag's default where its text does not say it already (like
    argparse's ArgumentDefaultsHelpFormatter, less "(default: None)" and "(default: False)")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        silent = d is None or d is False or d == argparse.SUPPRESS or not action.option_strings
        return text if silent or "default" in text else f"{text} (default: %(default)s)".lstrip()


def field_type(annotation: Any) -> Any:
    """The scalar type of a dataclass field annotation such as ``int | None``."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def comma_floats(text: str) -> tuple[float, ...]:
    """``"0.25,0.125"`` -> (0.25, 0.125), for a tuple-of-floats field."""
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers such as 0.25,0.125, got {text!r}"
        ) from None


def add_checkpoint(parser: argparse.ArgumentParser, text: str) -> None:
    """The checkpoint as the first positional argument, as every command that reads one takes
    it; the older `--checkpoint` flag still works (`checkpoint_arg` notes it is deprecated)."""
    parser.add_argument("checkpoint", nargs="?", metavar="CKPT", help=text)
    parser.add_argument("--checkpoint", dest="checkpoint_flag", help=argparse.SUPPRESS)


def checkpoint_arg(args: argparse.Namespace, command: str, required: bool = True) -> str | None:
    """The checkpoint given (see `add_checkpoint`), or an error saying how to give one."""
    usage = f"mod {command} CKPT ..."
    if args.checkpoint_flag is not None:
        if args.checkpoint is not None:
            raise ValueError(f"give the checkpoint once: {usage}")
        print(
            f"mod {command}: note: --checkpoint is deprecated: give the checkpoint first: {usage}",
            file=sys.stderr,
        )
        return args.checkpoint_flag
    if args.checkpoint is None and required:
        raise ValueError(f"give a checkpoint: {usage}")
    return args.checkpoint


def add_preset_flag(parser: argparse.ArgumentParser) -> None:
    """--preset: the model preset the model flags override."""
    parser.add_argument(
        "--preset",
        default=None,
        choices=sorted(PRESETS),
        help=f"model preset (default: {DEFAULT_PRESET})",
    )


def add_dataclass_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    skip: set[str],
    preset: bool = False,
    choices: dict[str, tuple[str, ...]] = FIELD_CHOICES,
    shown: dict[str, str] | None = None,
) -> None:
    """One flag per field, default None so that only flags the user gave override anything.

    With `preset`, the flags override a model preset: their help shows what the default preset
    gives (a preset sets d_model, layers, heads...; d_ff and n_kv_heads follow from them), not the
    dataclass's own defaults, which no preset uses. `shown`: the default a command applies
    itself where the field's is not it (e.g. tune-routers' --tune routers).
    """
    hints = typing.get_type_hints(cls)
    described = FIELD_HELP.get(cls.__name__, {})
    base = MoDConfig.preset(DEFAULT_PRESET) if preset else None
    from_preset = {k for p in PRESETS.values() for k in p} | {"d_ff", "n_kv_heads"}
    for f in dataclasses.fields(cls):
        name = f.name.removeprefix("_")  # MoDConfig stores what was given of d_ff as _d_ff
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        typ = field_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        what = described.get(name, "")
        if base is not None:
            default = getattr(base, name)
        if isinstance(default, float):
            default = f"{default:g}"  # 2.66667, not 2.6666666666666665
        elif default == "":
            default = "empty"
        if base is not None:
            if name in from_preset:
                default = f"from --preset; {DEFAULT_PRESET}: {default}"
            if name == "aux_loss_weight":  # None resolves by the causal router
                default = "0.1 with the predictor, 0.01 with aux_loss or token-choice recursion"
        if shown and name in shown:
            default = shown[name]
        if typ is bool:
            parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"{what} (default: {default})".lstrip(),
            )
        elif typing.get_origin(typ) is tuple:  # e.g. recursion_capacities: 1,0.25,0.125
            parser.add_argument(
                flag,
                type=comma_floats,
                default=None,
                metavar="FLOATS",
                help=f"{what or 'comma-separated'} (default: {default})",
            )
        elif name in choices:
            parser.add_argument(
                flag,
                choices=choices[name],
                default=None,
                help=f"{what} (default: {default})".lstrip(),
            )
        else:
            parser.add_argument(
                flag,
                type=typ,
                default=None,
                metavar=typ.__name__.upper(),
                help=f"{what} (default: {default})".lstrip(),
            )


def given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of `cls` among the parsed flags that the user gave (not None)."""
    names = {f.name.removeprefix("_") for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}
