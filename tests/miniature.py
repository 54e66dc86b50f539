"""A miniature of Megatron-FSDP's gradient pool and reduce-scatter pipeline on the CPU stand-in.

It keeps only what the slot-reuse rule is about: a two-slot pool, a reduce-scatter (RS) that
records its event on the RS stream and queues it, and a drain that pops the queue, waits on the
event (on whatever stream is current) and frees the slot.  No megatron, no torch install.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from mfsdp_hotfix.selftest import cuda_standin as cs


def miniature() -> types.ModuleType:
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

    class MaxPoolAllocator(FixedPoolAllocator):
        """Its own ``allocate``/``free`` (as the release's is), slots keyed with a dtype."""

        def allocate(self, bucket_id: int, *args: Any, **kwargs: Any) -> None:
            if bucket_id not in self.using_buffer:
                assert self.idle_buffer, f"No buffer found for Bucket ID {bucket_id}"
                group, offset = self.idle_buffer.pop(0)
                self.using_buffer[bucket_id] = (group, "float32", offset)  # type: ignore

        def free(self, bucket_id: int) -> None:
            if bucket_id in self.using_buffer:
                group, _, offset = self.using_buffer.pop(bucket_id)  # type: ignore
                self.idle_buffer.append((group, offset))

    class GradReducePipeline:
        def __init__(self, pool: FixedPoolAllocator, rs_stream: cs.Stream) -> None:
            self.buffer = types.SimpleNamespace(parameter_groups=pool.fsdp_param_groups,
                                                main_grad_alloc=pool)
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
    module.MaxPoolAllocator = MaxPoolAllocator  # type: ignore[attr-defined]
    module.GradReducePipeline = GradReducePipeline  # type: ignore[attr-defined]
    module.Group = Group  # type: ignore[attr-defined]
    return module


def backward(observe: Callable[[types.ModuleType], Any], drain_on_rs_stream: bool,
             name: str = "fsdp_grads", allocator: str = "FixedPoolAllocator") -> None:
    """Five units in backward order: take a slot, write, reduce-scatter, keep one RS in flight;
    ``observe(module)`` wraps the miniature's classes first."""
    mini = miniature()
    observe(mini)
    groups = [mini.Group() for _ in range(5)]
    pool = getattr(mini, allocator)(name, groups)
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
