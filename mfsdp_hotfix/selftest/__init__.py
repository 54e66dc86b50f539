"""CPU selftest harness: the real Megatron-FSDP on two gloo ranks, with and without the hotfix.

Importing this package imports neither torch nor megatron; the work happens in subprocesses.
Entry point for the CLI: :func:`run_selftest`.  For tests: :func:`run_case` with a
:class:`CaseSpec`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mfsdp_hotfix.selftest.runner import run_case
    from mfsdp_hotfix.selftest.selftest import format_table, run_selftest
    from mfsdp_hotfix.selftest.spec import CaseResult, CaseSpec

__all__ = ["CaseResult", "CaseSpec", "format_table", "run_case", "run_selftest"]

_WHERE = {
    "run_case": "mfsdp_hotfix.selftest.runner",
    "run_selftest": "mfsdp_hotfix.selftest.selftest",
    "format_table": "mfsdp_hotfix.selftest.selftest",
    "CaseResult": "mfsdp_hotfix.selftest.spec",
    "CaseSpec": "mfsdp_hotfix.selftest.spec",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(name)
