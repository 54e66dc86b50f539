"""The slot-reuse rule of the gradient double buffer, observed on a release's own classes.

Why: the defect the hotfix repairs is an ordering defect. A gradient pool slot is handed to the
next bucket while the reduce-scatter (RS) that last read it may still be running, and the stream
that will write into it never waited for that RS. The rule, checked for every slot of every
gradient pool (``gradient_pools.GRAD_POOLS``) of every pool allocator class the copy has
(``gradient_pools.POOL_ALLOCATORS``: ``FixedPoolAllocator``, ``MaxPoolAllocator``): when the pool
hands out a slot again, the stream current at that moment (the writer) must already be ordered
after the last RS that used the slot, identified by the event queued with that bucket in
``GradReducePipeline.grad_reduce_queue``. Otherwise the reuse is *unordered*. It is a rule, not a
timing, so a race that did not fire is still found.

A slot is the memory a bucket gets: a pool slot (``using_buffer``), or, for a unit the pool does
not fit, what the pool delegates to: the bucket's own storage in the pool's ``backup_allocator``
(freed by a storage resize, regrown at the next fetch) or its persistent buffer
(``fsdp_db_use_persist_buf_on_alloc_fail=True``: never freed, rewritten at the next fetch). A
bucket holds its slot from ``allocate`` until ``free`` as the wrappers see them.

The rule does not know how ordering is known: a :class:`Clocks` answers that (the CPU stand-in's
own clocks for the selftest's checker, the audit's independent observer on a GPU). ``observe``
wraps each pool allocator's ``allocate``/``free``, ``GradReducePipeline
._bucket_group_gradient_reduce`` and ``GradReducePipeline.__init__`` (to list the gradient pools a
model built, and any built from a class the rule does not know); the wrappers call the original
and return its result unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any, Generic, Protocol, TypeVar

from . import gradient_pools
from .patching import Undo, Wrapper, wrap_attributes

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
    # gradient pools the models built: "name (Class)" -> reuses judged in it, and those unordered
    pools: dict[str, int] = field(default_factory=dict)
    pools_unordered: dict[str, int] = field(default_factory=dict)
    # gradient pools built from a class the rule does not watch: "name (Class)"
    unwatched: list[str] = field(default_factory=list)
    # (id(param_groups), bucket_id) -> mark of that bucket's latest queued RS since it got its
    # slot (None: its event was never seen recorded)
    _bucket_rs: dict[tuple[int, int], M | None] = field(default_factory=dict)
    # (id(allocator), slot) -> (mark of the last RS that read the slot, bucket that owned it)
    _slot_reader: dict[tuple[int, Any], tuple[M | None, int]] = field(default_factory=dict)
    # (id(allocator), bucket_id) -> the slot that bucket holds now
    _held: dict[tuple[int, int], Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {"reuses": self.reuses, "unordered": self.unordered_count,
                "unseen": self.unseen, "first_unordered": [asdict(u) for u in self.unordered],
                "grad_pools": dict(self.pools), "unwatched_pools": list(self.unwatched),
                "grad_pools_unordered": dict(self.pools_unordered)}

    # ---- what the wrappers report
    def reduced(self, pipeline: Any, bucket_group: list[int]) -> None:
        """After an RS: remember the event queued with each bucket. A synchronous RS queues
        nothing; it waits and frees its buckets inside the call."""
        groups = id(pipeline.buffer.parameter_groups)
        queued = {entry[-1]: entry[0] for entry in pipeline.grad_reduce_queue}
        for bucket_id in bucket_group:
            if bucket_id in queued:
                self._bucket_rs[(groups, bucket_id)] = self.clocks.mark_of(queued[bucket_id])

    def built(self, pipeline: Any, watched: tuple[type, ...]) -> None:
        """A model's pipeline was built: list its gradient pools, and those the rule cannot
        watch (a pool class it does not know)."""
        buffer = pipeline.buffer
        for attribute in gradient_pools.GRAD_POOL_ATTRIBUTES:
            pool = getattr(buffer, attribute, None)
            if pool is None:
                continue
            label = pool_label(pool)
            if isinstance(pool, watched) and is_grad_pool(pool):
                self.pools.setdefault(label, 0)
            elif label not in self.unwatched:
                self.unwatched.append(label)

    def freed(self, pool: Any, bucket_id: int) -> None:
        """After ``free``: the slot the bucket held now has that bucket's last RS as reader."""
        slot = self._held.pop((id(pool), bucket_id), None)
        if slot is None:
            return
        bucket = (id(pool.fsdp_param_groups), bucket_id)
        key = (id(pool), slot)
        if bucket in self._bucket_rs:  # several pools (HSDP's) may free the same bucket
            self._slot_reader[key] = (self._bucket_rs[bucket], bucket_id)
        else:  # no RS read the slot since the bucket got it
            self._slot_reader.pop(key, None)

    def allocated(self, pool: Any, bucket_id: int, had_slot: bool) -> None:
        if had_slot:
            return
        slot = slot_of(pool, bucket_id)
        if slot is None:
            return
        self._held[(id(pool), bucket_id)] = slot
        self._bucket_rs.pop((id(pool.fsdp_param_groups), bucket_id), None)
        reader = self._slot_reader.pop((id(pool), slot), None)
        if reader is None:
            return
        mark, previous = reader
        if mark is None:
            self.unseen += 1
            return
        self.reuses += 1
        label = pool_label(pool, slot)
        self.pools[label] = self.pools.get(label, 0) + 1
        ordered, writer = self.clocks.writer_after(mark)
        if not ordered:
            self.unordered_count += 1
            self.pools_unordered[label] = self.pools_unordered.get(label, 0) + 1
            if len(self.unordered) < self.keep:
                self.unordered.append(Unordered(
                    pool=str(pool.name), slot=repr(slot), previous_bucket=previous,
                    new_bucket=bucket_id, rs_event=self.clocks.describe(mark), writer=writer))

    def holds(self, pool: Any, bucket_id: int) -> bool:
        return (id(pool), bucket_id) in self._held

    def crashed(self, pool: Any, bucket_id: int, exc: BaseException) -> None:
        if self.crash is None:
            self.crash = {"pool": str(getattr(pool, "name", "?")), "bucket": bucket_id,
                          "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
                          if str(exc).strip() else type(exc).__name__}


def _observed(exc: BaseException, where: str, marker: str) -> None:
    """Say under the traceback whose error it is: the observer's frames sit between the
    caller and the release's code, and a user would otherwise file the release's crash against
    the hotfix (Python 3.11+ prints ``__notes__``; on 3.10 this is unseen and harmless)."""
    exc.__notes__ = [*getattr(exc, "__notes__", ()), (
        f"mfsdp_hotfix: this error was raised by Megatron-FSDP's own {where} (the release's "
        "code). The frames of mfsdp_hotfix/patching.py and mfsdp_hotfix/slot_reuse.py above are "
        f"{_OBSERVERS.get(marker, marker)}, which watches the gradient pool, calls that code "
        "unchanged and passes its errors on.")]


# Who observes the pool, by the marker its wrappers carry, in the note above.
_OBSERVERS = {"audit": "the on-the-job audit (MFSDP_HOTFIX_AUDIT)",
              "selftest-ordering": "the selftest's ordering check"}


def is_grad_pool(pool: Any) -> bool:
    return str(getattr(pool, "name", "")) in gradient_pools.GRAD_POOLS


def pool_label(pool: Any, slot: Any = None) -> str:
    """``fsdp_grads (MaxPoolAllocator)``; a fallback slot: ``fsdp_grads (FixedPoolAllocator,
    fallback)`` or ``(..., persistent)``."""
    kind = slot[0] if isinstance(slot, tuple) and slot[:1] in (("fallback",),
                                                               ("persistent",)) else None
    return f"{getattr(pool, 'name', '?')} ({type(pool).__name__}{', ' + kind if kind else ''})"


def slot_of(pool: Any, bucket_id: int) -> Any:
    """The memory ``bucket_id`` got from ``pool`` in the allocation just made (None: none that
    the rule follows, e.g. not a gradient pool)."""
    if not is_grad_pool(pool):
        return None
    using = getattr(pool, "using_buffer", {})
    if bucket_id in using:
        return using[bucket_id]
    if getattr(pool, "fallback_to_persistent_buffer", False) is True:
        return ("persistent", bucket_id)
    backup = getattr(pool, "backup_allocator", None)
    if bucket_id in getattr(backup, "buckets", {}):
        return ("fallback", bucket_id)
    return None


def watchable(buffer_module: ModuleType) -> tuple[list[gradient_pools.PoolAllocator], list[str]]:
    """The pool allocators of ``buffer_module`` the rule can watch, and what is missing for the
    others and for the pipeline (``Class.method`` names)."""
    found, missing = [], []
    for spec in gradient_pools.POOL_ALLOCATORS:
        cls = getattr(buffer_module, spec.cls, None)
        if cls is None:
            continue
        lacking = [f"{spec.cls}.{name}" for name in (spec.allocate, spec.free)
                   if name not in cls.__dict__]
        if lacking:
            missing += lacking
        else:
            found.append(spec)
    pipe = getattr(buffer_module, "GradReducePipeline", None)
    missing += [f"GradReducePipeline.{name}"
                for name in ("__init__", "_bucket_group_gradient_reduce")
                if name not in getattr(pipe, "__dict__", {})]
    return found, missing


def observe(buffer_module: ModuleType, rule: SlotReuse[Any], marker: str,
            on_error: Callable[[str, Exception], None]) -> Undo:
    """Wrap one copy's pool allocator classes and pipeline so that ``rule`` sees every slot move.

    Every class of ``gradient_pools.POOL_ALLOCATORS`` present with its two methods is wrapped (none
    present: ``LookupError``). The original always runs, once, and its result or exception
    passes through unchanged. A failure of the bookkeeping goes to ``on_error(where, exc)``
    (which may raise); an ``AssertionError`` of ``allocate`` itself (era A's 'No buffer found')
    is recorded as the rule's crash, then re-raised.
    """
    allocators = _watched_allocators(buffer_module)
    pipe_cls = buffer_module.GradReducePipeline
    watched = tuple(getattr(buffer_module, spec.cls) for spec in allocators)
    wrappers = _RuleWrappers(rule, marker, on_error, watched)
    targets: list[tuple[type, str, Wrapper]] = [
        (pipe_cls, "_bucket_group_gradient_reduce", wrappers.reduce),
        (pipe_cls, "__init__", wrappers.init)]
    for spec, cls in zip(allocators, watched, strict=True):
        targets += [(cls, spec.allocate, wrappers.allocate_of(spec.cls)),
                    (cls, spec.free, wrappers.free_of(spec.cls))]
    return wrap_attributes(targets, marker)


def _watched_allocators(buffer_module: ModuleType) -> list[gradient_pools.PoolAllocator]:
    """The pool allocators :func:`observe` wraps; ``LookupError`` where there is none, or the
    pipeline lacks a method the rule follows (without it no slot move could be judged)."""
    allocators, missing = watchable(buffer_module)
    if not allocators or any(m.startswith("GradReducePipeline.") for m in missing):
        raise LookupError("nothing the slot-reuse rule can watch: "
                          + (", ".join(missing) or "no pool allocator class it knows")
                          + " missing")
    return allocators


@dataclass
class _RuleWrappers:
    """The wrappers :func:`observe` installs, telling ``rule`` each slot move: each calls the
    original once and passes its result or exception on unchanged."""

    rule: SlotReuse[Any]
    marker: str
    on_error: Callable[[str, Exception], None]
    watched: tuple[type, ...]  # the pool allocator classes wrapped

    def guarded(self, where: str, step: Callable[..., Any], *args: Any) -> Any:
        try:
            return step(*args)
        except Exception as exc:
            self.on_error(where, exc)
            return None

    def allocate_of(self, cls: str) -> Wrapper:
        where = f"{cls}.allocate"

        def allocate(wrapped: Any, pool: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                     ) -> Any:
            if not self.rule.active:
                return wrapped(*args, **kwargs)
            bucket_id = args[0] if args else kwargs.get("bucket_id")
            had_slot = self.guarded(where, self.rule.holds, pool, bucket_id)
            try:
                result = wrapped(*args, **kwargs)
            except AssertionError as exc:
                self.guarded(where, self.rule.crashed, pool, bucket_id, exc)
                _observed(exc, where, self.marker)
                raise
            if had_slot is not None and self.rule.active:
                self.guarded(where, self.rule.allocated, pool, bucket_id, had_slot)
            return result

        return allocate

    def free_of(self, cls: str) -> Wrapper:
        where = f"{cls}.free"

        def free(wrapped: Any, pool: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            result = wrapped(*args, **kwargs)
            if self.rule.active:
                bucket_id = args[0] if args else kwargs.get("bucket_id")
                self.guarded(where, self.rule.freed, pool, bucket_id)
            return result

        return free

    def reduce(self, wrapped: Any, pipeline: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> Any:
        result = wrapped(*args, **kwargs)
        if not self.rule.active:
            return result
        group = args[0] if args else kwargs.get("bucket_group")
        self.guarded("GradReducePipeline._bucket_group_gradient_reduce", self.rule.reduced,
                     pipeline, list(group or ()))
        return result

    def init(self, wrapped: Any, pipeline: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> Any:
        result = wrapped(*args, **kwargs)
        if self.rule.active:
            self.guarded("GradReducePipeline.__init__", self.rule.built, pipeline, self.watched)
        return result
