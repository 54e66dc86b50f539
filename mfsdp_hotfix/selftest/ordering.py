"""Ordering checker for the gradient double buffer (harness only, never part of the product).

Why: the defect the hotfix repairs in 0.5.x/0.6.x is an ordering defect, not a wrong number on
CPU: a pool slot is handed to the next bucket while the reduce-scatter (RS) that last read it
may still be running, and the stream that will write into it never waited for that RS.

Rule checked, for every pool slot of every gradient ``FixedPoolAllocator``:
when the pool hands the slot to a new bucket, the stream current at that moment (the writer)
must already have waited for the event of the last RS that used the slot (the event appended to
``GradReducePipeline.grad_reduce_queue`` with that bucket), directly or transitively, or be the
stream that recorded it.  Otherwise a violation is recorded.  The rule, not a number, is checked.

It wraps methods of the release's own classes in the worker process: ``FixedPoolAllocator
.allocate``/``.free`` and ``GradReducePipeline._bucket_group_gradient_reduce`` (to learn which RS
event belongs to which bucket).  The wrappers only observe; they call the original unchanged.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any

from mfsdp_hotfix.selftest import cuda_standin


@dataclass
class Violation:
    """One slot handed to a new bucket before its writer waited for the slot's last RS."""

    pool: str
    slot: str
    previous_bucket: int
    new_bucket: int
    rs_event: str
    writer: str


@dataclass
class OrderingChecker:
    """Observes one release's gradient pools and collects violations of the reuse rule."""

    checks: int = 0
    violations: list[Violation] = field(default_factory=list)
    # (id(param_groups), bucket_id) -> event of that bucket's latest RS since it got its slot
    _bucket_rs: dict[tuple[int, int], cuda_standin.Event] = field(default_factory=dict)
    # (id(allocator), slot) -> (event of the last RS that read the slot, bucket that owned it)
    _slot_reader: dict[tuple[int, Any], tuple[cuda_standin.Event, int]] = field(
        default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {
            "checks": self.checks,
            "violations": len(self.violations),
            "first_violations": [asdict(v) for v in self.violations[:5]],
        }

    # ---- hooks called by the wrappers
    def after_reduce(self, pipeline: Any, bucket_group: list[int]) -> None:
        groups = id(pipeline.buffer.parameter_groups)
        queued: dict[int, cuda_standin.Event] = {}
        for entry in pipeline.grad_reduce_queue:
            event, bucket_id = entry[0], entry[-1]
            if isinstance(event, cuda_standin.Event):
                queued[bucket_id] = event
        fallback = cuda_standin.last_recorded_event()  # synchronous path: event never queued
        for bucket_id in bucket_group:
            event = queued.get(bucket_id, fallback)
            if event is not None:
                self._bucket_rs[(groups, bucket_id)] = event

    def before_free(self, pool: Any, bucket_id: int) -> Any:
        return pool.using_buffer.get(bucket_id) if _is_grad_pool(pool) else None

    def after_free(self, pool: Any, bucket_id: int, slot: Any) -> None:
        if slot is None or bucket_id in pool.using_buffer:
            return
        event = self._bucket_rs.pop((id(pool.fsdp_param_groups), bucket_id), None)
        key = (id(pool), slot)
        if event is None:
            self._slot_reader.pop(key, None)
        else:
            self._slot_reader[key] = (event, bucket_id)

    def after_allocate(self, pool: Any, bucket_id: int, had_slot: bool) -> None:
        if had_slot or not _is_grad_pool(pool) or bucket_id not in pool.using_buffer:
            return
        self._bucket_rs.pop((id(pool.fsdp_param_groups), bucket_id), None)
        slot = pool.using_buffer[bucket_id]
        reader = self._slot_reader.pop((id(pool), slot), None)
        if reader is None:
            return
        event, previous = reader
        writer = cuda_standin.current_stream()
        self.checks += 1
        if not writer.has_waited_for(event):
            self.violations.append(Violation(
                pool=str(pool.name), slot=repr(slot), previous_bucket=previous,
                new_bucket=bucket_id, rs_event=repr(event), writer=writer.name))

    # ---- installation
    def install(self, pgb_module: ModuleType) -> None:
        """Wrap the pool and pipeline classes of one release's ``param_and_grad_buffer``."""
        pool_cls = pgb_module.FixedPoolAllocator
        pipe_cls = pgb_module.GradReducePipeline
        checker = self
        allocate, free = pool_cls.allocate, pool_cls.free
        reduce = pipe_cls._bucket_group_gradient_reduce

        @functools.wraps(allocate)
        def checked_allocate(pool: Any, bucket_id: int, *args: Any, **kwargs: Any) -> Any:
            had_slot = bucket_id in pool.using_buffer
            result = allocate(pool, bucket_id, *args, **kwargs)
            checker.after_allocate(pool, bucket_id, had_slot)
            return result

        @functools.wraps(free)
        def checked_free(pool: Any, bucket_id: int, *args: Any, **kwargs: Any) -> Any:
            slot = checker.before_free(pool, bucket_id)
            result = free(pool, bucket_id, *args, **kwargs)
            checker.after_free(pool, bucket_id, slot)
            return result

        @functools.wraps(reduce)
        def observed_reduce(pipeline: Any, bucket_group: list[int], *args: Any,
                            **kwargs: Any) -> Any:
            result = reduce(pipeline, bucket_group, *args, **kwargs)
            checker.after_reduce(pipeline, list(bucket_group))
            return result

        pool_cls.allocate = checked_allocate
        pool_cls.free = checked_free
        pipe_cls._bucket_group_gradient_reduce = observed_reduce


def _is_grad_pool(pool: Any) -> bool:
    return "grad" in str(getattr(pool, "name", ""))
