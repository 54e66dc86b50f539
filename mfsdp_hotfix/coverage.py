"""Which training configurations a copy is covered for, declared as data, and the gate that
refuses the others when a model is built.

Each fix covers the configurations in which its defect strikes. Where a copy needs a fix but
cannot have it (its code shape is ``unverified``, or installing it ``failed``), those
configurations still fail as shipped: building a ``MegatronFSDP`` in one raises
:class:`~mfsdp_hotfix.UnsupportedConfiguration` naming the release, the configuration and the
workaround, instead of the release's assertion later in training. A fix the user ``disabled``
(or ``MFSDP_HOTFIX=0``) is reported uncovered but not enforced: that is how the shipped behaviour
is studied. A configuration no fix makes right (HSDP with unsharded gradients and
``overlap_grad_reduce=False``: wrong as shipped and with reduce-once alike) is refused whatever
the fix's state, except under ``MFSDP_HOTFIX=0``. Only copies with the defect are limited: the
synchronous reductions' shapes say which strategies reduce twice. ``status()`` lists every entry
per copy under ``limits``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import registry
from .detection import Detection

_SHARDED_GRADS = ("optim_grads", "optim_grads_params")


@dataclass(frozen=True)
class Limit:
    """The configurations one fix covers, what they do without it, and the way around it.

    ``reduction``: a synchronous reduction (:data:`registry.SYNCHRONOUS_REDUCTIONS`) the defect
    needs to reduce; a copy whose code skips every buffer there does not have it.
    ``repaired`` False: no state of ``fix`` makes the configuration right (neither the shipped
    code nor the fixed one): it is refused whatever that state, except with the hotfix off.
    """

    fix: str
    configuration: str
    matches: Callable[[Any], bool]  # the MegatronFSDP just built -> in this configuration?
    failure: str  # without the fix; "{defect}" is the copy's era defect
    workaround: str
    reduction: str | None = None
    repaired: bool = True


def _without_overlap(strategy: str) -> Callable[[Any], bool]:
    return lambda model: (model.ddp_config.data_parallel_sharding_strategy == strategy
                          and not model.ddp_config.overlap_grad_reduce)


def _hsdp_without_overlap(strategy: str) -> Callable[[Any], bool]:
    """HSDP (a DP-Outer group of 2 or more ranks, replicated over it) with ``strategy`` and
    ``overlap_grad_reduce=False``."""
    return lambda model: (_without_overlap(strategy)(model) and model.dist_index.use_hybrid_fsdp
                          and model.ddp_config.outer_dp_sharding_strategy == "no_shard"
                          and model.dist_index.get_outer_fsdp_group().size() > 1)


_UNSHARDED = {"optim": "ZeRO-1 (optim)", "no_shard": "no_shard"}
_OVERLAP = "overlap_grad_reduce=True (the default)"
_HSDP_FAILURE = (
    "silently wrong gradients with a DP-Outer group of 2 or more ranks: without overlap, "
    "finish_grad_sync reduces unsharded gradients over the DP-Shard group only, and the "
    "all-reduce over DP-Outer is only in the backward "
    "hooks' reduction, which the release runs as well (reducing twice) and reduce-once, like "
    "NVIDIA/Megatron-LM#6357, leaves out (never reduced over DP-Outer)")

LIMITS = (
    Limit(registry.GETTER_GUARD.id,
          "ZeRO-2/3 (optim_grads, optim_grads_params) with fsdp_double_buffer=True and fused "
          "wgrad accumulation",
          lambda model: (model.ddp_config.fsdp_double_buffer
                         and model.ddp_config.data_parallel_sharding_strategy in _SHARDED_GRADS),
          "{defect}",
          "set fsdp_double_buffer=False, or upgrade to megatron-core >= 0.19.0 / "
          "megatron-fsdp >= 0.6.0"),
    Limit(registry.ORDERED_DRAIN.id,
          "ZeRO-2/3 (optim_grads, optim_grads_params) with fsdp_double_buffer=True",
          lambda model: (model.ddp_config.fsdp_double_buffer
                         and model.ddp_config.data_parallel_sharding_strategy in _SHARDED_GRADS),
          "{defect}",
          "set fsdp_double_buffer=False"),
    Limit(registry.MISSED_POST_BACKWARD.id,
          "ZeRO-3 (optim_grads_params) with fsdp_double_buffer=True",
          lambda model: (model.ddp_config.fsdp_double_buffer
                         and model.ddp_config.data_parallel_sharding_strategy
                         == "optim_grads_params"),
          "crash: '[fsdp_params] No buffer found for bucket_id' at the first forward after a "
          "backward, when a unit's inputs need no gradient (the first unit of a model fed "
          "data)",
          "set fsdp_double_buffer=False, or upgrade to megatron-core >= 0.16.0 / "
          "megatron-fsdp >= 0.3.0"),
    Limit(registry.ZERO1_ACCUMULATE.id,
          "ZeRO-1 (optim)",
          lambda model: model.ddp_config.data_parallel_sharding_strategy == "optim",
          registry.ZERO1_FUSED_WGRAD_OVERWRITE.symptom
          + ", with fused wgrad accumulation and 2 or more microbatches per step",
          " or ".join(registry.ZERO1_FUSED_WGRAD_OVERWRITE.workarounds)),
    # Without overlap, finish_grad_sync reduces unsharded gradients over the DP-Shard group
    # only; the DP-Outer all-reduce is in the hooks' reduction alone, which reduces a second
    # time as shipped and not at all with reduce-once (or NVIDIA/Megatron-LM#6357).
    *(Limit(registry.REDUCE_ONCE.id,
            f"HSDP with {label} and overlap_grad_reduce=False",
            _hsdp_without_overlap(strategy),
            _HSDP_FAILURE, _OVERLAP,
            reduction=registry.SYNCHRONOUS_REDUCTIONS[strategy], repaired=False)
      for strategy, label in _UNSHARDED.items()),
    *(Limit(registry.REDUCE_ONCE.id, f"{label} with overlap_grad_reduce=False",
            _without_overlap(strategy),
            registry.UNSHARDED_GRADS_REDUCED_TWICE.symptom,
            " or ".join(registry.UNSHARDED_GRADS_REDUCED_TWICE.workarounds),
            reduction=registry.SYNCHRONOUS_REDUCTIONS[strategy])
      for strategy, label in _UNSHARDED.items()),
)

# Fix states that leave a configuration failing, and whether building a model in it is refused.
_UNCOVERED = {"unverified": True, "failed": True, "disabled": False, "off": False,
              "refused": False}


def limits(found: Detection, fixes: dict[str, tuple[str, str]]) -> list[dict[str, Any]]:
    """Per configuration this copy has a defect in: whether it is covered, and if not why."""
    out = []
    for limit in LIMITS:
        state = fixes.get(limit.fix, (None, ""))[0]
        if not _has_defect(limit, found, state):
            continue
        entry: dict[str, Any] = {"configuration": limit.configuration, "fix": limit.fix,
                                 "covered": limit.repaired and state not in _UNCOVERED}
        if not entry["covered"]:
            entry.update(failure=_failure(limit, found), workaround=limit.workaround,
                         refused_at_model_construction=_refused(limit, state))
        out.append(entry)
    return out


def check(found: Detection, fixes: dict[str, tuple[str, str]], model: Any) -> None:
    """Raise :class:`~mfsdp_hotfix.UnsupportedConfiguration` if ``model`` (a MegatronFSDP just
    built) is in a configuration this copy is not covered for and that is refused."""
    from .errors import UnsupportedConfiguration

    for limit in LIMITS:
        state, reason = fixes.get(limit.fix, (None, ""))
        if (_has_defect(limit, found, state) and _refused(limit, state)
                and limit.matches(model)):
            why = (f"the fix {limit.fix} is {state} ({reason})" if limit.repaired else
                   f"no fix repairs it, neither the shipped code nor {limit.fix} is right "
                   f"({limit.fix} is {state} here)")
            raise UnsupportedConfiguration(
                f"mfsdp_hotfix: {found.copy.label} {found.copy.distribution} "
                f"{found.version or '(version unknown)'} at {found.module_path} is not covered "
                f"for {limit.configuration}: {why}. As shipped this configuration fails "
                f"({_failure(limit, found)}). Workaround: {limit.workaround}.")


def _has_defect(limit: Limit, found: Detection, state: str | None) -> bool:
    """Whether this copy has the defect ``limit`` is about: its fix is judged for the copy
    (and needed or possibly needed, for a defect the fix repairs), and the synchronous
    reduction it needs does reduce, or its shape is unknown."""
    if state is None or (limit.repaired and state == "not needed"):
        return False
    if limit.reduction is None:
        return True
    shape = found.shapes.get(limit.reduction)
    return shape is None or bool(shape.reduces)


def _refused(limit: Limit, state: str | None) -> bool:
    if not limit.repaired:
        return state != "off"
    return _UNCOVERED.get(state or "", False)


def _failure(limit: Limit, found: Detection) -> str:
    return limit.failure.format(defect=found.era.defect if found.era else "unknown")
