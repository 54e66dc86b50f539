"""Replace a class attribute (or a module's function) with a marked wrapper function, and undo it
only if it is still ours.

The wrappers are plain functions (``functools.wraps``, so ``__wrapped__``, the signature and
``inspect.unwrap`` still lead to the release's code): one of them sits on the backward pass's hot
path, where a wrapt ``FunctionWrapper``'s per-call binding cost microseconds. The marker
(``_mfsdp_hotfix_fix``) makes installs idempotent and lets ``uninstall()`` tell our wrappers from
anyone else's.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable
from typing import Any

log = logging.getLogger("mfsdp_hotfix")

Undo = Callable[[], bool]
# wrapper(bound original, instance, args, kwargs) -> result, as wrapt's wrappers are called.
Wrapper = Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], Any]
MARK = "_mfsdp_hotfix_fix"


def fix_of(obj: object) -> str | None:
    """The id of the fix whose wrapper ``obj`` is, else None."""
    return getattr(obj, MARK, None) if isinstance(obj, types.FunctionType) else None


def wrap_attribute(owner: type, name: str, wrapper: Wrapper, fix_id: str,
                   builtin: bool = False) -> Undo:
    """Wrap the method ``owner.name`` (from the class's own dict) and return the undo.

    ``builtin``: also accept a method implemented in C (an extension type's), bound per call.
    """
    original = owner.__dict__[name]
    if not isinstance(original, types.FunctionType) and not (builtin and callable(original)):
        raise TypeError(f"{owner.__qualname__}.{name} is a {type(original).__name__}, not a "
                        "plain function: not the code shape this fix was written for")
    _refuse_twice(f"{owner.__qualname__}.{name}", original, fix_id)

    if builtin:
        def installed(self: Any, *args: Any, **kwargs: Any) -> Any:
            return wrapper(types.MethodType(original, self), self, args, kwargs)
    else:
        def installed(self: Any, *args: Any, **kwargs: Any) -> Any:
            return wrapper(original.__get__(self, owner), self, args, kwargs)

    functools.update_wrapper(installed, original)
    setattr(installed, MARK, fix_id)
    return _replace_attribute(owner, name, installed, fix_id)


def wrap_static_method(owner: type, name: str, wrapper: Wrapper, fix_id: str) -> Undo:
    """Wrap the static method ``owner.name`` (called as ``wrapper(original, None, args,
    kwargs)``; an autograd Function's ``backward``, which autograd looks up on the class at each
    call) and return the undo."""
    original = owner.__dict__[name]
    function = getattr(original, "__func__", None)
    if not isinstance(original, staticmethod) or not isinstance(function, types.FunctionType):
        raise TypeError(f"{owner.__qualname__}.{name} is a {type(original).__name__}, not a "
                        "static method: not the code shape this fix was written for")
    _refuse_twice(f"{owner.__qualname__}.{name}", function, fix_id)

    @functools.wraps(function)
    def installed(*args: Any, **kwargs: Any) -> Any:
        return wrapper(function, None, args, kwargs)

    setattr(installed, MARK, fix_id)
    return _replace_attribute(owner, name, staticmethod(installed), fix_id)


def wrap_attributes(targets: list[tuple[type, str, Wrapper]], fix_id: str) -> Undo:
    """Wrap each ``(owner, name, wrapper)`` as :func:`wrap_attribute` does, all or none: if one
    cannot be wrapped, those already wrapped are restored. The undo restores the last first."""
    undos: list[Undo] = []
    try:
        for owner, name, wrapper in targets:
            undos.append(wrap_attribute(owner, name, wrapper, fix_id))
    except Exception:
        for undo in reversed(undos):
            undo()
        raise

    def undo_all() -> bool:
        return all([undo() for undo in reversed(undos)])

    return undo_all


def wrap_function(module: types.ModuleType, name: str, wrapper: Wrapper, fix_id: str) -> Undo:
    """Wrap the function ``module.name`` (called as ``wrapper(original, None, args, kwargs)``)
    and return the undo; only callers that look the name up at call time see the wrapper."""
    original = getattr(module, name)
    _refuse_twice(f"{module.__name__}.{name}", original, fix_id)

    @functools.wraps(original)
    def installed(*args: Any, **kwargs: Any) -> Any:
        return wrapper(original, None, args, kwargs)

    setattr(installed, MARK, fix_id)
    return _replace(f"{module.__name__}.{name}", lambda: getattr(module, name, None),
                    lambda value: setattr(module, name, value), original, installed, fix_id)


def _refuse_twice(label: str, original: object, fix_id: str) -> None:
    """A second install of one fix would wrap its own wrapper: the caller's idempotence check
    failed, so say so instead of running the fix twice per call."""
    if fix_of(original) == fix_id:
        raise RuntimeError(f"{label} already carries {fix_id}")


def _replace_attribute(owner: type, name: str, replacement: object, fix_id: str) -> Undo:
    """Put ``replacement`` in the class's own dict, in place of what is there."""
    return _replace(f"{owner.__qualname__}.{name}", lambda: owner.__dict__.get(name),
                    lambda value: setattr(owner, name, value), owner.__dict__[name],
                    replacement, fix_id)


def _replace(label: str, current: Callable[[], object], put: Callable[[object], None],
             original: object, replacement: object, fix_id: str) -> Undo:
    """Put ``replacement`` in place; the undo puts ``original`` back only while ``replacement``
    is still what is there (someone else's later patch is theirs to restore)."""
    put(replacement)

    def undo() -> bool:
        if current() is not replacement:
            log.warning("mfsdp_hotfix: %s was replaced again by someone else after %s; leaving "
                        "it in place (restore it yourself or remove the other patch first)",
                        label, fix_id)
            return False
        put(original)
        return True

    return undo
