"""Which Megatron-FSDP copies the audit watches, and the hooks it puts on each.

Every copy is audited, whatever the hotfix's verdict on it (patched, refused, unknown shape, or
the hotfix switched off): the audit judges the ordering, not the code's provenance. Its gradient
pools, built by any pool allocator class of ``registry.POOL_ALLOCATORS`` the copy has, get the
slot-reuse rule (``slot_reuse.observe``) and ``MegatronFSDP.finish_grad_sync`` a wrapper after
which the rank file may be rewritten. A copy whose classes are not the shape the rule needs is
listed with a note and ``audited: false`` instead, which the summary reads as UNWATCHED; so is
a Megatron-FSDP v2 model (:mod:`mfsdp_hotfix.v2`), which has no pool to watch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from .. import detection, registry, slot_reuse, v2
from ..happens_before import Mark
from ..patching import Undo, wrap_attribute
from ..registry import Copy
from .observer import MARKER, Observer

SlotReuseRule = slot_reuse.SlotReuse[Mark]


@dataclass
class CopyAudit:
    """One copy: what it is, and what the rule has seen on its gradient pools."""

    package: str
    version: str | None
    era: str | None
    rule: SlotReuseRule | None = None
    note: str | None = None
    watched: list[str] = field(default_factory=list)  # pool allocator classes wrapped
    undo: list[Undo] = field(default_factory=list)

    def as_dict(self, fixes: list[str]) -> dict[str, Any]:
        found: dict[str, Any] = self.rule.summary() if self.rule is not None else {}
        first = found.get("first_unordered") or [None]
        crash = self.rule.crash if self.rule is not None else None
        return {"package": self.package, "version": self.version, "era": self.era or "refused",
                "fixes": fixes, "audited": self.rule is not None,
                "reuses": found.get("reuses", 0), "unordered": found.get("unordered", 0),
                "unseen": found.get("unseen", 0),
                "first_unordered": first[0], "crashed": crash is not None, "crash": crash,
                "watched": self.watched, "grad_pools": found.get("grad_pools"),
                "grad_pools_unordered": found.get("grad_pools_unordered"),
                "unwatched_pools": found.get("unwatched_pools", []), "note": self.note}


def watch_buffer_module(copy: Copy, module: ModuleType, observer: Observer,
                        on_error: Callable[[str, Exception], None]) -> CopyAudit:
    """Classify the copy (for the report) and put the slot-reuse rule on its pools."""
    found = detection.detect_module(copy, module)
    audit = CopyAudit(copy.package, found.version, found.era.name if found.era else None)
    if found.refused:
        audit.note = f"refused by the hotfix: {found.reason}"
    allocators, missing = slot_reuse.watchable(module)
    if not allocators or any(name.startswith("GradReducePipeline.") for name in missing):
        known = ", ".join(spec.cls for spec in registry.POOL_ALLOCATORS)
        audit.note = ("not audited: " + (f"{', '.join(missing)} not found" if missing else
                                         f"no pool allocator class the audit knows ({known})")
                      + " (a code shape the audit does not know)")
        return audit
    audit.watched = [spec.cls for spec in allocators]
    if missing:  # a known class with another shape: its pools show up as unwatched_pools
        audit.note = "; ".join(filter(None, [audit.note, f"{', '.join(missing)} not found: "
                                             "pools of that class are not watched"]))
    audit.rule = slot_reuse.SlotReuse(observer)
    audit.undo.append(slot_reuse.observe(module, audit.rule, MARKER, on_error))
    return audit


def watch_model_module(module: ModuleType, after_step: Callable[[], None],
                       on_error: Callable[[str, Exception], None]) -> Undo | None:
    """Call ``after_step`` after every ``MegatronFSDP.finish_grad_sync`` (None: no such method)."""
    model = getattr(module, "MegatronFSDP", None)
    if model is None or "finish_grad_sync" not in model.__dict__:
        return None

    def finished(wrapped: Any, instance: Any, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        result = wrapped(*args, **kwargs)
        try:
            after_step()
        except Exception as exc:
            on_error("MegatronFSDP.finish_grad_sync", exc)
        return result

    return wrap_attribute(model, "finish_grad_sync", finished, MARKER)


def watch_v2_module(copy: Copy, module: ModuleType, built: Callable[[CopyAudit], None],
                    on_error: Callable[[str, Exception], None]) -> Undo:
    """Call ``built`` with the v2 package's (unwatched) record after every ``FsdpModule`` is
    built: only a v2 job builds one, while megatron-core imports the package in every job."""
    package_dir = Path(module.__file__ or "?").parent
    record = CopyAudit(v2.package(copy), v2.label(copy, package_dir), v2.ERA,
                       note=v2.AUDIT_NOTE)

    def initialised(wrapped: Any, instance: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        result = wrapped(*args, **kwargs)
        try:
            built(record)
        except Exception as exc:
            on_error("FsdpModule.__init__", exc)
        return result

    return wrap_attribute(module.FsdpModule, "__init__", initialised, MARKER)
