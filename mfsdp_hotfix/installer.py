"""The one idempotent ``install()`` that every entry point reaches, and its inverse.

``install()`` reads the settings once, registers wrapt post-import hooks on each copy's modules
(a hook fires at once for a module that is already imported), and on each import classifies the
copy and applies the fixes its era needs. Everything a hook does is caught: a refusal is one
warning (an error in strict mode), a failure disables that fix and is recorded; the user's import
always completes. Models built before the hotfix was loaded are found and repaired. What the
install did is read back by ``reporting``.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import sys
import threading
from dataclasses import dataclass, field
from importlib import import_module
from types import ModuleType
from typing import Any

import wrapt

from . import (
    built_configs,
    coverage,
    crossrank,
    detection,
    fix_catalogue,
    incidents,
    registry,
    release_defects,
    variables,
)
from . import settings as settings_module
from .__about__ import __version__
from .detection import Detection
from .errors import HotfixRefused, RankMismatch
from .fix_catalogue import Fix
from .patching import Undo, wrap_attribute
from .registry import Copy
from .states import FixState

log = logging.getLogger("mfsdp_hotfix")


REFUSED = FixState.REFUSED
# The incident (:mod:`incidents`) of an import hook that raised: the copy may be left unpatched.
INSTALL_FAILURE = "install"


@dataclass
class CopyRecord:
    """One imported copy: what was detected and what happened to each fix."""

    detection: Detection
    fixes: dict[str, tuple[str, str]] = field(default_factory=dict)  # id -> (FixState, reason)
    undo: dict[str, Undo] = field(default_factory=dict)
    models_repaired: int = 0

    @property
    def applied(self) -> list[str]:
        """Ids of the fixes applied to this copy, in registry order."""
        return [fix_id for fix_id, (state, _) in self.fixes.items() if state == FixState.APPLIED]


@dataclass
class _State:
    settings: settings_module.Settings | None = None
    installed: bool = False
    hooks_registered: bool = False
    records: dict[str, CopyRecord] = field(default_factory=dict)


_lock = threading.RLock()
_state = _State()
WOULD_APPLY = FixState.WOULD_APPLY


def view() -> tuple[settings_module.Settings | None, bool, list[CopyRecord]]:
    """A consistent copy of what the install did (settings, installed, records) for reporting."""
    with _lock:
        _note_failures()
        return _state.settings, _state.installed, list(_state.records.values())


def _note_failures() -> None:
    """A fix that failed at runtime (:mod:`incidents`) switched itself off in this process: it
    is ``failed`` on every copy it was applied to, for status and for the coverage gate."""
    failures = incidents.failures()
    for record in _state.records.values():
        for fix_id, (state, _) in record.fixes.items():
            if state == FixState.APPLIED and fix_id in failures:
                record.fixes[fix_id] = (FixState.FAILED, failures[fix_id])


def install(strict: bool | None = None) -> bool:
    """Patch every Megatron-FSDP copy, now and when imported later. Idempotent.

    ``strict`` overrides ``MFSDP_HOTFIX=strict`` (True: refusals raise :class:`HotfixRefused`).
    Returns whether the hotfix is active (``MFSDP_HOTFIX=0`` keeps it off).
    """
    with _lock:
        if _state.settings is None:
            _state.settings = settings_module.read(known_fixes=fix_catalogue.FIX_IDS)
            for problem in _state.settings.problems:
                if not variables.told(problem):  # the bootstrap wrote it at start already
                    log.warning("%s%s", variables.WARNING, problem)
        settings = _state.settings
        if strict is not None and settings.enabled:
            settings = dataclasses.replace(settings, mode="strict" if strict else "on")
            _state.settings = settings
        if settings.audit_path is not None:
            _arm_audit(settings)
        if _state.installed or not settings.enabled:
            return _state.installed
        _state.installed = True
        if not _state.hooks_registered:
            _state.hooks_registered = True
            for name in _watched_modules():
                wrapt.register_post_import_hook(_on_import, name)
        for name in _watched_modules():
            if name in sys.modules:
                _on_import(sys.modules[name], late=True)
        return True


def _arm_audit(settings: settings_module.Settings) -> None:
    """``MFSDP_HOTFIX_AUDIT``: the audit observes every copy, with the hotfix on or off."""
    try:
        from . import audit

        audit.arm(settings, applied_fingerprint)
    except Exception as exc:
        incidents.report("audit", "arming the audit", exc)


def uninstall() -> bool:
    """Restore every original we replaced that is still ours; returns whether all were."""
    with _lock:
        complete = True
        for record in _state.records.values():
            # last applied, first undone: two fixes may wrap the same method
            for undo in reversed(record.undo.values()):
                complete = undo() and complete
        _state.records.clear()
        _state.installed = False
        return complete


def apply_to(model: Any) -> int:
    """Repair ``MegatronFSDP`` instances built before the hotfix was installed.

    ``model`` is a ``MegatronFSDP``, megatron-core's ``FullyShardedDataParallel`` wrapper or any
    module containing one. Returns the number of parameters whose getter was guarded.
    """
    if not install():
        raise RuntimeError("mfsdp_hotfix is switched off in this process (MFSDP_HOTFIX=0); "
                           "nothing was repaired")
    with _lock:
        found = _model_instances(model)
        if not found:
            raise ValueError(f"{type(model).__qualname__} contains no Megatron-FSDP model of a "
                             "copy the hotfix patched (see mfsdp_hotfix.status())")
        return sum(_repair(record, instance) for record, instance in found)


def _watched_modules() -> list[str]:
    names = [copy.buffer_module for copy in registry.COPIES]
    names += [copy.model_module for copy in registry.COPIES]
    names += [module for copy in registry.COPIES for _, module in _other_targets(copy)]
    return names + list(registry.REFUSED_MODULES)


def _other_targets(copy: Copy) -> list[tuple[str, str]]:
    """``(Fix.target, module)`` of each module of ``copy`` a fix patches besides its buffer and
    model modules (megatron-core's fused linear, for the copy vendored in megatron-core)."""
    found = {fix.target: copy.module(fix.target) for fix in fix_catalogue.FIXES
             if fix.target not in (registry.BUFFER, registry.MODEL)}
    return [(target, module) for target, module in found.items() if module is not None]


def _on_import(module: ModuleType, late: bool = False) -> None:
    """Post-import hook (``late``: the module was imported before ``install()``); never lets
    anything but a strict-mode refusal escape."""
    try:
        with _lock:
            if _state.installed:
                _handle(module, late)
    except HotfixRefused:
        raise
    except Exception as exc:
        incidents.report(INSTALL_FAILURE, f"the import hook of {module.__name__}", exc)


def _handle(module: ModuleType, late: bool) -> None:
    name = module.__name__
    if name in registry.REFUSED_MODULES:
        if name not in _state.records:
            refused = CopyRecord(detection.refusal(name, module))
            _state.records[name] = refused
            _refuse(refused.detection)
        return
    for copy in registry.COPIES:
        others = _other_targets(copy)
        if name in (copy.buffer_module, copy.model_module, *(module for _, module in others)):
            record = _record_for(copy)
            if record is not None:
                # The model module imports the buffer module, never the other way round: when
                # the buffer module's hook runs, the model module may be half-initialised.
                _apply_fixes(record, copy, registry.BUFFER)
                if name == copy.model_module:
                    _apply_fixes(record, copy, registry.MODEL)
                    if late:
                        _repair_existing(record, module)
                # ``import megatron.core`` loads the fused linear before Megatron-FSDP: another
                # module is patched once the copy is detected, from whichever hook runs last
                # (its own runs once its body has run).
                for target, other in others:
                    if other == name or _fully_imported(other):
                        _apply_fixes(record, copy, target)


def _fully_imported(name: str | None) -> bool:
    """Whether module ``name`` is imported and done executing (not half-initialised)."""
    module = sys.modules.get(name) if name else None
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


def _record_for(copy: Copy) -> CopyRecord | None:
    """Detect the copy once per install, from its (already imported) buffer module."""
    existing = _state.records.get(copy.package)
    if existing is not None:
        return existing
    buffer_module = sys.modules.get(copy.buffer_module)
    if buffer_module is None:
        return None
    record = CopyRecord(detection.detect_module(copy, buffer_module))
    _state.records[copy.package] = record
    assert _state.settings is not None
    for fix in fix_catalogue.FIXES:
        record.fixes[fix.id] = fix_state(fix, record.detection, _state.settings)
    if record.detection.refused:
        _refuse(record.detection, record.fixes)
    return record


def fix_state(fix: Fix, found: Detection, settings: settings_module.Settings
              ) -> tuple[str, str]:
    """The state a fix starts in for a copy: one of :data:`reporting.FIX_STATES`. Under
    ``MFSDP_HOTFIX=0`` a fix this copy needs (or may need) is ``off``; one it does not need
    stays ``not needed``, so that what is left unfixed is only what this copy needs."""
    state, reason = _fix_state_if_on(fix, found, settings)
    if not settings.enabled and state != FixState.NOT_NEEDED:
        return FixState.OFF, f"{settings_module.SWITCH}=0"
    return state, reason


def _fix_state_if_on(fix: Fix, found: Detection, settings: settings_module.Settings
                     ) -> tuple[str, str]:
    unknown = [registry.short_name(name) for name in fix.depends_on
               if found.shapes.get(name) is None]
    if unknown:
        return REFUSED, (f"it rests on {', '.join(unknown)}, whose code shape this hotfix does "
                         "not know in this copy, so the fix is not applied")
    if fix.gate is not None and found.shapes and fix.gate not in found.shapes:
        return FixState.NOT_NEEDED, fix.not_needed  # a copy read whole, without the gate's code
    reductions = [found.shapes.get(name) for name in fix.reductions]
    if reductions and all(shape is not None and not shape.reduces for shape in reductions):
        # the defect needs a synchronous reduction that reduces, whatever the gate's shape
        return FixState.NOT_NEEDED, fix.not_needed
    strange = [name for name in ((fix.gate,) if fix.gate else ()) + fix.reductions
               if found.shapes.get(name) is None]
    if strange:
        return FixState.UNVERIFIED, (f"{', '.join(map(registry.short_name, strange))} has a code "
                                     "shape this hotfix does not know, so the fix is not applied")
    if not found.needs(fix):
        return FixState.NOT_NEEDED, fix.not_needed
    if fix.id in settings.disabled_fixes:
        return FixState.DISABLED, f"listed in {settings_module.DISABLED_FIXES}"
    return WOULD_APPLY, f"applied when {found.copy.module(fix.target)} is imported"


def _apply_fixes(record: CopyRecord, copy: Copy, target: str) -> None:
    """Apply, to the module of ``copy`` that ``target`` names (``Fix.target``), each fix that
    patches it and would apply."""
    module = sys.modules[str(copy.module(target))]
    for fix in fix_catalogue.FIXES:
        if fix.target != target or record.fixes[fix.id][0] != WOULD_APPLY:
            continue
        try:
            record.undo[fix.id] = import_module(f"{__package__}.fixes.{fix.module}").apply(module)
        except Exception as exc:
            incidents.report(fix.id, f"installing on {copy.label}", exc)
            record.fixes[fix.id] = (FixState.FAILED, f"{type(exc).__name__}: {exc}")
            continue
        record.fixes[fix.id] = (FixState.APPLIED, fix.summary)
        log.debug("mfsdp_hotfix: applied %s to %s %s", fix.id, copy.label,
                  record.detection.version)
    if target == registry.MODEL and "model-built" not in record.undo:
        record.undo["model-built"] = wrap_attribute(
            module.MegatronFSDP, "__init__", functools.partial(_after_model_init, record),
            "model-built")
        record.undo["config-changed"] = wrap_attribute(
            module.MegatronFSDP, "finish_grad_sync",
            functools.partial(_before_grad_sync, record), "config-changed")


def _after_model_init(record: CopyRecord, wrapped: Any, instance: Any, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> None:
    """Once a model exists: refuse a configuration this copy is not covered for, log the
    process's summary line (once) and compare ranks."""
    wrapped(*args, **kwargs)
    with _lock:
        _note_failures()
    coverage.check(record.detection, record.fixes, instance)
    built_configs.remember(instance)
    global _summary_logged
    if not _summary_logged:
        _summary_logged = True
        log.info("%s", summary())
    assert _state.settings is not None
    try:
        crossrank.check(applied_fingerprint(), _state.settings)
    except RankMismatch:
        raise
    except Exception as exc:  # e.g. a process group whose store cannot set keys
        incidents.report("cross-rank-check", "comparing ranks after MegatronFSDP.__init__", exc)


_summary_logged = False


def _before_grad_sync(record: CopyRecord, wrapped: Any, instance: Any, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> Any:
    """A config changed since the model was built (``built_configs``) is judged again before
    its gradients are synchronised, so a refused configuration is stopped before the optimizer
    step uses them."""
    if built_configs.changed(instance):
        coverage.check(record.detection, record.fixes, instance, config_changed=True)
        built_configs.remember(instance)
    return wrapped(*args, **kwargs)


def _repair_existing(record: CopyRecord, model_module: ModuleType) -> None:
    """Late install: guard the getters of models that were built before the hotfix."""
    model_class = model_module.MegatronFSDP
    built = [obj for obj in gc.get_objects() if issubclass(type(obj), model_class)]
    if not built:
        return
    repaired = sum(_repair(record, instance) for instance in built)
    log.warning("mfsdp_hotfix was loaded after %d %s model(s) had been built; %s. To be sure "
                "every getter is guarded before TransformerEngine captures it, import "
                "mfsdp_hotfix at the top of the training script or rely on the installed "
                "bootstrap (see `mfsdp-hotfix status`).", len(built), record.detection.copy.label,
                f"guarded {repaired} parameter getter(s)" if repaired else
                "their class-level fixes apply to them already")


def _repair(record: CopyRecord, instance: Any) -> int:
    if record.fixes.get(fix_catalogue.GETTER_GUARD.id, ("", ""))[0] != FixState.APPLIED:
        return 0
    from .fixes import getter_guard

    repaired = getter_guard.link(instance)
    record.models_repaired += 1 if repaired else 0
    return repaired


def _model_instances(model: Any) -> list[tuple[CopyRecord, Any]]:
    candidates = [model, getattr(model, "module", None)]
    modules = getattr(model, "modules", None)
    if callable(modules):
        candidates.extend(modules())
    found: list[tuple[CopyRecord, Any]] = []
    for record in _state.records.values():
        model_module = sys.modules.get(record.detection.copy.model_module)
        model_class = getattr(model_module, "MegatronFSDP", None)
        if model_class is None:
            continue
        for candidate in candidates:
            if isinstance(candidate, model_class) and all(c is not candidate for _, c in found):
                found.append((record, candidate))
    return found


def _refuse(found: Detection, fixes: dict[str, tuple[str, str]] | None = None) -> None:
    """Log (strict: raise) the refusal of a copy: what is not patched, the workaround for each
    defect that is left, and the fixes that rest on none of what was refused and still apply."""
    states = {fix_id: state for fix_id, (state, _) in (fixes or {}).items()}
    kept = [fix_id for fix_id, state in states.items() if state == WOULD_APPLY]
    left = [defect for defect in release_defects.defects_of(states, found.shapes)
            if defect.fix is None or states[defect.fix] != WOULD_APPLY]
    message = (f"mfsdp_hotfix: NOT patching {found.copy.label} "
               f"({found.copy.distribution} {found.version or 'version unknown'}) at "
               f"{found.module_path}: {found.reason}. Until this is resolved, run with "
               "fsdp_double_buffer=False to avoid the double-buffer gradient bugs (ZeRO-2/3)."
               + "".join(f" {defect.name} ({defect.configuration}) is not repaired either: "
                         f"{' or '.join(defect.workarounds)}." for defect in left))
    assert _state.settings is not None
    if _state.settings.strict:
        raise HotfixRefused(message + " (MFSDP_HOTFIX=strict)")
    log.warning(message + (f" Still applied: {', '.join(kept)} (they rest on none of that "
                           "code)." if kept else ""))


def summary() -> str:
    """One line: what this process patched, and every imported copy it did not patch (the
    hotfix off, or uninstalled)."""
    parts = []
    for record in view()[2]:
        found = record.detection
        applied = ", ".join(record.applied) or "nothing to apply"
        parts.append(f"{found.copy.label} {found.version or '?'} "
                     + (f"era {found.era.name}: {applied}" if found.era else
                        "REFUSED" + (f" (still applied: {applied})" if record.applied else "")))
    unpatched = imported_unpatched()
    if unpatched:
        settings = _state.settings or settings_module.read(known_fixes=fix_catalogue.FIX_IDS)
        why = (f"{settings_module.SWITCH}=0" if not settings.enabled else
               "the hotfix is not installed in this process")
        for found in unpatched:
            era = f"era {found.era.name}" if found.era else "code shape unknown"
            parts.append(f"{found.copy.label} {found.version or '?'} {era}: nothing applied "
                         f"({why})")
    return "mfsdp_hotfix: " + ("; ".join(parts) or "no Megatron-FSDP copy imported")


def imported_unpatched() -> list[Detection]:
    """Each copy whose buffer module this process imported but the hotfix never handled
    (``MFSDP_HOTFIX=0``, or after ``uninstall()``), detected from its imported code."""
    with _lock:
        handled = set(_state.records)
    return [detection.detect_module(copy, sys.modules[copy.buffer_module])
            for copy in registry.COPIES
            if copy.package not in handled and copy.buffer_module in sys.modules]


def applied_fingerprint() -> dict[str, Any]:
    """The short description of this process's patching that ranks compare."""
    _, installed, records = view()
    return {"mfsdp_hotfix": __version__, "installed": installed,
            "copies": sorted(
                (r.detection.copy.package, r.detection.version or "?",
                 r.detection.era.name if r.detection.era else "refused",
                 ",".join(sorted(r.applied)))
                for r in records)}
