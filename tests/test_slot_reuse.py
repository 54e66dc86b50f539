"""The slot-reuse rule's wrappers: read-only, crash capture, and what a bookkeeping error does."""

from __future__ import annotations

import types
from typing import Any

import pytest
from miniature import backward, miniature

from mfsdp_hotfix import gradient_pools, slot_reuse
from mfsdp_hotfix.patching import fix_of
from mfsdp_hotfix.selftest import cuda_standin as cs
from mfsdp_hotfix.selftest.ordering import StandinClocks
from mfsdp_hotfix.slot_reuse import SlotReuse


def _pool(errors: list[tuple[str, Exception]], rule: SlotReuse[Any] | None = None) -> Any:
    mini = miniature()
    rule = rule if rule is not None else SlotReuse(StandinClocks())
    undo = slot_reuse.observe(mini, rule, "test-rule", lambda where, exc: errors.append(
        (where, exc)))
    assert fix_of(mini.FixedPoolAllocator.__dict__["allocate"]) == "test-rule"
    pool = mini.FixedPoolAllocator("fsdp_grads", [mini.Group() for _ in range(3)])
    return mini, pool, rule, undo


def test_an_allocation_crash_is_recorded_and_re_raised_unchanged() -> None:
    errors: list[tuple[str, Exception]] = []
    _, pool, rule, _ = _pool(errors)
    pool.allocate(0)
    pool.allocate(1)
    with pytest.raises(AssertionError, match="No buffer found for bucket_id: 2") as raised:
        pool.allocate(2)
    assert rule.crash == {"pool": "fsdp_grads", "bucket": 2,
                          "error": "AssertionError: No buffer found for bucket_id: 2"}
    assert raised.value.__traceback__ is not None and errors == []
    # Under the traceback, whose error it is: the observer's frames are between the caller and
    # the release's code, and a user would otherwise file the release's crash against us.
    (note,) = raised.value.__notes__
    assert note.startswith("mfsdp_hotfix: this error was raised by Megatron-FSDP's own "
                           "FixedPoolAllocator.allocate (the release's code). The frames of "
                           "mfsdp_hotfix/patching.py and mfsdp_hotfix/slot_reuse.py above are "
                           "test-rule, which watches the gradient pool"), note


def test_a_bookkeeping_error_is_reported_and_the_original_still_runs() -> None:
    errors: list[tuple[str, Exception]] = []

    class Broken(StandinClocks):
        def mark_of(self, event: object) -> Any:
            raise RuntimeError("bookkeeping bug")

    mini, pool, rule, _ = _pool(errors, SlotReuse(Broken()))
    pool.allocate(0)
    pipe = mini.GradReducePipeline(pool, cs.Stream())
    assert pipe._bucket_group_gradient_reduce([0]) is None  # the release's own result
    assert len(pipe.grad_reduce_queue) == 1
    assert [where for where, _ in errors] == ["GradReducePipeline._bucket_group_gradient_reduce"]


def test_an_inactive_rule_only_calls_the_originals_and_undo_restores_them() -> None:
    errors: list[tuple[str, Exception]] = []
    mini, pool, rule, undo = _pool(errors)
    original = mini.FixedPoolAllocator.__dict__["allocate"].__wrapped__
    rule.active = False
    pool.allocate(0)
    pool.free(0)
    assert rule.reuses == 0 and pool.using_buffer == {} and errors == []
    assert undo() is True
    assert mini.FixedPoolAllocator.__dict__["allocate"] is original


def test_a_reuse_after_a_reduce_scatter_the_observer_did_not_see_is_counted_not_judged() -> None:
    class Blind(StandinClocks):
        def mark_of(self, event: object) -> Any:
            return None  # e.g. recorded before the audit was armed

    rule = SlotReuse(Blind())
    backward(lambda module: slot_reuse.observe(module, rule, "test-rule", _raise), True)
    assert (rule.reuses, rule.unseen, rule.unordered_count) == (0, 3, 0)


@pytest.mark.parametrize("allocator", ["FixedPoolAllocator", "MaxPoolAllocator"])
@pytest.mark.parametrize("drain_on_rs_stream", [True, False])
def test_every_known_pool_allocator_is_watched(allocator: str, drain_on_rs_stream: bool) -> None:
    rule: SlotReuse[Any] = SlotReuse(StandinClocks())
    watched: list[types.ModuleType] = []

    def observe(module: types.ModuleType) -> None:
        watched.append(module)
        slot_reuse.observe(module, rule, "test-rule", _raise)

    backward(observe, drain_on_rs_stream, allocator=allocator)
    assert rule.reuses == 3 and rule.unordered_count == (3 if drain_on_rs_stream else 0)
    assert rule.pools == {f"fsdp_grads ({allocator})": 3} and rule.unwatched == []
    assert {fix_of(vars(getattr(watched[0], spec.cls)).get(name))
            for spec in gradient_pools.POOL_ALLOCATORS for name in (spec.allocate, spec.free)} == {
        "test-rule"}


def test_a_gradient_pool_of_an_unknown_class_is_listed_as_unwatched() -> None:
    rule: SlotReuse[Any] = SlotReuse(StandinClocks())

    def observe(module: types.ModuleType) -> None:
        slot_reuse.observe(module, rule, "test-rule", _raise)
        methods = {name: getattr(f, "__wrapped__", f)  # the release's own, not our wrappers
                   for name, f in vars(module.FixedPoolAllocator).items()}
        module.NewPoolAllocator = type(  # type: ignore[attr-defined]
            "NewPoolAllocator", (), methods)
        module.FixedPoolAllocator = module.NewPoolAllocator  # what the release now builds

    backward(observe, True)
    assert (rule.reuses, rule.unwatched) == (0, ["fsdp_grads (NewPoolAllocator)"])


def test_parameter_pools_are_not_judged_and_a_gradient_pool_of_another_name_is_unwatched(
        ) -> None:
    rule: SlotReuse[Any] = SlotReuse(StandinClocks())
    backward(lambda module: slot_reuse.observe(module, rule, "test-rule", _raise), True,
             name="fsdp_params")
    # the miniature keeps that pool where a release keeps its gradient pool (main_grad_alloc)
    assert (rule.reuses, rule.pools) == (0, {})
    assert rule.unwatched == ["fsdp_params (FixedPoolAllocator)"]


def test_a_copy_with_no_known_pool_allocator_cannot_be_observed() -> None:
    mini = miniature()
    del mini.FixedPoolAllocator, mini.MaxPoolAllocator
    with pytest.raises(LookupError, match="no pool allocator class it knows"):
        slot_reuse.observe(mini, SlotReuse(StandinClocks()), "test-rule", _raise)


def _raise(where: str, exc: Exception) -> None:
    raise exc
