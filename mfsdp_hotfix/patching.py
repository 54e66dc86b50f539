"""Replace a class attribute with a marked wrapt wrapper, and undo it only if it is still ours.

The marker (``_self_mfsdp_hotfix_fix``) makes installs idempotent and lets ``status`` and the
detection of late installs tell our wrappers from anyone else's, on wrapt 1.x and 2.x alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import wrapt

log = logging.getLogger("mfsdp_hotfix")

Undo = Callable[[], bool]


if TYPE_CHECKING:  # wrapt 2 is generic and typed; wrapt 1 is neither
    _FunctionWrapper = wrapt.FunctionWrapper[Any, Any]
else:
    _FunctionWrapper = wrapt.FunctionWrapper


class HotfixWrapper(_FunctionWrapper):
    """A ``FunctionWrapper`` that remembers which fix installed it."""

    def __init__(self, wrapped: Any, wrapper: Callable[..., Any], fix_id: str) -> None:
        super().__init__(wrapped, wrapper)
        self._self_mfsdp_hotfix_fix = fix_id


def fix_of(obj: object) -> str | None:
    """The id of the fix whose wrapper ``obj`` is, else None."""
    return getattr(obj, "_self_mfsdp_hotfix_fix", None) if isinstance(obj, HotfixWrapper) else None


def wrap_attribute(owner: type, name: str, wrapper: Callable[..., Any], fix_id: str) -> Undo:
    """Wrap ``owner.name`` (looked up in the class's own dict) and return the undo."""
    original = owner.__dict__[name]
    if fix_of(original) == fix_id:
        raise RuntimeError(f"{owner.__qualname__}.{name} already carries {fix_id}")
    installed = HotfixWrapper(original, wrapper, fix_id)
    setattr(owner, name, installed)

    def undo() -> bool:
        if owner.__dict__.get(name) is not installed:
            log.warning("mfsdp_hotfix: %s.%s was wrapped again by someone else after %s; leaving "
                        "it in place (restore it yourself or uninstall the other wrapper first)",
                        owner.__qualname__, name, fix_id)
            return False
        setattr(owner, name, original)
        return True

    return undo
