"""Classify one imported copy of Megatron-FSDP: the shape of each function the fixes rest on, the
era those shapes form, or why the copy is refused.

Each of the three functions is judged by its own code: a fingerprint of its text, or for a getter
rewritten in other words, its structure (:mod:`.structure`). The fixes follow the shapes. The
release label only corroborates: a "verified release" is a final release label the registry
knows whose every function has the shape that release shipped. A known release whose code has
other known shapes is a backport or a fork and is fixed by its shapes, with a note; a
pre-release, dev, local (git) label or no metadata at all is judged by code shape alone. A shape
the registry does not know, in a function that a fix replaces or relies on, refuses the copy.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType

from . import eras, fingerprints, fix_catalogue, registry, structure, verified_releases, versions
from .eras import Era
from .fix_catalogue import Fix
from .registry import Copy, Shape
from .structure import double_buffer

FINGERPRINT, STRUCTURE = "fingerprint", "structure"


@dataclass(frozen=True)
class Detection:
    """What was found for one copy, and the verdict."""

    copy: Copy
    module_path: str
    version: str | None
    shapes: dict[str, Shape | None]
    matched_by: dict[str, str | None]  # FINGERPRINT, STRUCTURE or None (unknown)
    fingerprints: dict[str, str | None]
    era: Era | None
    reason: str
    notes: tuple[str, ...] = field(default=())
    verified_release: bool = False
    pool_size: int | str | None = None  # the gradient pool's slots, N (see pool_size_text)

    @property
    def refused(self) -> bool:
        return self.era is None

    @property
    def label_kind(self) -> str:
        return versions.label_kind(self.version)

    def needs(self, fix: Fix) -> bool:
        """Whether this (not refused) copy's shapes need ``fix``."""
        known = {name: shape for name, shape in self.shapes.items() if shape is not None}
        return fix_catalogue.needed(fix, known)

    @property
    def pool_size_text(self) -> str | None:
        """N in words: ``2``, or the config expression the pool is sized from when the model is
        built (NVIDIA PR #6316); None where the code was not read or builds no gradient pool."""
        if self.pool_size is None or isinstance(self.pool_size, int):
            return None if self.pool_size is None else str(self.pool_size)
        return f"from the config ({self.pool_size}), read when the model is built"

    def as_dict(self) -> dict[str, object]:
        return {
            "copy": self.copy.label,
            "package": self.copy.package,
            "path": self.module_path,
            "distribution": self.copy.distribution,
            "version": self.version,
            "label_kind": self.label_kind,
            "verified_release": self.verified_release,
            "era": self.era.name if self.era else None,
            "defect": self.era.defect if self.era else None,
            "without_hotfix": self.era.without_hotfix if self.era else None,
            "refused": self.refused,
            "reason": self.reason,
            "notes": list(self.notes),
            "shapes": {name: shape.name if shape else None
                       for name, shape in self.shapes.items()},
            "functions": {name: _describe(name, shape, self.matched_by.get(name))
                          for name, shape in self.shapes.items()},
            "fingerprints": dict(self.fingerprints),
            "pool_size": self.pool_size,
            "pool_size_text": self.pool_size_text,
        }


def detect_module(copy: Copy, buffer_module: ModuleType) -> Detection:
    """Classify ``copy`` from its imported ``param_and_grad_buffer`` module; never raises."""
    buffer_file = Path(getattr(buffer_module, "__file__", "") or "?")
    def source(qualname: str) -> str:
        return fingerprints.source_of(_resolve(buffer_module, qualname))

    sources, problems = _sources(source)
    sources.update(_reduction_sources(source))
    sources.update(_gate_sources(copy, buffer_file))
    found = _classify(copy, str(buffer_file.parent), sources, problems)
    return _with_pool_size(found, lambda: fingerprints.source_of(
        _resolve(buffer_module, registry.POOL_BUILDER)))


def detect_file(copy: Copy, buffer_file: Path, installed: bool = True) -> Detection:
    """Classify ``copy`` from its ``param_and_grad_buffer.py`` without importing it (no torch).
    ``installed`` False: a folder read from disk, whose label comes only from metadata beside it."""
    try:
        tree = fingerprints.parse_file(buffer_file)
    except fingerprints.SourceUnavailable as exc:
        return _classify(copy, str(buffer_file.parent), {}, [str(exc)], installed)
    sources, problems = _sources(tree.source)
    sources.update(_reduction_sources(tree.source))
    sources.update(_gate_sources(copy, buffer_file))
    found = _classify(copy, str(buffer_file.parent), sources, problems, installed)
    return _with_pool_size(found, lambda: tree.source(registry.POOL_BUILDER))


def _with_pool_size(found: Detection, source: Callable[[], str]) -> Detection:
    """``found`` with the gradient pool's slot count read from the code that builds the pools."""
    try:
        size = double_buffer.gradient_pool_size(source())
    except (AttributeError, KeyError, fingerprints.SourceUnavailable):
        return found
    return replace(found, pool_size=size)


def find_installed(copy: Copy, search_path: list[str] | None = None) -> Path | None:
    """The ``param_and_grad_buffer.py`` that ``import`` would load for ``copy``, if any."""
    relative = Path(*copy.buffer_module.split(".")).with_suffix(".py")
    for entry in sys.path if search_path is None else search_path:
        candidate = Path(entry or ".") / relative
        if candidate.is_file():
            return candidate
    return None


def match(qualname: str, source: str) -> tuple[Shape | None, str | None]:
    """The registry's shape of one function's source, and how it was recognised."""
    printed = fingerprints.fp_code(source)
    for shape in fix_catalogue.SHAPES[qualname]:
        if shape.fingerprint == printed:
            return shape, FINGERPRINT
    for shape in fix_catalogue.SHAPES[qualname]:
        if shape.structure and structure.RECOGNISERS[shape.structure](source):
            return shape, STRUCTURE
    return None, None


def _classify(copy: Copy, path: str, sources: dict[str, str | None], problems: list[str],
              installed: bool = True) -> Detection:
    version = versions.installed_version(copy.distribution, near=_sys_path_entry(copy, path),
                                         fallback=installed)
    prints = {name: fingerprints.fp_code(src) if src is not None else None
              for name, src in sources.items()}
    found = {name: match(name, src) if src is not None else (None, None)
             for name, src in sources.items()}
    shapes = {name: shape for name, (shape, _) in found.items()}
    how = {name: way for name, (_, way) in found.items()}

    def verdict(era: Era | None, reason: str, *notes: str, verified: bool = False
                ) -> Detection:
        return Detection(copy, path, version, shapes, how, prints, era, reason, notes, verified)

    if problems:
        return verdict(None, "cannot read the code to verify its shape: " + "; ".join(problems)
                       + ". Install Megatron-FSDP with its .py sources")
    relied_on = {name for fix in fix_catalogue.FIXES for name in fix.depends_on}
    unknown = [name for name in registry.FUNCTIONS if shapes.get(name) is None
               and name in relied_on]
    if unknown:
        what = "; ".join(f"{registry.short_name(name)} (" + _fingerprint_or_missing(prints[name])
                         + ")" for name in unknown)
        return verdict(None, f"unrecognised code shape in {what}, which the fixes replace or "
                       "rely on: a fork, a backport or a newer release. The double-buffer "
                       "fixes are not applied; report the fingerprints from `mfsdp-hotfix "
                       "status --json` to the mfsdp-hotfix maintainers, or upgrade mfsdp-hotfix")
    known = {name: shape for name, shape in shapes.items()
             if shape is not None and name in registry.FUNCTIONS}
    era = eras.era_of(known[registry.GETTER], known[registry.DRAIN])
    release = versions.final_release(version)
    shipped = verified_releases.RELEASES.get((copy.distribution, release or ""))
    if shipped is None:
        return verdict(era, f"era {era.name} by code shape", _label_note(copy, version))
    if shipped == {name: shape.name for name, shape in known.items()}:
        return verdict(era, f"era {era.name}: verified release {copy.distribution} {version}",
                       verified=True)
    differs = ", ".join(f"{registry.short_name(name)} as in {shipped[name]}, this copy's as in "
                        f"{shape.name}" for name, shape in known.items()
                        if shape.name != shipped[name])
    return verdict(era, f"era {era.name} by code shape ({copy.distribution} {version} with "
                   "code that release did not ship: a backport or a fork)",
                   f"{copy.distribution} {version} shipped {differs}: the code is not what that "
                   "release shipped, so the fixes follow the code's own shapes")


def _fingerprint_or_missing(printed: str | None) -> str:
    return f"fingerprint {printed[:12]}" if printed else "not found"


def _label_note(copy: Copy, version: str | None) -> str:
    kind = versions.label_kind(version)
    if kind == versions.NONE:
        label = f"no {copy.distribution} version metadata"
    elif kind == versions.INVALID:
        label = f"{copy.distribution} version {version!r} is not a PEP 440 label"
    elif kind == versions.RELEASE:
        label = (f"{copy.distribution} {version} is not among the releases this hotfix was "
                 "verified on")
    else:
        label = f"{copy.distribution} {version} is a {kind} label, not a release"
    return f"{label}: judged by code shape alone"


def _describe(qualname: str, shape: Shape | None, how: str | None) -> dict[str, object]:
    """One function's match for status: which shape, how it was recognised, what it implies."""
    if shape is None:
        return {"shape": None, "matched_by": None, "as_shipped_in": None, "implies": None}
    return {"shape": shape.name, "matched_by": how,
            "as_shipped_in": (verified_releases.shipped_in(qualname, shape) if shape.fingerprint
                              else None),
            "implies": shape.implies()}


def refusal(module_name: str, module: ModuleType) -> Detection:
    """The record for a copy that :data:`registry.REFUSED_MODULES` lists by import path."""
    return refused_at(module_name, Path(getattr(module, "__file__", "") or "?").parent,
                      versions.installed_version("megatron-core"))


def refused_at(module_name: str, package_dir: Path, version: str | None) -> Detection:
    """The refusal record of the :data:`registry.REFUSED_MODULES` copy found in ``package_dir``."""
    label, why = registry.REFUSED_MODULES[module_name]
    copy = Copy(label, module_name.rsplit(".", 1)[0], "megatron-core")
    return Detection(copy, str(package_dir), version, {}, {}, {}, None, why)


def _sources(source: Callable[[str], str]) -> tuple[dict[str, str | None], list[str]]:
    """Each target's source; a missing function gives None, unreadable code a problem."""
    sources: dict[str, str | None] = {}
    problems: list[str] = []
    for qualname in registry.FUNCTIONS:
        try:
            sources[qualname] = source(qualname)
        except (AttributeError, KeyError):
            sources[qualname] = None
        except fingerprints.SourceUnavailable as exc:
            sources[qualname] = None
            problems.append(str(exc))
    return sources, problems


def _reduction_sources(source: Callable[[str], str]) -> dict[str, str | None]:
    """The synchronous reductions' sources (:data:`registry.SYNCHRONOUS_REDUCTIONS`) and the
    defect carriers' (:data:`registry.DEFECT_CARRIERS`), None where absent or unreadable: like a
    gate, they decide a fix's need or a defect's presence, never the copy's refusal."""
    sources: dict[str, str | None] = {}
    for qualname in (*registry.SYNCHRONOUS_REDUCTIONS.values(), *registry.DEFECT_CARRIERS):
        try:
            sources[qualname] = source(qualname)
        except (AttributeError, KeyError, fingerprints.SourceUnavailable):
            sources[qualname] = None
    return sources


def _gate_sources(copy: Copy, buffer_file: Path) -> dict[str, str | None]:
    """The gates' sources (:data:`fix_catalogue.GATE_MODULES`), parsed, not imported (the buffer
    module's hook runs before the model module exists). A gate in the copy's own package: None
    where its file or function cannot be read. A gate in megatron-core outside Megatron-FSDP:
    nothing (not in this copy's tree) for a copy outside megatron-core or a tree without that
    package; None where the package is there but the function cannot be read. A gate missing
    from a module that never names its fix's ``gate_absent_unless_named``: nothing."""
    root = Path(_sys_path_entry(copy, str(buffer_file.parent)))
    sources: dict[str, str | None] = {}
    for qualname, where in fix_catalogue.GATE_MODULES.items():
        module = copy.module(where)
        if module is None:
            continue
        path = Path(root, *module.split(".")).with_suffix(".py")
        if not where.startswith(".") and not path.parent.is_dir():
            continue
        try:
            sources[qualname] = fingerprints.parse_file(path).source(qualname)
        except KeyError:
            word = fix_catalogue.GATE_ABSENT_UNLESS_NAMED.get(qualname)
            if word is None or word in path.read_text(errors="replace"):
                sources[qualname] = None
        except fingerprints.SourceUnavailable:
            sources[qualname] = None
    return sources


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


def _sys_path_entry(copy: Copy, package_dir: str) -> str:
    """The ``sys.path`` folder the copy was imported from (where its dist-info lives)."""
    root = Path(package_dir)
    for _ in copy.package.split("."):
        root = root.parent
    return str(root)
