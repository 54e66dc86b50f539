"""The vector-clock model shared by the CPU stand-in and the audit."""

from __future__ import annotations

from mfsdp_hotfix.happens_before import Timeline


def test_a_stream_is_ordered_after_its_own_marks_only_others_after_a_wait() -> None:
    t = Timeline()
    mark = t.record("rs")
    assert t.ordered("rs", mark)
    assert not t.ordered("compute", mark)
    t.wait("compute", mark)
    assert t.ordered("compute", mark)


def test_a_wait_covers_earlier_marks_not_later_ones() -> None:
    t = Timeline()
    first = t.record("rs")
    t.wait("compute", first)
    later = t.record("rs")
    assert t.ordered("compute", first) and not t.ordered("compute", later)


def test_ordering_is_transitive_through_marks_and_wait_stream() -> None:
    t = Timeline()
    mark = t.record("rs")
    t.wait("side", mark)
    assert not t.ordered("compute", mark)
    t.wait("compute", t.record("side"))  # compute after side after rs
    assert t.ordered("compute", mark)
    other = t.record("rs")
    t.wait_stream("copy", "rs")  # everything on rs so far
    assert t.ordered("copy", other)
    t.wait_stream("copy", "copy")  # a stream waiting on itself changes nothing
    assert t.clock_of("copy") == {"rs": 3}


def test_host_synchronisation_orders_later_work_on_every_stream() -> None:
    t = Timeline()
    mark = t.record("rs")
    t.host_waited(mark)
    assert t.ordered("compute", mark)
    later = t.record("rs")
    assert not t.ordered("compute", later)
    t.host_waited_stream("rs")
    assert t.ordered("compute", later)
    last = t.record("ag")
    t.host_waited_all()
    assert t.ordered("compute", last)
    assert set(t.streams()) == {"rs", "ag"}
