"""``mfsdp-hotfix bootstrap-path``: the folder of the hotfix's sitecustomize, for job scripts
that put it on PYTHONPATH themselves."""

from __future__ import annotations

import argparse

from .. import bootstrap
from . import Subparsers

NAME = "bootstrap-path"


def add_parser(commands: Subparsers) -> argparse.ArgumentParser:
    return commands.add_parser(NAME, help="print the folder to prepend to PYTHONPATH",
                               description="Print the folder holding the hotfix's sitecustomize, "
                                           "for job scripts: PYTHONPATH=$(mfsdp-hotfix "
                                           "bootstrap-path):$PYTHONPATH")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    print(bootstrap.SITECUSTOMIZE_DIR)
    return 0
