"""Failures inside the hotfix: logged once, recorded for ``status()``, and the fix switched off.

A bug in the hotfix must cost the user a warning, never an import or a training step.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("mfsdp_hotfix")

_lock = threading.Lock()
_failed: dict[str, str] = {}


def report(fix_id: str, where: str, exc: BaseException, advice: str | None = None) -> None:
    """Record that ``fix_id`` failed in ``where``; the first report per fix is logged, with
    ``advice`` (what it means and what to do) in place of the generic text when given."""
    with _lock:
        first = fix_id not in _failed
        if first:
            _failed[fix_id] = f"{where}: {type(exc).__name__}: {exc}"
    if first and advice:
        log.warning("mfsdp_hotfix: %s failed in %s (%s: %s): %s", fix_id, where,
                    type(exc).__name__, exc, advice)
    elif first:
        log.warning("mfsdp_hotfix: %s failed in %s and is disabled for the rest of this "
                    "process (%s: %s); the code it covers runs as shipped. Please report this "
                    "with `mfsdp-hotfix status --json`.", fix_id, where,
                    type(exc).__name__, exc, exc_info=exc)


def disabled(fix_id: str) -> bool:
    return fix_id in _failed


def failures() -> dict[str, str]:
    with _lock:
        return dict(_failed)
