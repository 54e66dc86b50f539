"""Classify one imported copy of Megatron-FSDP: which era it belongs to, or why it is refused.

Two independent facts must agree: the distribution's release (from its metadata) and the code
shape of the three functions the fixes depend on (from their source). A known release whose shape
is not the one that release shipped is a backport or a fork: refused. A shape the registry does
not know is refused. A known shape on a release the registry has not seen (a release candidate, a
source checkout without metadata, a later patch release) is patched on its shape, and says so.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from . import fingerprints, registry, versions
from .registry import Copy, Era


@dataclass(frozen=True)
class Detection:
    """What was found for one copy, and the verdict."""

    copy: Copy
    module_path: str
    version: str | None
    shapes: dict[str, str | None]
    fingerprints: dict[str, str | None]
    era: Era | None
    reason: str
    notes: tuple[str, ...] = field(default=())

    @property
    def refused(self) -> bool:
        return self.era is None

    def as_dict(self) -> dict[str, object]:
        return {
            "copy": self.copy.label,
            "package": self.copy.package,
            "path": self.module_path,
            "distribution": self.copy.distribution,
            "version": self.version,
            "era": self.era.name if self.era else None,
            "defect": self.era.defect if self.era else None,
            "refused": self.refused,
            "reason": self.reason,
            "notes": list(self.notes),
            "shapes": dict(self.shapes),
            "fingerprints": dict(self.fingerprints),
        }


def detect_module(copy: Copy, buffer_module: ModuleType) -> Detection:
    """Classify ``copy`` from its imported ``param_and_grad_buffer`` module; never raises."""
    buffer_file = Path(getattr(buffer_module, "__file__", "") or "?")
    prints, problems = _fingerprint(lambda qualname: fingerprints.source_of(
        _resolve(buffer_module, qualname)))
    prints.update(_model_fingerprints(buffer_file))
    return _classify(copy, str(buffer_file.parent), prints, problems)


def detect_file(copy: Copy, buffer_file: Path) -> Detection:
    """Classify ``copy`` from its ``param_and_grad_buffer.py`` without importing it (no torch)."""
    try:
        tree = fingerprints.parse_file(buffer_file)
    except fingerprints.SourceUnavailable as exc:
        return _classify(copy, str(buffer_file.parent), {}, [str(exc)])
    prints, problems = _fingerprint(tree.source)
    prints.update(_model_fingerprints(buffer_file))
    return _classify(copy, str(buffer_file.parent), prints, problems)


def find_installed(copy: Copy, search_path: list[str] | None = None) -> Path | None:
    """The ``param_and_grad_buffer.py`` that ``import`` would load for ``copy``, if any."""
    relative = Path(*copy.buffer_module.split(".")).with_suffix(".py")
    for entry in sys.path if search_path is None else search_path:
        candidate = Path(entry or ".") / relative
        if candidate.is_file():
            return candidate
    return None


def _classify(copy: Copy, path: str, prints: dict[str, str | None], problems: list[str]
              ) -> Detection:
    version = versions.installed_version(copy.distribution, near=_sys_path_entry(copy, path))
    shapes = {name: registry.SHAPES[name].get(fp) if fp else None for name, fp in prints.items()}

    def verdict(era: Era | None, reason: str, *notes: str) -> Detection:
        return Detection(copy, path, version, shapes, prints, era, reason, tuple(notes))

    if problems:
        return verdict(None, "cannot read the code to verify its shape: " + "; ".join(problems)
                       + ". Install Megatron-FSDP with its .py sources")
    getter, drain = shapes[registry.GETTER], shapes[registry.DRAIN]
    era = next((e for e in registry.ERAS
                if (e.getter_shape, e.drain_shape) == (getter, drain)), None)
    unknown = [name.split(".")[-1] for name, shape in shapes.items()
               if shape is None and name not in registry.MODEL_TARGETS]
    if era is None or unknown:
        what = ", ".join(unknown) or f"the combination getter {getter} / drain {drain}"
        return verdict(None, f"unrecognised code shape ({what}): a fork, a backport or a newer "
                       "release. Nothing was patched; report the fingerprints from "
                       "`mfsdp-hotfix status` to the mfsdp-hotfix maintainers, or upgrade "
                       "mfsdp-hotfix")
    release = versions.release_tuple(version)
    if release is None:
        return verdict(era, f"era {era.name} by code shape",
                       f"no usable {copy.distribution} version metadata ({version!r}); "
                       "recognised by code shape alone")
    expected = _era_of_release(copy.distribution, release)
    if expected is None:
        return verdict(era, f"era {era.name} by code shape",
                       f"{copy.distribution} {version} is not among the releases this hotfix "
                       "was verified on; its code shape is identical to a verified one")
    if expected.name != era.name or (expected.getter_shape, expected.drain_shape) != (getter,
                                                                                      drain):
        return verdict(None, f"{copy.distribution} {version} shipped the era-{expected.name} "
                       f"shape (getter {expected.getter_shape}, drain {expected.drain_shape}) "
                       f"but this copy has getter {getter}, drain {drain}: modified code "
                       "(backport or fork). Nothing was patched; report it with "
                       "`mfsdp-hotfix status --json`")
    return verdict(era, f"era {era.name}: verified release {copy.distribution} {version}")


def refusal(module_name: str, module: ModuleType) -> Detection:
    """The record for a copy that :data:`registry.REFUSED_MODULES` lists by import path."""
    label, why = registry.REFUSED_MODULES[module_name]
    copy = Copy(label, module_name.rsplit(".", 1)[0], "megatron-core")
    version = versions.installed_version(copy.distribution)
    return Detection(copy, str(Path(getattr(module, "__file__", "") or "?").parent), version,
                     {}, {}, None, why)


def _fingerprint(source: Callable[[str], str]) -> tuple[dict[str, str | None], list[str]]:
    """Fingerprint each target; a missing function gives None, unreadable code a problem."""
    prints: dict[str, str | None] = {}
    problems: list[str] = []
    for qualname in (registry.GETTER, registry.DRAIN, registry.WAIT):
        try:
            prints[qualname] = fingerprints.fp_code(source(qualname))
        except (AttributeError, KeyError):
            prints[qualname] = None
        except fingerprints.SourceUnavailable as exc:
            prints[qualname] = None
            problems.append(str(exc))
    return prints, problems


def _model_fingerprints(buffer_file: Path) -> dict[str, str | None]:
    """The model module's targets, read from ``megatron_fsdp.py`` beside the buffer module
    (parsed, not imported: the buffer module's hook runs before the model module exists).
    Unreadable or absent: None, which leaves the fixes that need them unverified."""
    try:
        tree = fingerprints.parse_file(buffer_file.with_name("megatron_fsdp.py"))
    except fingerprints.SourceUnavailable:
        return dict.fromkeys(registry.MODEL_TARGETS)
    prints: dict[str, str | None] = {}
    for qualname in sorted(registry.MODEL_TARGETS):
        try:
            prints[qualname] = fingerprints.fp_code(tree.source(qualname))
        except KeyError:
            prints[qualname] = None
    return prints


def _resolve(module: ModuleType, qualname: str) -> object:
    """Find ``Class.method`` or ``Class.method.<locals>.inner`` without building anything."""
    outer, _, inner = qualname.partition(".<locals>.")
    obj: object = module
    for part in outer.split("."):
        obj = getattr(obj, part)
    if not inner:
        return obj
    code = fingerprints.nested_code(obj, inner)
    if code is None:
        raise AttributeError(f"{outer} defines no {inner}")
    return code


def _era_of_release(distribution: str, release: tuple[int, ...]) -> Era | None:
    for era in registry.ERAS:
        first, end = era.releases.get(distribution, ((), ()))
        if first and first <= release < end:
            return era
    return None


def _sys_path_entry(copy: Copy, package_dir: str) -> str:
    """The ``sys.path`` folder the copy was imported from (where its dist-info lives)."""
    root = Path(package_dir)
    for _ in copy.package.split("."):
        root = root.parent
    return str(root)
