"""Ending a process with everything it started.

``torchrun`` starts each rank in a session of its own, so killing the launcher's process group
leaves the ranks running (holding their GPUs, and any pipe of the launcher's output open);
they are found through ``/proc`` instead, by parent, before anything is killed.
"""

from __future__ import annotations

import os
import signal


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


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process under it; those already gone are skipped."""
    for each in [pid, *descendants(pid)]:
        try:
            os.kill(each, signal.SIGKILL)
        except ProcessLookupError:
            pass
