"""One parity run: the launch command started once, its output kept in full and followed live
(which iteration, how long), a per-run timeout, and its whole process tree ended on every way
out: normal end, timeout, an exception, SIGINT, SIGTERM, a closed stdout.

The run starts in a session of its own, so that a Ctrl-C at the terminal reaches parity alone,
which then ends the run's tree: a launcher such as ``torchrun`` puts each rank in yet another
session, so the tree is read from ``/proc`` (``selftest.processes``) while the run goes on, and
every process ever seen in it is ended at the end (a rank whose launcher already exited is
re-parented away from the tree, but was seen while it was in it)."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from ..selftest.processes import descendants
from .log_lines import iteration_of

# How long the tree has after SIGTERM before SIGKILL; how often the tree is read.
GRACE_SECONDS = 5.0
POLL_SECONDS = 0.5
# A run that printed no new iteration for this long gets a line saying it is still running.
QUIET_SECONDS = 60.0
TAIL_LINES = 20


class Stopped(BaseException):
    """A signal (SIGTERM, SIGHUP) asked parity to stop; raised in the main thread like
    KeyboardInterrupt is for SIGINT, so that every ``finally`` ends its runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise :class:`Stopped` while inside (SIGINT raises
    KeyboardInterrupt as always); the previous handlers come back after."""
    def raise_stopped(signum: int, frame: object) -> None:
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, raise_stopped) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP wait while inside (and arrive after): starting a run and
    ending its tree must not be cut short by a second Ctrl-C or a ``timeout``'s SIGTERM."""
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@dataclass(frozen=True)
class Outcome:
    """How a run ended: ``status`` (None when parity ended it: timeout), its last lines."""

    status: int | None
    elapsed: float
    timed_out: bool
    last_iteration: int | None
    tail: list[str]
    log: str


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat): a pid seen earlier is the same
    process only while this is unchanged."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def adopt_orphans() -> None:
    """Make this process the child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``): a rank whose
    launcher exits before the tree was last read is re-parented here, not to PID 1, and so
    still found. Elsewhere nothing changes (the tree is then read as before)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


_PR_SET_CHILD_SUBREAPER = 36


def _children(pid: int) -> set[int]:
    return {each for each in descendants(pid) if _parent(each) == pid}


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


class Tree:
    """Every process of one run: the launcher, whatever was seen under it, and the orphans
    re-parented to this process (``adopt_orphans``) while the run went on."""

    def __init__(self, launcher: subprocess.Popen[bytes]) -> None:
        self.launcher, pid = launcher, launcher.pid
        self.pid = pid
        self.seen: dict[int, str] = {}
        self.before = _children(os.getpid()) - {pid}  # children not of this run
        self.adopted: set[int] = set()
        self.look()

    def look(self) -> None:
        orphans = _children(os.getpid()) - self.before - {self.pid}
        self.adopted |= orphans
        for root in [self.pid, *orphans]:
            for pid in [root, *descendants(root)]:
                start = _start_time(pid)
                if start is not None:
                    self.seen.setdefault(pid, start)

    def reap(self) -> None:
        """Collect the exit of the orphans that became this process's children."""
        for pid in self.adopted:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)

    def alive(self) -> list[int]:
        """The processes of the run still running (a zombie has ended)."""
        return [pid for pid, start in self.seen.items()
                if _start_time(pid) == start and not _zombie(pid)]

    def end(self) -> None:
        """SIGTERM to every process of the tree (and the run's process group), SIGKILL to
        those left after ``GRACE_SECONDS``."""
        self.look()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.alive():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)
            deadline = time.monotonic() + (GRACE_SECONDS if sig == signal.SIGTERM else 1.0)
            while self.alive() and time.monotonic() < deadline:
                self.launcher.poll()  # collects its exit status, as Popen keeps it
                self.reap()
                time.sleep(0.05)
            if not self.alive():
                return


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


def run(command: Sequence[str], env: Mapping[str, str], log_path: str, timeout: float,
        say: Callable[[str], None], label: str, last: int,
        reader_gone: Callable[[], bool] = lambda: False) -> Outcome:
    """Run ``command`` once, its output into ``log_path``; ``say`` gets the progress lines
    (``label``: which run; ``last``: the last iteration it should reach); ``reader_gone``
    true ends it as a closed pipe does (BrokenPipeError)."""
    follow = _Follow(say, label, last)
    timed_out = False
    adopt_orphans()
    with open(log_path, "wb") as log:
        with signals_held():
            child = subprocess.Popen(list(command), env=dict(env), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
            tree = Tree(child)
        try:
            lines: queue.Queue[str | None] = queue.Queue()
            threading.Thread(target=_read, args=(child.stdout, lines, log), daemon=True).start()
            timed_out = _follow(child, tree, lines, follow, timeout, reader_gone)
        finally:
            with signals_held():
                tree.end()
                child.wait()
    return Outcome(None if timed_out else child.returncode, follow.elapsed(), timed_out,
                   follow.iteration, list(follow.tail), log_path)


def _follow(child: subprocess.Popen[bytes], tree: Tree, lines: queue.Queue[str | None],
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
        tree.look()
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
