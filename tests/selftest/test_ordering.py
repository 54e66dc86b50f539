"""The pool-ordering checker on a miniature pool/pipeline pair (no megatron, no torch needed).

The miniature keeps only what the rule is about: a two-slot pool, a reduce-scatter (RS) that
records its event on the RS stream and queues it, and a drain that pops the queue, waits on the
event (on whatever stream is current) and frees the slot.  Draining on the RS stream must be
reported; draining on the writer's stream must not.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

from mfsdp_hotfix.selftest import cuda_standin as cs
from mfsdp_hotfix.selftest.ordering import OrderingChecker


def _miniature() -> types.ModuleType:
    class Group:
        def __init__(self) -> None:
            self.fsdp_unit_id = 0

    class FixedPoolAllocator:
        def __init__(self, name: str, groups: list[Group]) -> None:
            self.name = name
            self.fsdp_param_groups = groups
            self.using_buffer: dict[int, tuple[int, int]] = {}
            self.idle_buffer = [(0, 0), (1, 0)]

        def allocate(self, bucket_id: int, *args: Any, **kwargs: Any) -> None:
            if bucket_id not in self.using_buffer:
                assert self.idle_buffer, f"No buffer found for bucket_id: {bucket_id}"
                self.using_buffer[bucket_id] = self.idle_buffer.pop(0)

        def free(self, bucket_id: int) -> None:
            if bucket_id in self.using_buffer:
                self.idle_buffer.append(self.using_buffer.pop(bucket_id))

    class GradReducePipeline:
        def __init__(self, pool: FixedPoolAllocator, rs_stream: cs.Stream) -> None:
            self.buffer = types.SimpleNamespace(parameter_groups=pool.fsdp_param_groups)
            self.pool = pool
            self.rs_stream = rs_stream
            self.grad_reduce_queue: list[tuple[cs.Event, Any, int]] = []

        def _bucket_group_gradient_reduce(self, group: list[int], async_op: bool = True) -> None:
            self.rs_stream.wait_stream(cs.current_stream())
            with cs.stream(self.rs_stream):
                event = self.rs_stream.record_event()
            for b in group:
                self.grad_reduce_queue.append((event, lambda b=b: self.pool.free(b), b))

        def drain(self, keep: int) -> None:
            while len(self.grad_reduce_queue) > keep:
                event, free, _ = self.grad_reduce_queue.pop(0)
                event.wait()
                free()

    module = types.ModuleType("miniature_pgb")
    module.FixedPoolAllocator = FixedPoolAllocator  # type: ignore[attr-defined]
    module.GradReducePipeline = GradReducePipeline  # type: ignore[attr-defined]
    module.Group = Group  # type: ignore[attr-defined]
    return module


def _backward(drain_on_rs_stream: bool, name: str = "fsdp_grads") -> OrderingChecker:
    """Five units in backward order: take a slot, write, reduce-scatter, keep one RS in flight."""
    mini = _miniature()
    checker = OrderingChecker()
    checker.install(mini)
    groups = [mini.Group() for _ in range(5)]
    pool = mini.FixedPoolAllocator(name, groups)
    rs = cs.Stream(name="rs")
    pipe = mini.GradReducePipeline(pool, rs)
    for unit in reversed(range(5)):
        if drain_on_rs_stream:
            with cs.stream(rs):
                pipe.drain(1)
        else:
            pipe.drain(1)
        pool.allocate(unit)  # the writer (current stream) now writes the unit's wgrad
        pipe._bucket_group_gradient_reduce([unit])
    pipe.drain(0)
    return checker


def test_drain_on_rs_stream_is_reported() -> None:
    checker = _backward(drain_on_rs_stream=True)
    assert checker.checks == 3  # units 2, 1, 0 reuse a slot
    assert len(checker.violations) == 3
    v = checker.violations[0]
    assert (v.previous_bucket, v.new_bucket, v.writer) == (4, 2, "default")


def test_drain_on_writer_stream_is_clean() -> None:
    checker = _backward(drain_on_rs_stream=False)
    assert checker.checks == 3
    assert checker.violations == []


def test_only_gradient_pools_are_checked() -> None:
    checker = _backward(drain_on_rs_stream=True, name="fsdp_params")
    assert checker.checks == 0 and checker.violations == []


def test_wrappers_keep_the_release_behaviour() -> None:
    mini = _miniature()
    OrderingChecker().install(mini)
    pool = mini.FixedPoolAllocator("fsdp_grads", [mini.Group() for _ in range(3)])
    pool.allocate(0)
    pool.allocate(1)
    with pytest.raises(AssertionError, match="No buffer found"):
        pool.allocate(2)
