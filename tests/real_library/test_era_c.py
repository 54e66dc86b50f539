"""Era C (megatron-fsdp 0.6.x, megatron-core 0.19.x: fixed upstream except stream ordering).

Patching does not change the numbers (same grads, bit for bit).  The shipped drain runs on the
reduce-scatter stream, so the ordering checker reports the shipped code (expected failure of
shipped code) and reports nothing once the hotfix is loaded.
"""

from __future__ import annotations

import pytest
from realcases import assert_matches_reference, case, describe, extended

pytestmark = pytest.mark.slow

ERA_C = [
    pytest.param("megatron-fsdp", "0.6.1", id="fsdp-0.6.1"),
    extended("megatron-core", "0.19.2", id="core-0.19.2"),
]


@pytest.mark.parametrize(("dist", "version"), ERA_C)
def test_patching_does_not_change_results(dist: str, version: str) -> None:
    shipped = case(dist, version, hotfix="off")
    patched = case(dist, version, hotfix="on")
    assert_matches_reference(shipped)
    assert_matches_reference(patched)
    assert shipped.grad_digest and shipped.grad_digest == patched.grad_digest, describe(patched)


@pytest.mark.parametrize(("dist", "version"), ERA_C)
def test_shipped_unordered_patched_ordered(dist: str, version: str) -> None:
    shipped = case(dist, version, hotfix="off")
    patched = case(dist, version, hotfix="on")
    assert shipped.ordering_violations, describe(shipped)
    assert patched.ordering_checks, describe(patched)
    assert patched.ordering_violations == 0, describe(patched)


def test_harness_baseline_without_double_buffer() -> None:
    """No pool at all: the harness' own gather/reference agree, and nothing is checked."""
    result = case("megatron-fsdp", "0.6.1", hotfix="off", double_buffer=False)
    assert_matches_reference(result)
    assert result.ordering_checks == 0, describe(result)
