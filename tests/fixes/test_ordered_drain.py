"""``ordered-drain``'s count for a pool of N slots: how many queued reduce-scatters stay in flight,
the pool-limit assert, and where N comes from. The pipeline and buffer are stood in for by plain
objects with the attributes the drain reads (the release's names); the real classes, N = 3 and 4,
run in the configuration matrix (tests/real_library/configurations.py, "PR #6316 rebuilt")."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from mfsdp_hotfix.fixes import ordered_drain


def pipeline(slots: int | None, queued_units: list[int], *, configured: int | None = None,
             double_buf_units: tuple[int, ...] = (0, 1, 2, 3, 4, 5)) -> Any:
    """Bucket i belongs to unit i; one queued reduce-scatter per unit in ``queued_units``."""
    config = SimpleNamespace(fsdp_double_buffer=True)
    if configured is not None:
        config.fsdp_buffer_count = configured
    buffer = SimpleNamespace(
        ddp_config=config, double_buf_units=list(double_buf_units),
        parameter_groups=[SimpleNamespace(fsdp_unit_id=i) for i in range(6)],
        main_grad_alloc=None if slots is None else SimpleNamespace(size=slots))
    return SimpleNamespace(buffer=buffer,
                           grad_reduce_queue=[(None, None, unit) for unit in queued_units])


@pytest.mark.parametrize("slots, kept", [(2, 1), (3, 2), (4, 3), (5, 3)])
def test_at_most_n_units_stay_live_counting_the_incoming_one(slots: int, kept: int) -> None:
    # three units' reduce-scatters in flight, a fourth unit's bucket comes in
    assert ordered_drain.entries_to_keep(pipeline(slots, [0, 1, 2]), [3]) == kept


@pytest.mark.parametrize("slots", [2, 3])
def test_the_pool_limit_assert_uses_n(slots: int) -> None:
    incoming = list(range(slots))
    assert ordered_drain.entries_to_keep(pipeline(slots, []), incoming) == 0
    with pytest.raises(AssertionError, match=f"more than the pool's {slots} slots"):
        ordered_drain.entries_to_keep(pipeline(slots, []), incoming + [slots])


def test_n_is_the_built_pools_own_size_whatever_the_config_says_now() -> None:
    assert ordered_drain.pool_size_of(pipeline(3, [], configured=4).buffer) == 3


@pytest.mark.parametrize("configured, expected", [(4, 4), (None, 2)])
def test_without_a_built_pool_n_is_the_configured_count_or_2(configured: int | None,
                                                             expected: int) -> None:
    buffer = pipeline(None, [], configured=configured).buffer
    assert ordered_drain.pool_size_of(buffer) == expected


def test_a_pool_without_a_slot_count_is_an_error() -> None:
    buffer = pipeline(3, []).buffer
    buffer.main_grad_alloc.size = None
    with pytest.raises(TypeError, match="size is None, not a slot count"):
        ordered_drain.pool_size_of(buffer)


def test_one_slot_drains_every_other_unit_before_the_incoming_one() -> None:
    """N=1 (PR #6316's config refuses fsdp_buffer_count < 2; a pool built with one slot anyway):
    the incoming unit takes the only slot, so every queued reduce-scatter of another unit is
    waited on, and a second incoming unit trips the pool-limit assert."""
    assert ordered_drain.entries_to_keep(pipeline(1, [0, 1, 2]), [3]) == 0
    # the newest entry is the incoming unit's own (its slot): only it may stay in flight
    assert ordered_drain.entries_to_keep(pipeline(1, [0, 3]), [3]) == 1
    # retiring is oldest first: another unit queued after it means retiring both
    assert ordered_drain.entries_to_keep(pipeline(1, [3, 0]), [3]) == 0
    with pytest.raises(AssertionError, match="more than the pool's 1 slots"):
        ordered_drain.entries_to_keep(pipeline(1, []), [0, 1])


def test_more_slots_than_units_never_waits() -> None:
    """N larger than the number of units: every unit has a slot of its own, nothing is retired."""
    assert ordered_drain.entries_to_keep(pipeline(8, [0, 1, 2, 3, 4]), [5]) == 5
    assert ordered_drain.entries_to_keep(pipeline(8, []), [0, 1, 2, 3, 4, 5]) == 0
