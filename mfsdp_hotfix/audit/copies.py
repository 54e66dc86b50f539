"""Which Megatron-FSDP copies the audit watches, and the hooks it puts on each.

Every copy is audited, whatever the hotfix's verdict on it (patched, refused, unknown shape, or
the hotfix switched off): the audit judges the ordering, not the code's provenance. Its gradient
pools, built by any pool allocator class of ``gradient_pools.POOL_ALLOCATORS`` the copy has, get the
slot-reuse rule (``slot_reuse.observe``) and ``MegatronFSDP.finish_grad_sync`` a wrapper after
which the rank file may be rewritten. A copy whose classes are not the shape the rule needs is
listed with a note and ``audited: false`` instead, which the summary reads as UNWATCHED; so is
a Megatron-FSDP v2 model (:mod:`mfsdp_hotfix.v2`), which has no pool to watch.

A job whose gradient buffers have a data-parallel group of one rank reuses no slot, so the rule
has nothing to check there; what matters for it is the size-one group defect
(``release_defects.SINGLE_RANK_GRADS``). So each model's ``forward`` and ``zero_grad_buffer`` are
watched too: at its first forward the model's one-rank ZeRO-2/3 gradient buffers are counted
(:class:`OneRankGrads`), and its forwards with gradients between two ``zero_grad_buffer`` calls
are the microbatches it accumulates, on which the defect depends.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from .. import (
    coverage,
    detection,
    fix_catalogue,
    gradient_pools,
    limits,
    registry,
    release_defects,
    slot_reuse,
    v2,
    versions,
)
from ..happens_before import Mark
from ..patching import Undo, wrap_attribute, wrap_attributes
from ..registry import Copy
from .observer import MARKER, Observer

SlotReuseRule = slot_reuse.SlotReuse[Mark]
# The configuration (ZeRO-2/3) in which a one-rank gradient buffer has the size-one group defect.
_SIZE_ONE = next(limit for limit in coverage.LIMITS
                 if limit.fix == fix_catalogue.SINGLE_RANK_REDUCE.id)


@dataclass
class OneRankGrads:
    """A copy's ZeRO-2/3 gradient buffers whose data-parallel group has one rank, over the
    models it built, and the most microbatches one of those models accumulated."""

    dense: int = 0
    expert: int = 0  # parameter groups of expert parameters (``is_expert_param``)
    hybrid: int = 0  # of all those, HSDP's (a DP-Shard group of one rank)
    microbatches: int = 0
    # per model seen: forwards with gradients since its last zero_grad_buffer
    _forwards: weakref.WeakKeyDictionary[Any, int] = field(
        default_factory=weakref.WeakKeyDictionary)
    _one_rank: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)

    def forwarded(self, model: Any) -> None:
        """A forward with gradients of ``model`` (a ``MegatronFSDP``): one more microbatch."""
        self.seen(model)
        self._forwards[model] = forwards = self._forwards[model] + 1
        if model in self._one_rank:
            self.microbatches = max(self.microbatches, forwards)

    def zeroed(self, model: Any) -> None:
        """``model.zero_grad_buffer()``: its next forward starts an accumulation."""
        self.seen(model)
        self._forwards[model] = 0

    def seen(self, model: Any) -> None:
        """Count ``model``'s one-rank gradient buffers, once (also for a model whose forward
        does not go through ``MegatronFSDP.forward``: from its ``finish_grad_sync``)."""
        if model in self._forwards:
            return
        self._forwards[model] = 0
        if not _SIZE_ONE.matches(model):
            return
        groups = limits.one_rank_gradient_groups(model)
        if not groups:
            return
        self._one_rank.add(model)
        experts = sum(1 for group in groups if group.is_expert_param)
        self.dense += len(groups) - experts
        self.expert += experts
        if model.param_and_grad_buffer.dist_index.use_hybrid_fsdp:
            self.hybrid += len(groups)

    def as_dict(self, defect: str, may_self_add: bool) -> dict[str, Any] | None:
        if not self.dense + self.expert:
            return None
        return {"dense": self.dense, "expert": self.expert, "hsdp": self.hybrid,
                "microbatches": self.microbatches, "defect": defect,
                "may_self_add": may_self_add}


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
    # its code has the size-one group defect: "yes", "no", or "unknown" (hooks' shape unknown)
    single_rank_defect: str = "unknown"
    may_self_add: bool = True  # its one-rank reduction may add the buffer onto itself
    one_rank: OneRankGrads = field(default_factory=OneRankGrads)

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
                "unwatched_pools": found.get("unwatched_pools", []), "note": self.note,
                "one_rank_grads": self.one_rank.as_dict(self.single_rank_defect,
                                                        self.may_self_add)}


def watch_buffer_module(copy: Copy, module: ModuleType, observer: Observer,
                        on_error: Callable[[str, Exception], None]) -> CopyAudit:
    """Classify the copy (for the report) and put the slot-reuse rule on its pools."""
    found = detection.detect_module(copy, module)
    audit = CopyAudit(copy.package, found.version, found.era.name if found.era else None)
    audit.single_rank_defect, audit.may_self_add = single_rank_defect(copy, found)
    if found.refused:
        audit.note = f"refused by the hotfix: {found.reason}"
    allocators, missing = slot_reuse.watchable(module)
    if not allocators or any(name.startswith("GradReducePipeline.") for name in missing):
        known = ", ".join(spec.cls for spec in gradient_pools.POOL_ALLOCATORS)
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


def single_rank_defect(copy: Copy, found: detection.Detection) -> tuple[str, bool]:
    """Whether the copy's code has the size-one group defect ("yes", "no", "unknown"), and
    whether its one-rank reduction may add the buffer onto itself (unless its code has a known
    shape and its release label is ``release_defects.SINGLE_RANK_NO_SELF_ADD_FROM`` or later)."""
    if found.shapes.get(registry.HOOKS) is None:
        return "unknown", True
    if not found.needs(fix_catalogue.SINGLE_RANK_REDUCE):
        return "no", True
    from packaging.version import Version

    release = versions.final_release(found.version)
    first = release_defects.SINGLE_RANK_NO_SELF_ADD_FROM.get(copy.distribution)
    return "yes", release is None or first is None or Version(release) < Version(first)


def watch_model_module(module: ModuleType, after_step: Callable[[], None],
                       record: Callable[[], CopyAudit | None],
                       on_error: Callable[[str, Exception], None]) -> Undo | None:
    """Call ``after_step`` after every ``MegatronFSDP.finish_grad_sync``, and tell the copy's
    ``record()`` of every forward with gradients and ``zero_grad_buffer`` of a model (None: no
    ``MegatronFSDP.finish_grad_sync``)."""
    import torch

    model = getattr(module, "MegatronFSDP", None)
    if model is None or "finish_grad_sync" not in model.__dict__:
        return None

    def finished(wrapped: Any, instance: Any, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        result = wrapped(*args, **kwargs)
        try:
            found = record()
            if found is not None:
                found.one_rank.seen(instance)
            after_step()
        except Exception as exc:
            on_error("MegatronFSDP.finish_grad_sync", exc)
        return result

    def told(name: str, tell: Callable[[OneRankGrads, Any], None]) -> Any:
        def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
            try:
                found = record()
                if found is not None and (name != "forward" or torch.is_grad_enabled()):
                    tell(found.one_rank, instance)
            except Exception as exc:
                on_error(f"MegatronFSDP.{name}", exc)
            return wrapped(*args, **kwargs)

        return wrapper

    return wrap_attributes([(model, "finish_grad_sync", finished),
                            (model, "forward", told("forward", OneRankGrads.forwarded)),
                            (model, "zero_grad_buffer",
                             told("zero_grad_buffer", OneRankGrads.zeroed))], MARKER)


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
