"""The package's one comparison (``mfsdp_hotfix/compare.py``), loaded from its file.

Importing it as ``mfsdp_hotfix.compare`` would import ``mfsdp_hotfix`` first, and that arms the
hotfix: a process that runs a release as shipped must not import the package at all.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

NAME = "mfsdp_hotfix_compare"
PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mfsdp_hotfix",
                    "compare.py")


def _load() -> ModuleType:
    if NAME in sys.modules:
        return sys.modules[NAME]
    spec = importlib.util.spec_from_file_location(NAME, PATH)
    assert spec is not None and spec.loader is not None, PATH
    module = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


compare = _load().compare


def not_compared(outcome: str, **extra: Any) -> dict[str, Any]:
    """The comparison record of a case that compared nothing (``crash``, ``unsupported``)."""
    return {"outcome": outcome, "steps_compared": 0, "tensors_compared": 0,
            "max_abs_diff": None, "rel_l2": None, **extra}
