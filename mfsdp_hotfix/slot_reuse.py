"""The slot-reuse rule of the gradient double buffer, observed on a release's own classes.

Why: the defect the hotfix repairs is an ordering defect. A gradient pool slot is handed to the
next bucket while the reduce-scatter (RS) that last read it may still be running, and the stream
that will write into it never waited for that RS. The rule, checked for every slot of every
gradient ``FixedPoolAllocator``: when the pool hands out a slot again, the stream current at that
moment (the writer) must already be ordered after the last RS that used the slot, identified by
the event queued with that bucket in ``GradReducePipeline.grad_reduce_queue``. Otherwise the
reuse is *unordered*. It is a rule, not a timing, so a race that did not fire is still found.

The rule does not know how ordering is known: a :class:`Clocks` answers that (the CPU stand-in's
own clocks for the selftest's checker, the audit's independent observer on a GPU). ``observe``
wraps ``FixedPoolAllocator.allocate``/``free`` and ``GradReducePipeline
._bucket_group_gradient_reduce``; the wrappers call the original and return its result unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any, Generic, Protocol, TypeVar

from .patching import Undo, wrap_attribute

M = TypeVar("M")


class Clocks(Protocol[M]):
    """How one observer knows ordering; ``M`` is its handle for a recorded RS event."""

    def mark_of(self, event: object) -> M | None:
        """The mark of an event found in the reduce-scatter queue (None: not one we know)."""

    def writer_after(self, mark: M) -> tuple[bool, str]:
        """Whether the current stream is ordered after ``mark``, and its name."""

    def describe(self, mark: M) -> str:
        """A short name for ``mark`` in reports."""


@dataclass
class Unordered:
    """One slot handed to a new bucket before its writer was ordered after the slot's last RS."""

    pool: str
    slot: str
    previous_bucket: int
    new_bucket: int
    rs_event: str
    writer: str


@dataclass
class SlotReuse(Generic[M]):
    """Counts slot reuses of gradient pools and those that are unordered."""

    clocks: Clocks[M]
    reuses: int = 0
    unseen: int = 0  # reuses after an RS whose event this observer never saw recorded
    unordered: list[Unordered] = field(default_factory=list)
    unordered_count: int = 0
    crash: dict[str, Any] | None = None
    active: bool = True  # False: the wrappers only call the originals
    keep: int = 5  # unordered reuses kept in full
    # (id(param_groups), bucket_id) -> mark of that bucket's latest queued RS since it got its
    # slot (None: its event was never seen recorded)
    _bucket_rs: dict[tuple[int, int], M | None] = field(default_factory=dict)
    # (id(allocator), slot) -> (mark of the last RS that read the slot, bucket that owned it)
    _slot_reader: dict[tuple[int, Any], tuple[M | None, int]] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {"reuses": self.reuses, "unordered": self.unordered_count,
                "unseen": self.unseen, "first_unordered": [asdict(u) for u in self.unordered]}

    # ---- what the wrappers report
    def reduced(self, pipeline: Any, bucket_group: list[int]) -> None:
        """After an RS: remember the event queued with each bucket. A synchronous RS queues
        nothing; it waits and frees its buckets inside the call."""
        groups = id(pipeline.buffer.parameter_groups)
        queued = {entry[-1]: entry[0] for entry in pipeline.grad_reduce_queue}
        for bucket_id in bucket_group:
            if bucket_id in queued:
                self._bucket_rs[(groups, bucket_id)] = self.clocks.mark_of(queued[bucket_id])

    def freeing(self, pool: Any, bucket_id: int) -> Any:
        return pool.using_buffer.get(bucket_id) if is_grad_pool(pool) else None

    def freed(self, pool: Any, bucket_id: int, slot: Any) -> None:
        if slot is None or bucket_id in pool.using_buffer:
            return
        bucket = (id(pool.fsdp_param_groups), bucket_id)
        key = (id(pool), slot)
        if bucket in self._bucket_rs:
            self._slot_reader[key] = (self._bucket_rs.pop(bucket), bucket_id)
        else:  # no RS read the slot since the bucket got it
            self._slot_reader.pop(key, None)

    def allocated(self, pool: Any, bucket_id: int, had_slot: bool) -> None:
        if had_slot or not is_grad_pool(pool) or bucket_id not in pool.using_buffer:
            return
        self._bucket_rs.pop((id(pool.fsdp_param_groups), bucket_id), None)
        slot = pool.using_buffer[bucket_id]
        reader = self._slot_reader.pop((id(pool), slot), None)
        if reader is None:
            return
        mark, previous = reader
        if mark is None:
            self.unseen += 1
            return
        self.reuses += 1
        ordered, writer = self.clocks.writer_after(mark)
        if not ordered:
            self.unordered_count += 1
            if len(self.unordered) < self.keep:
                self.unordered.append(Unordered(
                    pool=str(pool.name), slot=repr(slot), previous_bucket=previous,
                    new_bucket=bucket_id, rs_event=self.clocks.describe(mark), writer=writer))

    def crashed(self, pool: Any, bucket_id: int, exc: BaseException) -> None:
        if self.crash is None:
            self.crash = {"pool": str(getattr(pool, "name", "?")), "bucket": bucket_id,
                          "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
                          if str(exc).strip() else type(exc).__name__}


def is_grad_pool(pool: Any) -> bool:
    return "grad" in str(getattr(pool, "name", ""))


def observe(buffer_module: ModuleType, rule: SlotReuse[Any], marker: str,
            on_error: Callable[[str, Exception], None]) -> Undo:
    """Wrap one copy's pool and pipeline classes so that ``rule`` sees every slot move.

    The original always runs, once, and its result or exception passes through unchanged. A
    failure of the bookkeeping goes to ``on_error(where, exc)`` (which may raise); an
    ``AssertionError`` of ``allocate`` itself (era A's 'No buffer found') is recorded as the
    rule's crash, then re-raised.
    """
    pool_cls = buffer_module.FixedPoolAllocator
    pipe_cls = buffer_module.GradReducePipeline

    def guarded(where: str, step: Callable[..., Any], *args: Any) -> Any:
        try:
            return step(*args)
        except Exception as exc:
            on_error(where, exc)
            return None

    def allocate(wrapped: Any, pool: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not rule.active:
            return wrapped(*args, **kwargs)
        bucket_id = args[0] if args else kwargs.get("bucket_id")
        had_slot = guarded("FixedPoolAllocator.allocate", _has_slot, pool, bucket_id)
        try:
            result = wrapped(*args, **kwargs)
        except AssertionError as exc:
            guarded("FixedPoolAllocator.allocate", rule.crashed, pool, bucket_id, exc)
            raise
        if had_slot is not None and rule.active:
            guarded("FixedPoolAllocator.allocate", rule.allocated, pool, bucket_id, had_slot)
        return result

    def free(wrapped: Any, pool: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not rule.active:
            return wrapped(*args, **kwargs)
        bucket_id = args[0] if args else kwargs.get("bucket_id")
        slot = guarded("FixedPoolAllocator.free", rule.freeing, pool, bucket_id)
        result = wrapped(*args, **kwargs)
        if rule.active:
            guarded("FixedPoolAllocator.free", rule.freed, pool, bucket_id, slot)
        return result

    def reduce(wrapped: Any, pipeline: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> Any:
        result = wrapped(*args, **kwargs)
        if not rule.active:
            return result
        group = args[0] if args else kwargs.get("bucket_group")
        guarded("GradReducePipeline._bucket_group_gradient_reduce", rule.reduced, pipeline,
                list(group or ()))
        return result

    undos: list[Undo] = []
    try:
        for owner, name, wrapper in ((pool_cls, "allocate", allocate), (pool_cls, "free", free),
                                     (pipe_cls, "_bucket_group_gradient_reduce", reduce)):
            undos.append(wrap_attribute(owner, name, wrapper, marker))
    except Exception:
        for done in undos:
            done()
        raise

    def undo() -> bool:
        return all([u() for u in undos])

    return undo


def _has_slot(pool: Any, bucket_id: int) -> bool:
    return bucket_id in pool.using_buffer
