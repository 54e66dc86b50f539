"""Interpreter-start entry points: the ``.pth`` file and the ``sitecustomize`` route.

Both only arm the trigger (see ``trigger``): no torch, no megatron, no wrapt at start-up, and
nothing here may raise into ``site``.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import trigger

# The one-line ``mfsdp_hotfix.pth`` beside this module is installed at the root of site-packages,
# where ``site`` executes it; it opts out on MFSDP_HOTFIX_BOOTSTRAP=0 before importing anything.
PTH_FILE = Path(__file__).resolve().parent / "mfsdp_hotfix.pth"
SITECUSTOMIZE_DIR = Path(__file__).resolve().parent / "sitecustomize"
_BOOTSTRAP_VALUES = {"", "1", "on", "true", "yes", "0", "off", "false", "no"}


def start(source: str) -> None:
    """Arm the hotfix for this interpreter; ``source`` is ``pth`` or ``sitecustomize``."""
    raw = os.environ.get("MFSDP_HOTFIX_BOOTSTRAP", "")
    if raw.strip().lower() not in _BOOTSTRAP_VALUES:
        import sys

        sys.stderr.write(f"mfsdp_hotfix: MFSDP_HOTFIX_BOOTSTRAP={raw!r} is not understood "
                         "(accepted: 1/on or 0/off); the bootstrap stays on\n")
    trigger.arm(source)
