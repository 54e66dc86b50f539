"""Each run's work folder is its own.

``MFSDP_VAL_WORK`` (default ``/tmp/mfsdp_val``) is the parent: the unpacked release wheels are
shared there (``rel/``), and every driver process gets a fresh folder under ``runs/`` for its result
files, serialized truths and audit files. On a machine kept between runs, nothing an earlier
run left can then be read as this run's (a result file that already holds lines, a truth file).
"""

from __future__ import annotations

import os
import time

PARENT = os.environ.get("MFSDP_VAL_WORK", "/tmp/mfsdp_val")
_run: str | None = None


def run_dir() -> str:
    """This process's run folder: named on first use, never one that exists already. Planning
    only names it; the engine creates it (and refuses one that exists)."""
    global _run
    if _run is None:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        base = os.path.join(PARENT, "runs", f"{stamp}-{os.getpid()}")
        path, n = base, 1
        while os.path.exists(path):
            n += 1
            path = f"{base}-{n}"
        _run = path
    return _run


def run_id() -> str:
    return os.path.basename(run_dir())


def truth_path(phase: str, release: str, variant: str, key: str) -> str:
    """Where a serialized run of this run writes its truth."""
    return os.path.join(run_dir(), "truth", phase, release, variant, f"{key}.pt")
