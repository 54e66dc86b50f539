"""Child processes and temporary folders that end with the block that made them, whatever ends it.

:func:`supervised` is the one way the commands start processes (the selftest's workers, the GPU
runs, the job ``audit`` and ``parity`` run) and make temporary folders::

    with processes.supervised() as children:
        folder = children.temp_dir("mfsdp-selftest-")
        proc = children.start([sys.executable, "-m", "..."], stdout=log)
        proc.wait()

However the block ends (its last line, an exception, a reader that closed the pipe, Ctrl-C,
SIGTERM or SIGHUP), every process started through ``children`` is ended with everything it
started, and every folder from :meth:`Children.temp_dir` is removed (one that cannot be is named
on stderr). Inside the block SIGTERM and SIGHUP raise :class:`Stopped` (SIGINT raises
``KeyboardInterrupt`` as always), so the block ends like on any exception; ``cli.main`` turns
each into the shell's status (130, 143, 129; 141 for the closed pipe).

Finding every process: ``torchrun`` starts each rank in a session of its own, so killing the
launcher's process group leaves the ranks running; they are found through ``/proc`` by parent.
A process whose parent has already exited has no parent to be found by (it is re-parented to
init), so every child also carries a token in its environment (:data:`TOKEN`), inherited by all
it starts, and the processes that hold the token are ended too: the block's, or one child's
(:meth:`Children.end`, a run past its time).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

from .errors import Stopped as Stopped

# Environment variable carrying the block's token into every process started under it.
TOKEN = "MFSDP_SUPERVISED_BY"
# Turned into :class:`Stopped` inside a block (SIGINT is Python's KeyboardInterrupt already).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_TERMINATING = (signal.SIGINT, *STOP_SIGNALS)
# How long the end of a block waits for its killed processes to go (one in an uninterruptible
# kernel call goes only when the call returns); signals are held back meanwhile.
WAIT_S = 30.0


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (children, their children, ...), read from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        found = children.get(todo.pop(), [])
        out += found
        todo += found
    return out


def holders(token: str) -> list[int]:
    """Every process (but this one) whose environment carries ``TOKEN=token`` or a child's
    token under it (``token/N``)."""
    needle = f"{TOKEN}={token}".encode()
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if any(var == needle or var.startswith(needle + b"/") for var in environ.split(b"\0")) \
                and int(entry) != os.getpid():
            found.append(int(entry))
    return found


def kill_tree(pid: int, signum: int = signal.SIGKILL) -> None:
    """Send ``signum`` (default SIGKILL) to ``pid`` and every process under it; those already
    gone are skipped."""
    for each in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, signum)


class Children:
    """What a :func:`supervised` block started: its processes and temporary folders."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.token = f"{os.getpid()}-{time.monotonic_ns()}"
        self.procs: list[subprocess.Popen[Any]] = []
        self.tokens: dict[int, str] = {}  # pid -> the token it and all it starts carry
        self.folders: list[str] = []
        self.sessions: set[int] = set()  # started in a session (and group) of their own

    def start(self, command: list[str], *, own_session: bool = True,
              env: dict[str, str] | None = None, **popen: Any) -> subprocess.Popen[Any]:
        """``subprocess.Popen(command, ...)`` carrying a token of its own. ``own_session``: in a
        session of its own (a Ctrl-C at the terminal reaches this process only, which ends the
        child: the harness' workers, the job parity runs); False for a user's command that gets
        the terminal's Ctrl-C itself (audit)."""
        token = f"{self.token}/{len(self.procs)}"
        env = dict(os.environ if env is None else env, **{TOKEN: token})
        proc = subprocess.Popen(command, env=env, start_new_session=own_session, **popen)
        self.procs.append(proc)
        self.tokens[proc.pid] = token
        if own_session:
            self.sessions.add(proc.pid)
        return proc

    def temp_dir(self, prefix: str) -> str:
        """A new temporary folder, removed when the block ends."""
        folder = tempfile.mkdtemp(prefix=prefix)
        self.folders.append(folder)
        return folder

    def end(self, proc: subprocess.Popen[Any], grace_s: float = 0.0) -> None:
        """End ``proc`` and everything it started now (a run past its time): SIGTERM and up to
        ``grace_s`` to go, then SIGKILL. What it left behind whose parent already exited is
        found by its token."""
        token = self.tokens[proc.pid]
        if grace_s > 0:
            self._signal(proc, token, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while (proc.poll() is None or holders(token)) and time.monotonic() < deadline:
                time.sleep(0.05)
        for _ in range(3):  # a process may start another while a round kills
            if not self._signal(proc, token, signal.SIGKILL):
                break

    def _signal(self, proc: subprocess.Popen[Any], token: str, signum: int) -> bool:
        """Send ``signum`` to ``proc``'s tree, its process group and its token's holders; True
        when anything was there to signal."""
        found = holders(token)
        if proc.poll() is None:
            found += [proc.pid, *descendants(proc.pid)]
        for pid in set(found):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        if proc.pid in self.sessions:  # its group outlives it while a member lives
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signum)
        return bool(found)

    def end_all(self) -> None:
        """End the processes still running, each with ``grace_s`` between SIGTERM and SIGKILL,
        and every holder of the block's token; reap; remove the folders."""
        running = [p for p in self.procs if p.poll() is None]
        if running and self.grace_s > 0:
            for proc in running:
                self._signal(proc, self.tokens[proc.pid], signal.SIGTERM)
            deadline = time.monotonic() + self.grace_s
            while any(p.poll() is None for p in running) and time.monotonic() < deadline:
                time.sleep(0.05)
        for _ in range(3):  # a process may start another while a round kills
            for proc in self.procs:
                self.end(proc)
            left = holders(self.token)
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if not left:
                break
        deadline = time.monotonic() + WAIT_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # in the kernel (a GPU driver call): say so
                print(f"mfsdp-hotfix: process {proc.pid} did not end {WAIT_S:.0f} s after "
                      "SIGKILL; end it by hand", file=sys.stderr)
        for folder in self.folders:
            shutil.rmtree(folder, ignore_errors=True)
            if os.path.exists(folder):
                print(f"mfsdp-hotfix: could not remove the temporary folder {folder}; remove "
                      "it by hand", file=sys.stderr)


def _raise_stopped(signum: int, frame: object) -> None:
    raise Stopped(signum)


@contextlib.contextmanager
def supervised(grace_s: float = 0.0) -> Iterator[Children]:
    """A block whose processes and temporary folders end with it (see the module's docstring).
    ``grace_s``: how long processes still running at the end get between SIGTERM and SIGKILL
    (0, the harness' workers: SIGKILL at once; a user's command gets time to write its files).
    Signals are held back while the block tidies up, so a second Ctrl-C cannot cut it short."""
    children = Children(grace_s)
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for stop in STOP_SIGNALS:
            if signal.getsignal(stop) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
                previous[stop] = signal.signal(stop, _raise_stopped)
    try:
        yield children
    finally:
        held = signal.pthread_sigmask(signal.SIG_BLOCK, _TERMINATING)
        try:
            children.end_all()
        finally:
            for stop, handler in previous.items():
                signal.signal(stop, handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
