"""``mfsdp-hotfix run -- COMMAND``: COMMAND with the hotfix's sitecustomize first on PYTHONPATH,
so that every Python process it starts loads the hotfix (``audit`` starts its COMMAND so too)."""

from __future__ import annotations

import argparse
import os
import sys

from .. import bootstrap
from .exits import CANNOT_START

NAME = "run"
HELP = "run a command with the hotfix on every process"
USAGE: str | None = "mfsdp-hotfix run -- COMMAND [ARGS...]"
DESCRIPTION = ("Run COMMAND with the hotfix's sitecustomize first on PYTHONPATH, so that it and "
               "every Python process it starts load the hotfix (for environments that do not "
               "process site-packages .pth files).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_command_argument(parser)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    command = command_after_dashes(args.cmd, parser)
    os.environ["PYTHONPATH"] = pythonpath_with_bootstrap()
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"mfsdp-hotfix run: cannot start {command[0]!r}: {exc}", file=sys.stderr)
        return CANNOT_START


def add_command_argument(parser: argparse.ArgumentParser) -> None:
    """COMMAND and its arguments, after ``--`` (read back by :func:`command_after_dashes`)."""
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="COMMAND",
                        help="the command and its arguments, after --")


def command_after_dashes(command: list[str], parser: argparse.ArgumentParser,
                         options: str = "") -> list[str]:
    """COMMAND after ``--``; none is a usage error of ``parser`` (the command's own), with an
    example that has the ``options`` given."""
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        verb = parser.prog.split()[-1]
        parser.error(f"{verb} needs a command: {parser.prog} {options}{' ' if options else ''}"
                     "-- torchrun ... train.py")
    return command


def pythonpath_with_bootstrap() -> str:
    """PYTHONPATH with the sitecustomize bootstrap first."""
    entries = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    return os.pathsep.join([bootstrap.SITECUSTOMIZE_DIR] + entries)
