"""Shims around ``torch.distributed`` for the one-GPU fake-process-group harness.

The code lives in the package, ``mfsdp_hotfix/selftest/gpu_shims.py`` (the GPU selftest uses it
too); this module re-exports it under the names the validation scripts use: ``install_rs_delay``,
``install_nccl_semantics``, ``EventWork``, ``STATS``. The file is loaded by its path, without
importing ``mfsdp_hotfix``: importing the package arms the hotfix, and the harness's "as shipped"
cases must run the release unpatched.
"""

from __future__ import annotations

import importlib.util
import os
import sys

_NAME = "_mfsdp_hotfix_gpu_shims"
_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "mfsdp_hotfix", "selftest", "gpu_shims.py")


def _load():
    if _NAME in sys.modules:
        return sys.modules[_NAME]
    spec = importlib.util.spec_from_file_location(_NAME, _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = module
    spec.loader.exec_module(module)
    return module


_shims = _load()
STATS = _shims.STATS
EventWork = _shims.EventWork
install_rs_delay = _shims.install_rs_delay
install_nccl_semantics = _shims.install_nccl_semantics

__all__ = ["STATS", "EventWork", "install_nccl_semantics", "install_rs_delay"]
