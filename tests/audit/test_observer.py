"""The audit's observer on the CPU stand-in's classes (instrumented in this process, restored
after each test) and a miniature ``torch.distributed``: what it models, and that it only watches."""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest
from miniature import backward, miniature

from mfsdp_hotfix import slot_reuse
from mfsdp_hotfix.audit.observer import Observer, stream_key, stream_name
from mfsdp_hotfix.selftest import cuda_standin as cs
from mfsdp_hotfix.selftest.ordering import OrderingChecker
from mfsdp_hotfix.slot_reuse import SlotReuse


class Work:
    """A work handle like c10d's: ``wait()`` returns True."""

    waited = 0

    def wait(self, timeout: Any = None) -> bool:
        Work.waited += 1
        return True


class CoalescingManager:
    def __init__(self) -> None:
        self.works: list[Work] = []

    def append(self, work: Work | None = None) -> None:
        if work:
            self.works.append(work)


def _dist() -> types.ModuleType:
    dist = types.ModuleType("fake_dist")

    def all_reduce(tensor: Any, async_op: bool = False) -> Work | None:
        return Work() if async_op else None

    dist.all_reduce = all_reduce  # type: ignore[attr-defined]
    dist.Work = Work  # type: ignore[attr-defined]
    dist.distributed_c10d = types.SimpleNamespace(  # type: ignore[attr-defined]
        _CoalescingManager=CoalescingManager)
    return dist


@pytest.fixture
def watched() -> Iterator[tuple[Observer, list[tuple[str, Exception]], types.ModuleType]]:
    errors: list[tuple[str, Exception]] = []
    observer = Observer(lambda where, exc: errors.append((where, exc)))
    dist = _dist()
    originals = _methods()
    observer.instrument(cs, dist)  # type: ignore[arg-type]
    assert _methods() != originals
    yield observer, errors, dist
    assert observer.uninstrument() is True
    assert _methods() == originals


def _methods() -> list[Any]:
    return [{k: v for k, v in vars(cls).items() if callable(v)} for cls in (cs.Event, cs.Stream)
            ] + [cs.synchronize]


def test_writer_is_unordered_until_it_waits_on_the_current_stream(watched: Any) -> None:
    observer, errors, _ = watched
    rs = cs.Stream(name="rs")
    event = rs.record_event()
    mark = observer.mark_of(event)
    assert mark is not None
    assert observer.writer_after(mark) == (False, "default stream")
    with cs.stream(rs):
        event.wait()  # rs waits on itself: orders nothing for the writer
    assert not observer.writer_after(mark)[0]
    event.wait()  # on the current (default) stream
    assert observer.writer_after(mark)[0] and errors == []


def test_wait_stream_is_modelled_once_and_is_transitive(watched: Any) -> None:
    observer, _, _ = watched
    rs, side = cs.Stream(), cs.Stream()
    mark = observer.mark_of(rs.record_event())
    before = observer.operations
    side.wait_stream(rs)  # calls record_event and wait_event inside
    assert observer.operations == before + 1
    cs.default_stream().wait_event(side.record_event())
    assert observer.writer_after(mark)[0]


@pytest.mark.parametrize("sync", ["device", "stream", "event", "event query", "stream query"])
def test_host_synchronisation(watched: Any, sync: str) -> None:
    observer, _, _ = watched
    rs = cs.Stream()
    event = rs.record_event()
    mark = observer.mark_of(event)
    assert not observer.writer_after(mark)[0]
    {"device": cs.synchronize, "stream": rs.synchronize, "event": event.synchronize,
     "event query": event.query, "stream query": rs.query}[sync]()
    assert observer.writer_after(mark)[0]


@pytest.mark.parametrize("coalesced", [False, True])
def test_an_async_collective_orders_the_stream_that_waits_on_its_work(watched: Any,
                                                                      coalesced: bool) -> None:
    observer, _, dist = watched
    side = cs.Stream()
    mark = observer.mark_of(side.record_event())
    with cs.stream(side):
        if coalesced:
            manager = dist.distributed_c10d._CoalescingManager()
            manager.append(Work())
            work = manager.works[0]
        else:
            work = dist.all_reduce(None, async_op=True)
    assert dist.all_reduce(None) is None  # a synchronous collective returns nothing
    assert not observer.writer_after(mark)[0]
    assert work.wait() is True  # the original's result passes through
    assert observer.writer_after(mark)[0]


def test_results_and_exceptions_pass_through_and_a_bookkeeping_error_is_reported(
        watched: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    observer, errors, _ = watched
    rs = cs.Stream()
    given = cs.Event()
    assert rs.record_event(given) is given
    with pytest.raises(AttributeError):
        rs.wait_stream(None)  # the stand-in's own error, unchanged
    monkeypatch.setattr(observer.timeline, "record", lambda key: 1 / 0)
    event = rs.record_event()  # the original ran and returned its event
    assert isinstance(event, cs.Event) and event.recorded
    assert [type(exc) for _, exc in errors] == [ZeroDivisionError]


def test_stream_keys_name_the_stream_not_the_python_object() -> None:
    a = types.SimpleNamespace(device_index=0, cuda_stream=0x7F00)
    b = types.SimpleNamespace(device_index=0, cuda_stream=0x7F00)
    assert stream_key(a) == stream_key(b) == (0, 0x7F00)
    assert stream_name(stream_key(a)) == "stream 0x7f00 on cuda:0"
    assert stream_name((1, 0)) == "default stream on cuda:1"


@pytest.mark.parametrize("drain_on_rs_stream", [True, False])
def test_audit_counts_equal_the_stand_in_checker_on_the_miniature(
        watched: Any, drain_on_rs_stream: bool) -> None:
    observer, errors, _ = watched
    checker = OrderingChecker()
    audit = SlotReuse(observer)

    def observe(module: types.ModuleType) -> None:
        checker.install(module)
        slot_reuse.observe(module, audit, "audit", lambda where, exc: errors.append((where, exc)))

    backward(observe, drain_on_rs_stream)
    assert (audit.reuses, audit.unordered_count) == (checker.checks, len(checker.violations))
    assert audit.reuses == 3
    assert audit.unordered_count == (3 if drain_on_rs_stream else 0)
    assert errors == []


def test_a_copy_without_hooks_the_audit_needs_is_listed_unwatched_with_the_reason() -> None:
    from mfsdp_hotfix import registry
    from mfsdp_hotfix.audit.copies import watch_buffer_module
    from mfsdp_hotfix.audit.verdicts import copy_verdict

    copy = registry.COPIES[0]
    bare = miniature()
    del bare.FixedPoolAllocator, bare.MaxPoolAllocator
    audit = watch_buffer_module(copy, bare, Observer(_raise), _raise)
    found = audit.as_dict([])
    assert found["audited"] is False and found["grad_pools"] is None
    verdict, why = copy_verdict(found)
    assert verdict == "UNWATCHED" and why is not None
    assert "no pool allocator class the audit knows (FixedPoolAllocator, MaxPoolAllocator)" in why

    partial = miniature()
    del partial.MaxPoolAllocator.free  # a known class in a shape the audit cannot wrap
    audit = watch_buffer_module(copy, partial, Observer(_raise), _raise)
    assert audit.watched == ["FixedPoolAllocator"] and audit.rule is not None
    assert "MaxPoolAllocator.free not found: pools of that class are not watched" in (
        audit.note or "")
    assert all(undo() for undo in audit.undo)


def _raise(where: str, exc: Exception) -> None:
    raise exc
