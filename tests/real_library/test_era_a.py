"""Era A (unguarded getter, threshold ``> 2``): shipped code crashes; the import fixes it.

megatron-fsdp 0.3.1, 0.4.0 and megatron-core 0.16.1's vendored copy (with megatron-core's own
fused linear), 0.17.1 too.  The oldest releases (megatron-fsdp 0.1.0-0.2.3, megatron-core
0.14-0.15) have their own file, ``test_oldest_releases.py``: they need a third fix and other
harness settings.
"""

from __future__ import annotations

import pytest
from realcases import (
    assert_matches_reference,
    assert_no_buffer_crash,
    case,
    describe,
    extended,
    repaired,
)

pytestmark = pytest.mark.slow

ERA_A = [
    pytest.param("megatron-fsdp", "0.3.1", "emulated", id="fsdp-0.3.1"),
    pytest.param("megatron-fsdp", "0.4.0", "emulated", id="fsdp-0.4.0"),
    pytest.param("megatron-core", "0.16.1", "mcore", id="core-0.16.1-mcore-linear"),
    extended("megatron-core", "0.17.1", "emulated", id="core-0.17.1"),
]


@pytest.mark.parametrize(("dist", "version", "linear"), ERA_A)
def test_unpatched_crashes(dist: str, version: str, linear: str) -> None:
    assert_no_buffer_crash(case(dist, version, hotfix="off", linear=linear))


@pytest.mark.parametrize(("dist", "version", "linear"), ERA_A)
def test_import_alone_repairs_and_grads_equal_reference(dist: str, version: str,
                                                         linear: str) -> None:
    result = case(dist, version, hotfix="on", linear=linear)
    assert repaired(result, "getter-guard"), describe(result)
    assert_matches_reference(result)
    assert result.ordering_checks, describe(result)  # the checker saw slot reuse ...
    assert result.ordering_violations == 0, describe(result)  # ... and all of it ordered


def test_zero2_optim_grads_too() -> None:
    assert_no_buffer_crash(case("megatron-fsdp", "0.4.0", hotfix="off", strategy="optim_grads"))
    result = case("megatron-fsdp", "0.4.0", hotfix="on", strategy="optim_grads")
    assert_matches_reference(result)
    assert result.ordering_violations == 0, describe(result)


def test_getter_guard_alone_is_enough_in_era_a() -> None:
    """Era A's shipped drain runs on the caller's stream, so the guard alone leaves reuse ordered.

    (The same rule reports era B/C, whose drain runs on the reduce-scatter stream.)
    """
    result = case("megatron-fsdp", "0.4.0", hotfix="on", disabled_fixes="ordered-drain")
    assert_matches_reference(result)
    assert result.ordering_checks, describe(result)
    assert result.ordering_violations == 0, describe(result)
