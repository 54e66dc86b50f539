"""Era B (megatron-fsdp 0.5.x, megatron-core 0.18.x): the ``> 1`` stopgap hides the crash.

Shipped code passes on CPU but hands pool slots to a writer stream that never waited for the
reduce-scatter that last read them (the ordering checker reports it: an expected failure of the
shipped code).  Patched: grads equal the reference and every reuse is ordered.  Negative controls:
the threshold change alone (getter guard disabled) crashes; the getter guard alone keeps the
unordered reuse.
"""

from __future__ import annotations

import pytest
from realcases import (
    assert_matches_reference,
    assert_no_buffer_crash,
    case,
    describe,
    repaired,
)

pytestmark = pytest.mark.slow

ERA_B = [
    pytest.param("megatron-fsdp", "0.5.1", "emulated", id="fsdp-0.5.1"),
    pytest.param("megatron-core", "0.18.2", "mcore", id="core-0.18.2-mcore-linear"),
]


@pytest.mark.parametrize(("dist", "version", "linear"), ERA_B)
def test_patched_grads_equal_reference_and_reuse_is_ordered(dist: str, version: str,
                                                            linear: str) -> None:
    result = case(dist, version, hotfix="on", linear=linear)
    assert repaired(result, "getter-guard") and repaired(result, "ordered-drain"), describe(result)
    assert_matches_reference(result)
    assert result.ordering_checks, describe(result)
    assert result.ordering_violations == 0, describe(result)


@pytest.mark.parametrize(("dist", "version", "linear"), ERA_B)
def test_shipped_code_reuses_slots_unordered(dist: str, version: str, linear: str) -> None:
    result = case(dist, version, hotfix="off", linear=linear)
    assert_matches_reference(result)  # no crash, right numbers on CPU ...
    assert result.ordering_violations, describe(result)  # ... but the GPU race is there


@pytest.mark.parametrize(("dist", "version", "linear"), ERA_B)
def test_threshold_change_alone_crashes(dist: str, version: str, linear: str) -> None:
    assert_no_buffer_crash(case(dist, version, hotfix="on", linear=linear,
                                disabled_fixes="getter-guard"))


def test_getter_guard_alone_leaves_reuse_unordered() -> None:
    result = case("megatron-fsdp", "0.5.1", hotfix="on", disabled_fixes="ordered-drain")
    assert_matches_reference(result)
    assert result.ordering_violations, describe(result)
