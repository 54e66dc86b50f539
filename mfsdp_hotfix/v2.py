"""Megatron-FSDP v2: the ``experimental`` package beside a copy (NVIDIA PR #5865), which
Megatron-LM selects with ``ddp_config.megatron_fsdp_version=2``. Where it is, and why the hotfix
leaves it alone.

v2 is another implementation, not another shape of v1's functions: it has no ``get_main_grad``,
no fixed gradient pool and no double-buffer drain, so none of the fixes has anything to repair
there, and the audit, which watches the slots of gradient pools, has nothing to watch. Its own
gradient storage is analysed in docs/MEGATRON_FSDP_V2.md.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from . import registry, versions
from .registry import Copy

SUBPACKAGE = "experimental"
ERA = "v2"  # what the audit's rank files give as a v2 package's era
# Defines ``FsdpModule``, one per unit that v2's ``fully_shard`` shards: built only by a v2 job
# (megatron-core's adapter imports the package in every job, v1 or v2).
MODULE = "module"
HOTFIX_DOES = "nothing"
WHY = ("Megatron-FSDP v2 has no get_main_grad, no fixed gradient pool and no double-buffer "
       "drain, so the defects the fixes repair are not in its code and nothing is patched; it "
       "allocates each reduce-scatter input afresh from PyTorch's caching allocator "
       "(docs/MEGATRON_FSDP_V2.md)")
AUDIT_NOTE = ("not audited: a Megatron-FSDP v2 model (megatron_fsdp_version=2) was built; v2 "
              "allocates each reduce-scatter input afresh instead of taking slots of a gradient "
              "pool, and the audit watches pool slots only (docs/MEGATRON_FSDP_V2.md)")


def package(copy: Copy) -> str:
    """``megatron_fsdp.experimental`` or megatron-core's vendored equivalent."""
    return f"{copy.package}.{SUBPACKAGE}"


def describe(copy: Copy, package_dir: Path, imported: bool, version: str | None
             ) -> dict[str, Any]:
    """One v2 package as ``status`` lists it under ``v2_copies``."""
    return {"copy": f"{copy.label} v2 ({SUBPACKAGE})", "package": package(copy),
            "path": str(package_dir), "distribution": copy.distribution, "version": version,
            "imported": imported, "hotfix": HOTFIX_DOES, "reason": WHY}


def present() -> list[dict[str, Any]]:
    """The v2 packages of this process: imported ones, else the ones ``import`` would load."""
    found = []
    for copy in registry.COPIES:
        module = sys.modules.get(package(copy))
        file = getattr(module, "__file__", None) if module is not None else None
        init = Path(file) if file else _on_path(copy)
        if init is None:
            continue
        found.append(describe(copy, init.parent, module is not None, label(copy, init.parent)))
    return found


def label(copy: Copy, package_dir: Path) -> str | None:
    """The installed version of the distribution whose v2 package lies in ``package_dir``."""
    return versions.installed_version(copy.distribution,
                                      near=str(package_dir.parents[package(copy).count(".")]))


def _on_path(copy: Copy) -> Path | None:
    relative = Path(*package(copy).split("."), "__init__.py")
    for entry in sys.path:
        candidate = Path(entry or ".") / relative
        if candidate.is_file():
            return candidate
    return None
