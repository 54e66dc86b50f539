"""Interpreter-start entry points: the ``.pth`` file and the ``sitecustomize`` route.

Both run in every Python process of the environment, so they import nothing that ``site`` has
not loaded already (``os``, ``sys``; ``tests/test_bootstrap.py`` holds the list): they warn about
misspelt variables and arm the trigger (see ``trigger``); no torch, no megatron, no wrapt, and
nothing here may raise into ``site``.
"""

import os

from . import trigger, variables

# The one-line ``mfsdp_hotfix.pth`` beside this module is installed at the root of site-packages,
# where ``site`` executes it; it opts out on MFSDP_HOTFIX_BOOTSTRAP=0 before importing anything.
PTH_NAME = "mfsdp_hotfix.pth"
SITECUSTOMIZE_DIR = os.path.join(os.path.dirname(os.path.realpath(__file__)), "sitecustomize")


def start(source: str) -> None:
    """Arm the hotfix for this interpreter; ``source`` is ``pth`` or ``sitecustomize``."""
    raw = os.environ.get(variables.BOOTSTRAP, "")
    if variables.switch(raw) is None:
        import sys

        sys.stderr.write(f"mfsdp_hotfix: {variables.BOOTSTRAP}={raw!r} is not understood "
                         "(accepted: 1/on or 0/off); the bootstrap stays on\n")
    trigger.arm(source)  # first: a check of names must never cost a process its fixes
    variables.tell_once(variables.misspelt(os.environ))
