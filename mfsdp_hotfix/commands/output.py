"""Writing to a stdout whose reader may go away (``mfsdp-hotfix status | head -1``)."""

from __future__ import annotations

import os
import sys


def emit(text: str) -> None:
    """Print ``text``; a reader that went away (``status --check | head -1``) took what it
    wanted: the rest is dropped quietly and the command keeps its own exit status."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        quiet_stdout()


def quiet_stdout() -> None:
    """Point stdout at the null device once its reader is gone: nothing more can be shown, and
    the interpreter's own flush at exit must stay quiet too."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def reader_gone() -> bool:
    """Whether the reader of stdout or stderr went away (a pipe whose other end is closed): a
    command that writes rarely learns it here rather than at its next write."""
    import select

    poller = select.poll()
    for stream in (sys.stdout, sys.stderr):
        try:
            poller.register(stream.fileno(), select.POLLOUT)
        except (OSError, ValueError):  # closed, or not a file
            continue
    return any(events & select.POLLERR for _, events in poller.poll(0))
