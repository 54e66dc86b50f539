"""Which Megatron-FSDP copies the audit watches, and the hooks it puts on each.

Every copy is audited, whatever the hotfix's verdict on it (patched, refused, unknown shape, or
the hotfix switched off): the audit judges the ordering, not the code's provenance. Its gradient
pools get the slot-reuse rule (``slot_reuse.observe``) and ``MegatronFSDP.finish_grad_sync`` a
wrapper after which the rank file may be rewritten. A copy whose classes are not the shape the
rule needs is listed with a note instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from .. import detection, slot_reuse
from ..happens_before import Mark
from ..patching import Undo, wrap_attribute
from ..registry import Copy
from .observer import MARKER, Observer

_NEEDED = (("FixedPoolAllocator", "allocate"), ("FixedPoolAllocator", "free"),
           ("GradReducePipeline", "_bucket_group_gradient_reduce"))

SlotReuseRule = slot_reuse.SlotReuse[Mark]


@dataclass
class CopyAudit:
    """One copy: what it is, and what the rule has seen on its gradient pools."""

    package: str
    version: str | None
    era: str | None
    rule: SlotReuseRule | None = None
    note: str | None = None
    undo: list[Undo] = field(default_factory=list)

    def as_dict(self, fixes: list[str]) -> dict[str, Any]:
        found = self.rule.summary() if self.rule is not None else {}
        first = found.get("first_unordered") or [None]
        crash = self.rule.crash if self.rule is not None else None
        return {"package": self.package, "version": self.version, "era": self.era or "refused",
                "fixes": fixes, "audited": self.rule is not None,
                "reuses": found.get("reuses", 0), "unordered": found.get("unordered", 0),
                "unseen": found.get("unseen", 0),
                "first_unordered": first[0], "crashed": crash is not None, "crash": crash,
                "note": self.note}


def watch_buffer_module(copy: Copy, module: ModuleType, observer: Observer,
                        on_error: Callable[[str, Exception], None]) -> CopyAudit:
    """Classify the copy (for the report) and put the slot-reuse rule on its pools."""
    found = detection.detect_module(copy, module)
    audit = CopyAudit(copy.package, found.version, found.era.name if found.era else None)
    if found.refused:
        audit.note = f"refused by the hotfix: {found.reason}"
    missing = [f"{cls}.{name}" for cls, name in _NEEDED
               if name not in getattr(getattr(module, cls, None), "__dict__", {})]
    if missing:
        audit.note = (f"not audited: {', '.join(missing)} not found (a code shape the audit "
                      "does not know)")
        return audit
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
