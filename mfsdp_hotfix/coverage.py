"""Which training configurations a copy is covered for, declared as data, and the gate that
refuses the others when a model is built.

Each fix covers the configurations in which its defect strikes. Where a copy needs a fix but
cannot have it (its code shape is ``unverified``, or installing it ``failed``), those
configurations still fail as shipped: building a ``MegatronFSDP`` in one raises
:class:`~mfsdp_hotfix.UnsupportedConfiguration` naming the release, the configuration and the
workaround, instead of the release's assertion later in training. A fix the user ``disabled``
(or ``MFSDP_HOTFIX=0``) is reported uncovered but not enforced: that is how the shipped behaviour
is studied. A configuration no fix makes right (HSDP with unsharded gradients and
``overlap_grad_reduce=False``: wrong as shipped and with reduce-once alike) is refused whatever
the fix's state, except under ``MFSDP_HOTFIX=0``. Only copies with the defect are limited: the
synchronous reductions' shapes say which strategies reduce twice. A release defect no fix
repairs (:class:`~mfsdp_hotfix.release_defects.ReleaseDefect` with no ``fix``) leaves the
configurations it hits uncovered wherever the copy's code has it, or may have it: building a
model in one is refused while the hotfix is loaded. ``status()`` lists every entry per copy
under ``limits``.
"""

from __future__ import annotations

from typing import Any

from . import registry, release_defects
from .detection import Detection
from .fix_catalogue import FIX_LIMITS
from .limits import Limit
from .states import FixState

# Every limit: each fix's (``Fix.limits``), then each defect's no fix repairs
# (``ReleaseDefect.limits``).
LIMITS = FIX_LIMITS + release_defects.DEFECT_LIMITS

# Fix states that leave a configuration failing, and whether building a model in it is refused.
# UNREPAIRED: a release defect no fix repairs, which the copy's code has or may have.
UNREPAIRED = FixState.NOT_REPAIRED
_UNCOVERED: dict[str, bool] = {
    FixState.UNVERIFIED: True, FixState.FAILED: True, FixState.DISABLED: False,
    FixState.OFF: False, FixState.REFUSED: False, UNREPAIRED: True}


def limits(found: Detection, fixes: dict[str, tuple[str, str]],
           enforced: bool = True) -> list[dict[str, Any]]:
    """Per configuration this copy has a defect in: whether it is covered, and if not why.
    ``enforced`` False: the hotfix is off, so nothing is refused at model construction."""
    out = []
    for limit in LIMITS:
        state, _ = _state(limit, found, fixes)
        if not _has_defect(limit, found, state):
            continue
        entry: dict[str, Any] = {"configuration": limit.configuration, "fix": limit.fix,
                                 "covered": limit.repaired and state not in _UNCOVERED}
        if limit.defect is not None:
            entry["defect"] = limit.defect.name
        if not entry["covered"]:
            entry.update(failure=_failure(limit, found), workaround=limit.workaround,
                         refused_at_model_construction=_refused(limit, state) and enforced)
        out.append(entry)
    return out


def check(found: Detection, fixes: dict[str, tuple[str, str]], model: Any,
          config_changed: bool = False) -> None:
    """Raise :class:`~mfsdp_hotfix.UnsupportedConfiguration` if ``model`` (a MegatronFSDP just
    built, or ``config_changed`` since) is in a configuration this copy is not covered for and
    that is refused."""
    from .errors import UnsupportedConfiguration

    for limit in LIMITS:
        state, why = _state(limit, found, fixes)
        if not (_has_defect(limit, found, state) and _refused(limit, state)):
            continue
        try:
            if not limit.matches(model):
                continue
        except Exception as exc:  # a fork's model: cannot tell, so not covered
            why += f"; whether this model is in it could not be read ({exc!r})"
        if not limit.repaired:
            why = (f"no fix repairs it, neither the shipped code nor {limit.fix} is right "
                   f"({limit.fix} is {state} here)")
        raise UnsupportedConfiguration(
            f"mfsdp_hotfix: {found.copy.distribution} "
            f"{found.version or '(version unknown)'} at {found.module_path} is not covered "
            f"for {limit.configuration}"
            f"{' (its ddp_config was changed after the model was built)' if config_changed else ''}"
            f": {why}. As shipped this configuration fails "
            f"({_failure(limit, found)}). Workaround: {limit.workaround}.")


def _state(limit: Limit, found: Detection, fixes: dict[str, tuple[str, str]]
           ) -> tuple[str | None, str]:
    """The state behind ``limit`` on this copy (its fix's, None where the fix was not judged,
    or :data:`UNREPAIRED` where the copy has its release defect or may have it), and why."""
    if limit.defect is None:
        assert limit.fix is not None
        state, reason = fixes.get(limit.fix, (None, ""))
        return state, f"the fix {limit.fix} is {state} ({reason})"
    defect = limit.defect
    assert defect.carrier is not None
    has = release_defects.carried(defect, found.shapes)
    if has is False:
        return FixState.NOT_NEEDED, ""
    where = registry.short_name(defect.carrier)
    if has is None:
        return UNREPAIRED, (f"its {where} has a code shape the hotfix does not know, so the "
                            f"release defect {defect.name} is not ruled out, and no fix "
                            "repairs it")
    return UNREPAIRED, f"its {where} has the release defect {defect.name}, which no fix repairs"


def _has_defect(limit: Limit, found: Detection, state: str | None) -> bool:
    """Whether this copy has the defect ``limit`` is about: its fix is judged for the copy
    (and needed or possibly needed, for a defect the fix repairs), and the synchronous
    reduction it needs does reduce, or its shape is unknown."""
    if state is None or ((limit.repaired or limit.shape) and state == FixState.NOT_NEEDED):
        return False  # a shape-bound limit is about a copy whose code has the defect
    if limit.shape is not None:
        function, name = limit.shape
        has = found.shapes.get(function)
        if function in found.shapes and has is not None and has.name != name:
            return False
    if limit.reduction is None:
        return True
    shape = found.shapes.get(limit.reduction)
    return shape is None or bool(shape.reduces)


def _refused(limit: Limit, state: str | None) -> bool:
    if not limit.repaired:
        return state != FixState.OFF
    return _UNCOVERED.get(state or "", False)


def _failure(limit: Limit, found: Detection) -> str:
    return limit.failure.format(defect=found.era.defect if found.era else "unknown")
