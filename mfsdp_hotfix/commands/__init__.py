"""The commands of ``mfsdp-hotfix``, one module each (``cli.py`` is the parser and the dispatch).

They read the package's lower layers; nothing below imports them.
"""

from __future__ import annotations

import argparse
from typing import Protocol, TypeAlias

# What ``ArgumentParser.add_subparsers()`` returns (generic for type checkers only).
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class Command(Protocol):
    """What each command module has."""

    NAME: str

    def add_parser(self, commands: Subparsers) -> argparse.ArgumentParser:
        """Add the command's subparser, with its options, to the top-level parser's
        ``commands``; returns it."""

    def run(self, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        """Carry the command out; returns its exit status (:mod:`.exits`). ``parser`` is the
        command's own, for its usage errors."""
