"""``mfsdp-hotfix bootstrap-path``: the folder of the hotfix's sitecustomize, for job scripts
that put it on PYTHONPATH themselves."""

from __future__ import annotations

import argparse

from .. import bootstrap

NAME = "bootstrap-path"
HELP = "print the folder to prepend to PYTHONPATH"
USAGE: str | None = None
DESCRIPTION = ("Print the folder holding the hotfix's sitecustomize, for job scripts: "
               "PYTHONPATH=$(mfsdp-hotfix bootstrap-path):$PYTHONPATH")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options."""


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    print(bootstrap.SITECUSTOMIZE_DIR)
    return 0
