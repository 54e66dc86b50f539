"""A ``torch.cuda`` stand-in for CPU runs of real Megatron-FSDP, with happens-before bookkeeping.

Why: on CPU every collective is synchronous, so the stream race the hotfix repairs cannot
*happen*; it can still be *detected*.  Streams and events here do nothing to the computation,
but they keep vector clocks (``mfsdp_hotfix.happens_before``, the model the audit uses too), so
that "has stream W already waited (directly or transitively) for event E?" can be answered
exactly as CUDA would order it.

Semantics kept from CUDA:
* the current stream is thread-local; ``stream(s)`` switches it, ``current_stream()`` reads it;
* ``Event.record()`` captures the recording stream and everything that stream already waited on;
* ``Stream.wait_event(e)`` / ``Event.wait()`` (on the *current* stream) make a stream wait for
  ``e``; ``Stream.wait_stream(o)`` waits for all work enqueued on ``o`` so far;
* host synchronisation (``synchronize``) orders everything enqueued afterwards.

``install()`` replaces attributes of ``torch.cuda`` (and ``torch.Tensor.cuda``); it is meant for
the harness' worker processes only.  The classes work without installing, for unit tests.
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from mfsdp_hotfix.errors import AuditArmedFirst as AuditArmedFirst
from mfsdp_hotfix.happens_before import Mark, Timeline

_stream_ids = itertools.count(0)

# The stand-in's own clocks (the audit keeps a separate Timeline of what it observes).
TIMELINE = Timeline()


class Event:
    """A recorded point on one stream (its :class:`Mark` carries what that stream had waited on)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False, **_: Any) -> None:
        self.stream: Stream | None = None
        self.mark: Mark | None = None

    @property
    def recorded(self) -> bool:
        return self.mark is not None

    @property
    def position(self) -> int:
        return self.mark.position if self.mark is not None else -1

    def record(self, stream: Stream | None = None) -> None:
        target = stream if stream is not None else current_stream()
        self.stream = target
        self.mark = TIMELINE.record(target.stream_id)

    def wait(self, stream: Stream | None = None) -> None:
        (stream if stream is not None else current_stream()).wait_event(self)

    def synchronize(self) -> None:
        if self.mark is not None:
            TIMELINE.host_waited(self.mark)

    def query(self) -> bool:
        # On CPU the work is already done; a True answer lets the host act on it.
        self.synchronize()
        return True

    def elapsed_time(self, end_event: Event) -> float:
        return 0.0

    def __repr__(self) -> str:
        name = self.stream.name if self.stream is not None else "unrecorded"
        return f"<Event {name}@{self.position}>"


class Stream:
    """A stream that orders nothing but knows, per other stream, how far it has waited."""

    def __init__(self, device: Any = None, priority: int = 0, name: str | None = None,
                 **_: Any) -> None:
        self.stream_id = next(_stream_ids)
        self.name = name or f"stream{self.stream_id}"
        self.waited: list[Event] = []
        self.priority = priority
        _known.append(self)

    # ---- ordering
    def wait_event(self, event: Event | None = None) -> None:
        if event is None or event.mark is None:
            return  # CUDA: waiting on an unrecorded event is a no-op
        self.waited.append(event)
        TIMELINE.wait(self.stream_id, event.mark)

    def wait_stream(self, stream: Stream) -> None:
        if stream is self:
            return
        self.wait_event(stream.record_event())

    def record_event(self, event: Event | None = None) -> Event:
        target = event if event is not None else Event()
        target.record(self)
        return target

    def synchronize(self) -> None:
        TIMELINE.host_waited_stream(self.stream_id)

    def query(self) -> bool:
        self.synchronize()
        return True

    # ---- queries used by the ordering checker
    def has_waited_for(self, event: Event) -> bool:
        """True when work enqueued on this stream now is ordered after ``event``."""
        if event.mark is None or event.stream is self:
            return True
        return TIMELINE.ordered(self.stream_id, event.mark)

    # ---- odds and ends some code touches
    @property
    def cuda_stream(self) -> int:
        return self.stream_id

    @property
    def device(self) -> str:
        return "cpu"

    def __repr__(self) -> str:
        return f"<Stream {self.name}>"


_known: list[Stream] = []
_DEFAULT = Stream(name="default")
_local = threading.local()


def default_stream(device: Any = None) -> Stream:
    return _DEFAULT


def current_stream(device: Any = None) -> Stream:
    stack: list[Stream] = getattr(_local, "stack", [])
    return stack[-1] if stack else _DEFAULT


@contextmanager
def stream(target: Stream | None) -> Iterator[Stream | None]:
    """Make ``target`` the thread's current stream for the block (``None``: no change)."""
    if target is None:
        yield None
        return
    stack: list[Stream] = getattr(_local, "stack", None) or []
    _local.stack = stack
    stack.append(target)
    try:
        yield target
    finally:
        stack.pop()


def set_stream(target: Stream) -> None:
    stack: list[Stream] = getattr(_local, "stack", None) or []
    _local.stack = stack
    if stack:
        stack[-1] = target
    else:
        stack.append(target)


def synchronize(device: Any = None) -> None:
    for known in _known:
        known.synchronize()


class CpuDeviceIndex(str):
    """``torch.cuda.current_device()`` stand-in: used as a device it is "cpu", formatted it is "0".

    Megatron-FSDP both allocates with ``device=torch.cuda.current_device()`` and builds
    ``f"cuda:{torch.cuda.current_device()}"``; this one value serves both.
    """

    def __new__(cls) -> CpuDeviceIndex:
        return super().__new__(cls, "cpu")

    def __format__(self, spec: str) -> str:
        return format(0, spec)

    def __int__(self) -> int:
        return 0

    def __index__(self) -> int:
        return 0


def install() -> Callable[[], None]:
    """Put the stand-in into ``torch.cuda``; returns a function that undoes it.

    It must come before anything looks up ``megatron`` or ``megatron_fsdp`` (even
    ``importlib.util.find_spec``): that fires the hotfix's import trigger, which arms the audit
    (``MFSDP_HOTFIX_AUDIT``), and the audit instruments whatever ``torch.cuda`` holds at that
    moment. Installed afterwards, the stand-in's streams and events would go unobserved and the
    audit would count nothing, so this refuses instead (:class:`AuditArmedFirst`).
    """
    audit = sys.modules.get("mfsdp_hotfix.audit")
    if audit is not None and audit.snapshot() is not None:
        raise AuditArmedFirst(
            "the torch.cuda stand-in must be installed before the on-the-job audit is armed: "
            "the audit (MFSDP_HOTFIX_AUDIT) already instruments the real torch.cuda and would "
            "not see the stand-in's streams and events; install the stand-in before anything "
            "imports or looks up megatron / megatron_fsdp")
    import torch

    cuda: Any = torch.cuda
    replacements: dict[str, Any] = {
        "Stream": Stream,
        "Event": Event,
        "current_stream": current_stream,
        "default_stream": default_stream,
        "stream": stream,
        "set_stream": set_stream,
        "synchronize": synchronize,
        "current_device": lambda: CpuDeviceIndex(),
    }
    saved = {name: getattr(cuda, name, None) for name in replacements}
    for name, value in replacements.items():
        setattr(cuda, name, value)
    saved_tensor_cuda = torch.Tensor.cuda

    def _identity(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self

    torch.Tensor.cuda = _identity  # type: ignore[method-assign]

    def undo() -> None:
        for name, value in saved.items():
            setattr(cuda, name, value)
        torch.Tensor.cuda = saved_tensor_cuda  # type: ignore[method-assign]

    return undo
