"""Happens-before bookkeeping for CUDA streams, events and host synchronisation (vector clocks).

Why: whether work a stream enqueues *now* is ordered after a point recorded earlier on another
stream is decided by the order of record and wait calls, not by timing. A race that did not
happen to fire in one run is still visible here. One model serves the CPU stand-in of
``torch.cuda`` (``selftest.cuda_standin``) and the on-the-job audit (``audit``), each with its own
:class:`Timeline`.

CUDA semantics kept:
* recording an event on stream S captures everything enqueued on S so far, and everything S had
  already waited for (a :class:`Mark` carries S's vector clock);
* a stream that waits on a mark is ordered after it, transitively; waiting on a stream is waiting
  on a mark recorded on it now;
* host synchronisation (device, stream or event) orders all work enqueued anywhere afterwards.

Streams are named by any hashable key (the stand-in's stream id; ``(device, cuda_stream)`` on a
GPU). Positions advance only when something is recorded: a mark covers all earlier work on its
stream, whatever that work was.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass

Clock = dict[Hashable, int]


@dataclass(frozen=True)
class Mark:
    """A recorded point: ``stream`` at ``position``, and what that stream had waited for."""

    stream: Hashable
    position: int
    clock: Mapping[Hashable, int]  # includes ``stream: position``


def _merge(target: Clock, source: Mapping[Hashable, int]) -> None:
    for key, value in source.items():
        if target.get(key, -1) < value:
            target[key] = value


class Timeline:
    """The vector clocks of one process's streams and of its host."""

    def __init__(self) -> None:
        self._positions: dict[Hashable, int] = {}
        self._clocks: dict[Hashable, Clock] = {}
        self.host: Clock = {}  # per stream: the last position the host has seen complete

    def record(self, stream: Hashable) -> Mark:
        """A point on ``stream`` after everything enqueued there so far."""
        position = self._positions.get(stream, 0) + 1
        self._positions[stream] = position
        clock = dict(self._clocks.get(stream, ()))
        clock[stream] = position
        return Mark(stream, position, clock)

    def wait(self, stream: Hashable, mark: Mark) -> None:
        """Work enqueued on ``stream`` from now on runs after ``mark``."""
        _merge(self._clocks.setdefault(stream, {}), mark.clock)
        self._positions.setdefault(stream, 0)

    def wait_stream(self, stream: Hashable, other: Hashable) -> None:
        """``stream`` waits for everything enqueued on ``other`` so far."""
        if stream != other:
            self.wait(stream, self.record(other))

    def host_waited(self, mark: Mark) -> None:
        """The host saw ``mark`` complete (event synchronize, a query that said done)."""
        _merge(self.host, mark.clock)

    def host_waited_stream(self, stream: Hashable) -> None:
        """The host saw all work enqueued on ``stream`` complete."""
        self.host_waited(Mark(stream, self._positions.get(stream, 0),
                              {**self._clocks.get(stream, {}),
                               stream: self._positions.get(stream, 0)}))

    def host_waited_all(self) -> None:
        """Device synchronisation: every stream seen so far is complete."""
        for stream in self.streams():
            self.host_waited_stream(stream)

    def streams(self) -> list[Hashable]:
        """Every stream seen so far."""
        return list(self._positions)

    def ordered(self, stream: Hashable, mark: Mark) -> bool:
        """Whether work enqueued on ``stream`` now runs after ``mark``."""
        if mark.stream == stream:
            return True
        seen = max(self._clocks.get(stream, {}).get(mark.stream, -1),
                   self.host.get(mark.stream, -1))
        return seen >= mark.position

    def clock_of(self, stream: Hashable) -> Clock:
        """What ``stream`` has waited for (a copy), for tests and reports."""
        return dict(self._clocks.get(stream, {}))
