"""mfsdp_hotfix: runtime repair of Megatron-FSDP's gradient double-buffer bugs.

Importing this package arms the fix (unless ``MFSDP_HOTFIX=0``): as soon as Megatron is imported,
post-import hooks patch every copy of Megatron-FSDP, the standalone ``megatron_fsdp`` and the one
vendored in megatron-core. The import itself is cheap: it imports neither torch nor megatron,
nor any module the interpreter has not loaded at start (``bootstrap`` runs it in every process).
"""

from . import trigger

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing costs more to import than this whole package
    from typing import Any

    from .__about__ import __version__
    from .errors import HotfixRefused, UnsupportedConfiguration

__all__ = ["HotfixRefused", "UnsupportedConfiguration", "__version__", "apply_to", "install",
           "status", "summary", "uninstall"]


def __getattr__(name: str) -> "Any":
    """``__version__`` and the errors, loaded when first asked for: the ``.pth`` imports this
    package in every process, and each module file costs that process's start-up time."""
    if name == "__version__":
        from .__about__ import __version__

        return __version__
    if name in ("HotfixRefused", "UnsupportedConfiguration"):
        from . import errors

        return getattr(errors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def install(strict: bool | None = None) -> bool:
    """Patch every Megatron-FSDP copy now and on import (idempotent); see ``installer.install``."""
    from . import installer

    trigger.disarm()
    return installer.install(strict)


def uninstall() -> bool:
    """Restore the originals that are still ours; True if every one was."""
    from . import installer

    trigger.disarm()
    return installer.uninstall()


def status() -> "dict[str, Any]":
    """What is armed, applied and would apply, and why, as plain data (see ``reporting``)."""
    from . import reporting

    return reporting.status()


def summary() -> str:
    """One line: what this process patched."""
    from . import installer

    return installer.summary()


def apply_to(model: "Any") -> int:
    """Guard the getters of a model built before the hotfix was installed."""
    from . import installer

    trigger.disarm()
    return installer.apply_to(model)


trigger.arm("import")
