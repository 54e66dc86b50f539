"""The commands of ``mfsdp-hotfix``, one module each (``cli.py`` is the parser and the dispatch).

They read the package's lower layers; nothing below imports them.
"""

from __future__ import annotations

import argparse
from typing import Protocol


class Command(Protocol):
    """What each command module has: its name, the texts of its help, and its options. ``cli.py``
    makes its subparser from them, so that every command is listed and described one way."""

    NAME: str
    HELP: str  # its line in ``mfsdp-hotfix --help``
    USAGE: str | None  # its usage line where argparse's own would mislead
    DESCRIPTION: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the command's options to its own ``parser``."""

    def run(self, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        """Carry the command out; returns its exit status (:mod:`.exits`). ``parser`` is the
        command's own, for its usage errors."""
