"""Whether a process still runs, for the tests that check that every process of a run ended."""

from __future__ import annotations


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, ended but not yet collected, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
