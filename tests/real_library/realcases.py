"""Helpers: real Megatron-FSDP releases through the selftest harness, once per distinct case.

Each case is two gloo ranks in subprocesses (see ``mfsdp_hotfix/selftest``).  Results are cached
for the session, so a test that needs the unpatched run of a release and another that needs the
same run's ordering report share one run.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest
import releases

from mfsdp_hotfix.selftest.runner import run_case
from mfsdp_hotfix.selftest.spec import CaseResult, CaseSpec

# Exact: the FSDP run and the single-process reference compute every per-rank wgrad with the
# same kernels on the same shapes; the 1/2 scaling of each rank's grad is a power of two (exact)
# and the two ranks' grads and the microbatches are summed in the same order.  Every passing
# run seen so far matched bit for bit; a broken buffer gives O(1e-1) errors or NaN.
GRAD_TOLERANCE = 0.0

_cache: dict[str, CaseResult] = {}

# megatron-core 0.17.1 holds megatron-fsdp 0.4.0's code and 0.19.2 holds 0.6.1's; each of their
# cases costs about 20 s (importing megatron.core), so they run only when asked for.
EXTENDED = os.environ.get("MFSDP_TEST_ALL_RELEASES", "") not in ("", "0")


def extended(*values: Any, id: str) -> Any:  # noqa: A002 - pytest's name
    marks = [] if EXTENDED else [pytest.mark.skip(
        reason="same code as a standalone release; set MFSDP_TEST_ALL_RELEASES=1")]
    return pytest.param(*values, id=id, marks=marks)


def run_cached(spec: CaseSpec, tick: Any = None) -> CaseResult:
    """:func:`run_case`, once per distinct spec in this test session."""
    key = spec.to_json()
    if key not in _cache:
        _cache[key] = run_case(spec, tick)
    return _cache[key]


def release_path(dist: str, version: str) -> str:
    if dist == "megatron-core" and version >= "0.18" and importlib.util.find_spec("triton") is None:
        pytest.skip("megatron-core >= 0.18 imports triton at import time "
                    "(transformer/moe/paged_stash.py); triton is not installed")
    return str(releases.unpacked(dist, version))


def case(dist: str, version: str, **fields: Any) -> CaseResult:
    """Run (or reuse) one case on an unpacked release; fields go to :class:`CaseSpec`."""
    flavour = "core" if dist == "megatron-core" else "standalone"
    return run_cached(CaseSpec(flavour=flavour, path=release_path(dist, version), **fields))


def describe(result: CaseResult) -> str:
    """Everything needed to understand a failed assertion."""
    return (f"{result.spec.label()}: crashed={result.crashed} exception={result.exception!r}\n"
            f"max_abs_grad_error={result.max_abs_grad_error} ordering="
            f"{result.ordering_violations}/{result.ordering_checks} "
            f"status={result.hotfix_status}\n{result.traceback or ''}\n{result.log_tail[-3000:]}")


def assert_matches_reference(result: CaseResult) -> None:
    assert not result.crashed, describe(result)
    assert result.max_abs_grad_error is not None, describe(result)
    assert result.max_abs_grad_error <= GRAD_TOLERANCE, describe(result)


def assert_no_buffer_crash(result: CaseResult) -> None:
    assert result.crashed, describe(result)
    assert "No buffer found for bucket_id" in (result.exception or ""), describe(result)


def repaired(result: CaseResult, fix: str) -> bool:
    """Whether the hotfix reports ``fix`` as applied to the copy the case used."""
    status = result.hotfix_status or {}
    for copy in status.get("copies", []) if isinstance(status, dict) else []:
        state = (copy.get("fixes", {}).get(fix) or {}).get("state")
        if state == "applied":
            return True
    return False
