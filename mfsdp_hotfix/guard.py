"""The one guard every fix's runtime code goes through: what a failure inside a fix does is
declared on the fix (:class:`~mfsdp_hotfix.fix_catalogue.OnFailure`) and carried out here, as
ddtrace's and OpenTelemetry's instrumentors keep one guard around every integration instead of a
try/except in each.

``SWITCH_OFF``: a fix already switched off runs nothing; a failure is reported once
(:mod:`incidents`) and the release's code runs as shipped from then on. ``STOP``: a failure is
reported and raises :class:`~mfsdp_hotfix.UnsupportedConfiguration`, because going on as
shipped would train on wrong gradients silently.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from . import incidents
from .errors import UnsupportedConfiguration
from .fix_catalogue import Fix, OnFailure

T = TypeVar("T")


class _Skipped:
    """What :func:`attempt` returns where the fix did not run: the caller runs the release's
    code as shipped."""

    def __repr__(self) -> str:
        return "SKIPPED"


SKIPPED: Any = _Skipped()


def attempt(fix: Fix, where: str, action: Callable[[], T],
            passes: tuple[type[BaseException], ...] = ()) -> T:
    """``action()`` under ``fix``'s failure policy; ``where`` names the patched function for the
    report. ``passes``: exceptions that are the release's own (re-raised as they are). Returns
    :data:`SKIPPED` where a SWITCH_OFF fix is off or has just failed."""
    if fix.on_failure is OnFailure.SWITCH_OFF and incidents.disabled(fix.id):
        return SKIPPED  # type: ignore[no-any-return]
    try:
        return action()
    except passes:
        raise
    except Exception as exc:
        if fix.on_failure is OnFailure.STOP:
            raise stopped(fix, where, exc) from exc
        incidents.report(fix.id, where, exc)
        return SKIPPED  # type: ignore[no-any-return]


def stopped(fix: Fix, where: str, exc: Exception) -> UnsupportedConfiguration:
    """Report a STOP fix's failure in ``where`` and return the error that stops the step."""
    incidents.report(fix.id, where, exc, advice=fix.stopped)
    return UnsupportedConfiguration(
        f"mfsdp_hotfix: {fix.id} failed ({type(exc).__name__}: {exc}); {fix.stopped}")
