"""The full-precision capture put into every run of a parity check the same way: ``site/`` is
a folder for ``PYTHONPATH`` whose ``sitecustomize`` records what Megatron-LM's ``training_log``
is given (see its docstring), then runs the ``sitecustomize`` it shadows, so a user's own and
``mfsdp-hotfix run``'s keep working."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from ..log_lines import CAPTURE_PREFIX

SITE = Path(__file__).resolve().parent / "site"
VARIABLE = "MFSDP_PARITY_CAPTURE"  # read by site/sitecustomize.py, which imports nothing of ours


def capture_file_template(capture_dir: str) -> str:
    """The file each run's printing rank writes (``{rank}`` stands for the rank)."""
    return os.path.join(capture_dir, CAPTURE_PREFIX + "{rank}.jsonl")


def capture_environment(capture_dir: str, env: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to ``env`` so that a run carries the capture: the capture's folder
    first on ``PYTHONPATH`` (the run's own entries after it) and where to write."""
    path = [str(SITE)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join(path), VARIABLE: capture_file_template(capture_dir)}
