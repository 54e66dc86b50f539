"""One parity run: the launch command started once, its output kept in full and followed live
(which iteration, how long), a per-run timeout, and its whole process tree ended on every way
out: normal end, timeout, an exception, SIGINT, SIGTERM, a closed stdout.

The run is started through the command's :func:`~mfsdp_hotfix.processes.supervised` block, in a
session of its own, so that a Ctrl-C at the terminal reaches parity alone, which then ends the
run: its launcher, every rank (``torchrun`` puts each in yet another session) and whatever a
launcher that already exited left behind, found by the token each process inherits. The job
gets ``GRACE_SECONDS`` between SIGTERM and SIGKILL to write its files."""

from __future__ import annotations

import collections
import queue
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..processes import Children
from .log_lines import iteration_of

# How long the tree has after SIGTERM before SIGKILL; how often the tree is read.
GRACE_SECONDS = 5.0
POLL_SECONDS = 0.5
# A run that printed no new iteration for this long gets a line saying it is still running.
QUIET_SECONDS = 60.0
TAIL_LINES = 20


@dataclass(frozen=True)
class Outcome:
    """How a run ended: ``status`` (None when parity ended it: timeout), its last lines."""

    status: int | None
    elapsed: float
    timed_out: bool
    last_iteration: int | None
    tail: list[str]
    log: str


def _read(stream: object, lines: queue.Queue[str | None], log: object) -> None:
    """Copy the run's output into its log file and, line by line, onto ``lines``."""
    for raw in iter(stream.readline, b""):  # type: ignore[attr-defined]
        log.write(raw)  # type: ignore[attr-defined]
        log.flush()  # type: ignore[attr-defined]
        lines.put(raw.decode(errors="replace").rstrip("\r\n"))
    lines.put(None)


class _Follow:
    """The live state of one run: its last lines, the last iteration printed, when it was
    last said, and the progress lines."""

    def __init__(self, say: Callable[[str], None], label: str, last: int) -> None:
        self.say, self.label, self.last = say, label, last
        self.began = self.said = time.monotonic()
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.iteration: int | None = None

    def line(self, line: str) -> None:
        self.tail.append(line)
        number = iteration_of(line)
        if number is not None and number != self.iteration:
            self.iteration, self.said = number, time.monotonic()
            self.say(f"{self.label}: iteration {number}/{self.last} ({self.elapsed():.0f} s)")

    def quiet(self, timeout: float) -> None:
        """Say that the run is still going when it printed no new iteration for a while."""
        if time.monotonic() - self.said > QUIET_SECONDS:
            self.said = time.monotonic()
            self.say(f"{self.label}: still running ({self.elapsed():.0f} s, "
                     + (f"last iteration {self.iteration}" if self.iteration is not None
                        else "no iteration yet") + f"; timeout {timeout:.0f} s)")

    def elapsed(self) -> float:
        return time.monotonic() - self.began


def run(children: Children, command: Sequence[str], env: Mapping[str, str], log_path: str,
        timeout: float, say: Callable[[str], None], label: str, last: int,
        reader_gone: Callable[[], bool] = lambda: False) -> Outcome:
    """Run ``command`` once under ``children``, its output into ``log_path``; ``say`` gets the
    progress lines (``label``: which run; ``last``: the last iteration it should reach);
    ``reader_gone`` true ends it as a closed pipe does (BrokenPipeError). However this returns,
    the run's processes are ended first."""
    follow = _Follow(say, label, last)
    timed_out = False
    with open(log_path, "wb") as log:
        child = children.start(list(command), env=dict(env), stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            lines: queue.Queue[str | None] = queue.Queue()
            threading.Thread(target=_read, args=(child.stdout, lines, log), daemon=True).start()
            timed_out = _follow(child, lines, follow, timeout, reader_gone)
        finally:
            children.end(child, GRACE_SECONDS)
            child.wait()
    return Outcome(None if timed_out else child.returncode, follow.elapsed(), timed_out,
                   follow.iteration, list(follow.tail), log_path)


def _follow(child: subprocess.Popen[bytes], lines: queue.Queue[str | None],
            follow: _Follow, timeout: float, reader_gone: Callable[[], bool]) -> bool:
    """Follow the run until it ends (its launcher exited and its output closed, or the output
    stays open ``GRACE_SECONDS`` after the launcher exited); True when it ran past
    ``timeout``."""
    closed, ended = False, None
    while True:
        try:
            line = lines.get(timeout=POLL_SECONDS) if not closed else ""
        except queue.Empty:
            line = ""
        if closed:
            time.sleep(POLL_SECONDS / 5)
        if reader_gone():
            raise BrokenPipeError("the reader of parity's output went away")
        if line is None:
            closed = True
        elif line:
            follow.line(line)
        if ended is None and child.poll() is not None:
            ended = time.monotonic()
        if ended is not None and (closed or time.monotonic() - ended > GRACE_SECONDS):
            return False
        if follow.elapsed() > timeout:
            return True
        follow.quiet(timeout)
