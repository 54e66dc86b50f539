"""``mfsdp-hotfix status --path DIR``: the verdict ``status`` gives an installed copy, for every
Megatron-FSDP copy in a folder read from disk (an unpacked release or wheel, a site-packages
folder, a Megatron-LM checkout), before a job imports anything from it.

Copies are found by where their files lie: the standalone ``megatron_fsdp``, the one vendored in
megatron-core (``megatron/core/distributed/fsdp/src/megatron_fsdp``, which a checkout also has),
megatron-core 0.13's ``custom_fsdp`` (refused, as on import) and the v2 ``experimental`` package
beside either. Each is judged from its source by :mod:`.detection`, exactly as an installed copy
that is not imported yet. The label comes only from the dist-info (or egg-info) beside the copy,
never from this environment's metadata; ``package_info.py`` is shown but not used, because the
one vendored in megatron-core names the wrong Megatron-FSDP version in several releases and a
checkout is not a release.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Any

from . import detection, fix_catalogue, registry, reporting, v2, versions
from . import settings as settings_module
from .__about__ import __version__
from .errors import TreeError as TreeError
from .registry import Copy

BUFFER_FILE = "param_and_grad_buffer.py"
# Exit statuses of ``status --path`` when the folder cannot be judged (``--check`` keeps 0/1).
NOT_A_FOLDER, NOTHING_FOUND = 2, 3
_SKIPPED = {".git", "__pycache__"}


def readable_folder(folder: str) -> Path:
    """``folder`` resolved; raises :class:`TreeError` if it is missing, a file or unreadable
    (also ``selftest --path``'s check: a mistyped path must not go unnoticed)."""
    root = Path(folder).expanduser()
    if not root.exists():
        raise TreeError(f"{folder}: no such folder", NOT_A_FOLDER)
    if not root.is_dir():
        raise TreeError(f"{folder} is a file, not a folder: give the folder that holds the "
                        "unpacked release, the site-packages or the Megatron-LM checkout",
                        NOT_A_FOLDER)
    if not os.access(root, os.R_OK | os.X_OK):
        raise TreeError(f"{folder}: the folder cannot be read", NOT_A_FOLDER)
    return root.resolve()


def judge(folder: str) -> dict[str, Any]:
    """``status``'s data for the copies under ``folder``; raises :class:`TreeError`."""
    root = readable_folder(folder)
    settings = settings_module.read(known_fixes=fix_catalogue.FIX_IDS)
    copies: list[dict[str, Any]] = []
    v2_copies: list[dict[str, Any]] = []
    for package_dir, files in _walk(root):
        parts = package_dir.parts
        copy = _copy_at(parts)
        if copy is not None and BUFFER_FILE in files:
            found = detection.detect_file(copy, package_dir / BUFFER_FILE, installed=False)
            copies.append({**reporting.judged_offline(found, settings),
                           "package_info": _package_info(package_dir, copy)})
        refused = _refused_at(parts)
        if refused is not None and BUFFER_FILE in files:
            found = detection.refused_at(refused, package_dir, _label(
                "megatron-core", package_dir, refused.rsplit(".", 1)[0]))
            copies.append({**reporting.judged_offline(found, settings), "package_info": {}})
        owner = _copy_at(parts[:-1])
        if parts[-1] == v2.SUBPACKAGE and owner is not None and "__init__.py" in files:
            v2_copies.append(v2.describe(owner, package_dir, False, _label(
                owner.distribution, package_dir, v2.package(owner))))
    if not copies and not v2_copies:
        packages = [c.package for c in registry.COPIES] + [
            name.rsplit(".", 1)[0] for name in registry.REFUSED_MODULES]
        raise TreeError(f"{folder}: no Megatron-FSDP copy found (looked for "
                        + ", ".join(f"{p.replace('.', '/')}/{BUFFER_FILE}" for p in packages)
                        + " at any depth)", NOTHING_FOUND)
    return {"mfsdp_hotfix": __version__, "path": str(root),
            "scope": f"the folder {root}, read from disk (nothing imported)",
            "settings": {"mode": settings.mode, "disabled_fixes": sorted(settings.disabled_fixes),
                         "problems": list(settings.problems)},
            "copies": copies, "v2_copies": v2_copies}


def _walk(root: Path) -> list[tuple[Path, set[str]]]:
    found = []
    for folder, folders, files in os.walk(root):
        folders[:] = sorted(f for f in folders if f not in _SKIPPED)
        found.append((Path(folder), set(files)))
    return found


def _copy_at(parts: tuple[str, ...]) -> Copy | None:
    """The copy whose package path ``parts`` ends with (the longest: vendored over standalone)."""
    matches = [copy for copy in registry.COPIES if _ends_with(parts, copy.package)]
    return max(matches, key=lambda copy: copy.package.count("."), default=None)


def _refused_at(parts: tuple[str, ...]) -> str | None:
    for module_name in registry.REFUSED_MODULES:
        if _ends_with(parts, module_name.rsplit(".", 1)[0]):
            return module_name
    return None


def _ends_with(parts: tuple[str, ...], package: str) -> bool:
    wanted = tuple(package.split("."))
    return parts[-len(wanted):] == wanted


def _import_root(package_dir: Path, package: str) -> Path:
    """The folder ``package`` (found at ``package_dir``) is imported from: its sys.path entry."""
    return package_dir.parents[package.count(".")]


def _label(distribution: str, package_dir: Path, package: str) -> str | None:
    """The version in the metadata beside the folder the package is imported from."""
    return versions.installed_version(distribution, near=str(_import_root(package_dir, package)),
                                      fallback=False)


def _package_info(package_dir: Path, copy: Copy) -> dict[str, str]:
    """The versions the copy's ``package_info.py`` files state (shown, never trusted): its own,
    and for the vendored copy megatron-core's."""
    root = _import_root(package_dir, copy.package)
    files = [package_dir / "package_info.py"]
    if copy.distribution == "megatron-core":
        files.append(root / "megatron" / "core" / "package_info.py")
    stated = {}
    for file in files:
        version = _stated_version(file)
        if version is not None:
            stated[file.relative_to(root).as_posix()] = version
    return stated


def _stated_version(file: Path) -> str | None:
    """``MAJOR.MINOR.PATCH`` + ``PRE_RELEASE`` from literal assignments, without running it."""
    try:
        tree = ast.parse(file.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    values: dict[str, object] = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Constant)):
            values[node.targets[0].id] = node.value.value
    numbers = [values.get(name) for name in ("MAJOR", "MINOR", "PATCH")]
    if not all(isinstance(n, int) for n in numbers):
        return None
    return ".".join(map(str, numbers)) + str(values.get("PRE_RELEASE") or "")
