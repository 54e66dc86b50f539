"""The audit's observer: every ordering operation made through ``torch.cuda`` and
``torch.distributed``, kept in its own happens-before ``Timeline`` (``happens_before``).

Why an observer and not the library's own bookkeeping: the audit must judge the ordering that
CUDA will enforce, whatever code (release, fork, hotfix, user) made it. It wraps the API that is
present (real CUDA on a GPU, the CPU stand-in in the selftest) and models:

* ``Event.record`` / ``Stream.record_event``: a mark on the stream (the event's stream or the
  current one); ``Event.wait`` / ``Stream.wait_event`` / ``Stream.wait_stream``: a stream waits;
* host synchronisation: ``torch.cuda.synchronize``, ``Stream.synchronize``,
  ``Event.synchronize``, and a ``query()`` that answered True;
* collectives with NCCL semantics: a collective is ordered on the stream current when it is
  issued, as if enqueued there; an asynchronous one's ``Work.wait()`` makes the then-current
  stream wait for it.

Streams are keyed by their handle, ``(device index, cuda_stream)``: ``torch.cuda.current_stream()``
returns a new Python object at every call. Current-stream switches are read, not mirrored: the
current stream is asked for at each operation, which also covers switches made in C++ (the
autograd engine sets the stream of each backward node). Only the outermost of nested calls is
modelled (``Stream.wait_stream`` calls ``record_event`` and ``wait_event`` inside).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from types import ModuleType
from typing import Any

from ..happens_before import Mark, Timeline
from ..patching import Undo, wrap_attribute, wrap_function

MARKER = "audit"
StreamKey = tuple[Any, Any]
Step = Callable[[Any, tuple[Any, ...], dict[str, Any], Any], None]

# torch.distributed functions that can return a work handle (async_op=True)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast",
               "reduce", "gather", "scatter", "barrier")


def stream_key(stream: Any) -> StreamKey:
    """The identity of a stream, equal for every Python object of the same stream."""
    handle = getattr(stream, "cuda_stream", None)
    if handle is None:
        handle = ("id", getattr(stream, "stream_id", id(stream)))
    return getattr(stream, "device_index", None), handle


def stream_name(key: Hashable) -> str:
    device, handle = key if isinstance(key, tuple) and len(key) == 2 else (None, key)
    where = "" if device is None else f" on cuda:{device}"
    if handle == 0:
        return "default stream" + where
    if isinstance(handle, int):
        return f"stream 0x{handle:x}{where}"
    return f"stream {handle[-1] if isinstance(handle, tuple) else handle}{where}"


class Observer:
    """Keeps the timeline; answers the slot-reuse rule's questions (``slot_reuse.Clocks``)."""

    def __init__(self, on_error: Callable[[str, Exception], None]) -> None:
        self.timeline = Timeline()
        self.marks: weakref.WeakKeyDictionary[Any, Mark] = weakref.WeakKeyDictionary()
        self.active = True
        self.operations = 0
        self._on_error = on_error
        self._lock = threading.RLock()
        self._local = threading.local()
        self._cuda: Any = None
        self._undo: list[Undo] = []

    # ---- slot_reuse.Clocks
    def mark_of(self, event: object) -> Mark | None:
        try:
            return self.marks.get(event)
        except TypeError:  # not weak-referenceable: nothing we recorded
            return None

    def writer_after(self, mark: Mark) -> tuple[bool, str]:
        writer = self.current()
        with self._lock:
            return self.timeline.ordered(writer, mark), stream_name(writer)

    def describe(self, mark: Mark) -> str:
        return f"{stream_name(mark.stream)} @{mark.position}"

    def current(self) -> StreamKey:
        return stream_key(self._cuda.current_stream())

    # ---- instrumentation
    def instrument(self, cuda: ModuleType, dist: ModuleType | None) -> None:
        """Wrap what ``cuda`` (``torch.cuda`` or the stand-in in its place) and ``dist`` offer."""
        self._cuda = cuda
        event, stream = cuda.Event, cuda.Stream
        for owner, name, step in (
                (event, "record", self._event_record), (event, "wait", self._event_wait),
                (event, "synchronize", self._event_sync), (event, "query", self._event_query),
                (stream, "record_event", self._stream_record), (stream, "wait_event",
                                                                self._stream_wait_event),
                (stream, "wait_stream", self._stream_wait_stream),
                (stream, "synchronize", self._stream_sync), (stream, "query", self._stream_query)):
            if name in owner.__dict__:
                self._undo.append(wrap_attribute(owner, name, self._op(step), MARKER))
        self._undo.append(wrap_function(cuda, "synchronize", self._op(self._device_sync),
                                        MARKER))
        if dist is None:
            return
        for name in COLLECTIVES:
            if callable(getattr(dist, name, None)):
                self._undo.append(wrap_function(dist, name, self._op(self._issued), MARKER))
        c10d = getattr(dist, "distributed_c10d", None)
        manager = getattr(c10d, "_CoalescingManager", None)
        if manager is not None and "append" in manager.__dict__:
            self._undo.append(wrap_attribute(manager, "append", self._op(self._coalesced),
                                             MARKER))
        work = getattr(dist, "Work", None)
        if work is not None and "wait" in getattr(work, "__dict__", {}):
            self._undo.append(wrap_attribute(work, "wait", self._op(self._work_wait), MARKER,
                                             builtin=True))

    def uninstrument(self) -> bool:
        done = all([undo() for undo in reversed(self._undo)])
        self._undo.clear()
        return done

    def _op(self, step: Step) -> Any:
        """A wrapper: the original runs first and its result passes through; then, for the
        outermost call only, ``step`` updates the timeline."""
        local = self._local

        def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
            depth = getattr(local, "depth", 0)
            local.depth = depth + 1
            try:
                result = wrapped(*args, **kwargs)
            finally:
                local.depth = depth
            if depth == 0 and self.active:
                try:
                    with self._lock:
                        self.operations += 1
                        step(instance, args, kwargs, result)
                except Exception as exc:
                    self._on_error(getattr(wrapped, "__qualname__", repr(wrapped)), exc)
            return result

        return wrapper

    def _stream_arg(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> StreamKey:
        stream = args[0] if args else kwargs.get("stream")
        return stream_key(stream) if stream is not None else self.current()

    def _record(self, target: Any, key: StreamKey) -> Mark:
        mark = self.timeline.record(key)
        if target is not None:
            try:
                self.marks[target] = mark
            except TypeError:  # a handle that cannot be weakly referenced: never waited on
                pass
        return mark

    # ---- steps: (instance, args, kwargs, result)
    def _event_record(self, event: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                      result: Any) -> None:
        self._record(event, self._stream_arg(args, kwargs))

    def _stream_record(self, stream: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                       result: Any) -> None:
        self._record(result, stream_key(stream))

    def _event_wait(self, event: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                    result: Any) -> None:
        mark = self.mark_of(event)
        if mark is not None:
            self.timeline.wait(self._stream_arg(args, kwargs), mark)

    def _stream_wait_event(self, stream: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                           result: Any) -> None:
        mark = self.mark_of(args[0] if args else kwargs.get("event"))
        if mark is not None:
            self.timeline.wait(stream_key(stream), mark)

    def _stream_wait_stream(self, stream: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                            result: Any) -> None:
        waiter, other = stream_key(stream), stream_key(args[0] if args else kwargs["stream"])
        if waiter != other:
            self.timeline.wait(waiter, self._record(None, other))

    def _event_sync(self, event: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                    result: Any) -> None:
        mark = self.mark_of(event)
        if mark is not None:
            self.timeline.host_waited(mark)

    def _event_query(self, event: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                     result: Any) -> None:
        if result is True:
            self._event_sync(event, args, kwargs, result)

    def _stream_sync(self, stream: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                     result: Any) -> None:
        self.timeline.host_waited_stream(stream_key(stream))

    def _stream_query(self, stream: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                      result: Any) -> None:
        if result is True:
            self._stream_sync(stream, args, kwargs, result)

    def _device_sync(self, _: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                     result: Any) -> None:
        # Conservative on several devices: every stream seen is taken as complete only when
        # the call synchronised the device it is on (or no device could be told apart).
        device = _device_index(args[0] if args else kwargs.get("device"), self._cuda)
        for key in self.timeline.streams():
            if device is None or not isinstance(key, tuple) or key[0] in (None, device):
                self.timeline.host_waited_stream(key)

    def _issued(self, _: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                result: Any) -> None:
        if result is not None:  # an asynchronous collective's work handle
            self._record(result, self.current())

    def _coalesced(self, manager: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                   result: Any) -> None:
        work = args[0] if args else kwargs.get("work")
        if work is not None:
            self._record(work, self.current())

    def _work_wait(self, work: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                   result: Any) -> None:
        mark = self.mark_of(work)
        if mark is not None:
            self.timeline.wait(self.current(), mark)


def _device_index(device: Any, cuda: Any) -> int | None:
    if device is None:
        try:
            return int(cuda.current_device())
        except Exception:
            return None
    if isinstance(device, int):
        return device
    index = getattr(device, "index", None)
    if isinstance(index, int):
        return index
    text = str(device)
    return int(text.rsplit(":", 1)[1]) if ":" in text and text.rsplit(":", 1)[1].isdigit() \
        else None
