"""Defer the real install until Megatron is imported, so that loading the hotfix stays cheap.

Every Python process of an environment with the ``.pth`` bootstrap loads this package, most of
them never touching Megatron. Importing wrapt alone costs tens of milliseconds, so the package
import only arms a tiny ``sys.meta_path`` finder: the first time ``megatron`` or ``megatron_fsdp``
is looked up, the finder disarms itself and runs ``install()``, whose wrapt post-import hooks then
see every Megatron-FSDP submodule load. The finder never finds anything itself, and it stays in
``sys.meta_path`` once disarmed (inert): removing it while the import system iterates that list
could make the import skip the next finder.
"""

import os
import sys

from . import variables

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing costs more to import than this whole module
    from collections.abc import Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType

TOP_LEVEL = ("megatron", "megatron_fsdp")

loaded_via = "import"


class _FirstMegatronImport:
    """A meta-path finder that only watches for the first Megatron import."""

    armed = False

    def find_spec(self, name: str, path: "Sequence[str] | None" = None,
                  target: "ModuleType | None" = None) -> "ModuleSpec | None":
        if self.armed and name in TOP_LEVEL and disarm():
            from .installer import install

            install()
        return None


_finder = _FirstMegatronImport()


def arm(source: str) -> None:
    """Install now if Megatron is already imported, else when it is; ``source`` labels how the
    package was loaded (``import``, ``pth``, ``sitecustomize``) for ``status()``."""
    global loaded_via
    loaded_via = source
    if variables.switch(os.environ.get(variables.SWITCH, "")) is False and not os.environ.get(
            variables.AUDIT, "").strip():
        return  # off, and no audit to arm (MFSDP_HOTFIX_AUDIT audits with the hotfix off too)
    if any(name in sys.modules for name in TOP_LEVEL):
        from .installer import install

        install()
        return
    _finder.armed = True
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def armed() -> bool:
    """Whether the first Megatron import will still install the hotfix."""
    return _finder.armed


def disarm() -> bool:
    """Disarm the finder; True if it was armed."""
    was_armed, _finder.armed = _finder.armed, False
    return was_armed
