"""Which training configurations a copy is covered for, declared as data, and the gate that
refuses the others when a model is built.

Each fix covers the configurations in which its defect strikes. Where a copy needs a fix but
cannot have it (its code shape is ``unverified``, or installing it ``failed``), those
configurations still fail as shipped: building a ``MegatronFSDP`` in one raises
:class:`~mfsdp_hotfix.UnsupportedConfiguration` naming the release, the configuration and the
workaround, instead of the release's assertion later in training. A fix the user ``disabled``
(or ``MFSDP_HOTFIX=0``) is reported uncovered but not enforced: that is how the shipped behaviour
is studied. ``status()`` lists every entry per copy under ``limits``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import registry
from .detection import Detection

_SHARDED_GRADS = ("optim_grads", "optim_grads_params")


@dataclass(frozen=True)
class Limit:
    """The configurations one fix covers, what they do without it, and the way around it."""

    fix: str
    configuration: str
    matches: Callable[[Any], bool]  # the model's ddp_config -> in this configuration?
    failure: str  # without the fix; "{defect}" is the copy's era defect
    workaround: str
    # the MegatronFSDP just built -> does it hold what the fix repairs? None: whatever it holds
    in_model: Callable[[Any], bool] | None = None


def _fused_core_linears(model: Any) -> bool:
    """Whether the module ``model`` wraps holds a megatron-core ``ColumnParallelLinear`` or
    ``RowParallelLinear`` with ``gradient_accumulation_fusion`` on (none where megatron-core's
    layers are not imported)."""
    layers = sys.modules.get(registry.CORE_LINEAR_MODULE)
    if layers is None:
        return False
    classes = (layers.ColumnParallelLinear, layers.RowParallelLinear)
    return any(isinstance(child, classes) and child.gradient_accumulation_fusion
               for child in model.module.modules())


LIMITS = (
    Limit(registry.GETTER_GUARD.id,
          "ZeRO-2/3 (optim_grads, optim_grads_params) with fsdp_double_buffer=True and fused "
          "wgrad accumulation",
          lambda config: (config.fsdp_double_buffer
                          and config.data_parallel_sharding_strategy in _SHARDED_GRADS),
          "{defect}",
          "set fsdp_double_buffer=False, or upgrade to megatron-core >= 0.19.0 / "
          "megatron-fsdp >= 0.6.0"),
    Limit(registry.ORDERED_DRAIN.id,
          "ZeRO-2/3 (optim_grads, optim_grads_params) with fsdp_double_buffer=True",
          lambda config: (config.fsdp_double_buffer
                          and config.data_parallel_sharding_strategy in _SHARDED_GRADS),
          "{defect}",
          "set fsdp_double_buffer=False"),
    Limit(registry.MISSED_POST_BACKWARD.id,
          "ZeRO-3 (optim_grads_params) with fsdp_double_buffer=True",
          lambda config: (config.fsdp_double_buffer
                          and config.data_parallel_sharding_strategy == "optim_grads_params"),
          "crash: '[fsdp_params] No buffer found for bucket_id' at the first forward after a "
          "backward, when a unit's inputs need no gradient (the first unit of a model fed "
          "data)",
          "set fsdp_double_buffer=False, or upgrade to megatron-core >= 0.16.0 / "
          "megatron-fsdp >= 0.3.0"),
    Limit(registry.ZERO1_ACCUMULATE.id,
          "ZeRO-1 (optim)",
          lambda config: config.data_parallel_sharding_strategy == "optim",
          registry.ZERO1_FUSED_WGRAD_OVERWRITE.symptom
          + ", with fused wgrad accumulation and 2 or more microbatches per step",
          " or ".join(registry.ZERO1_FUSED_WGRAD_OVERWRITE.workarounds)),
    Limit(registry.REDUCE_ONCE.id,
          "ZeRO-1 (optim) or no_shard with overlap_grad_reduce=False",
          lambda config: (config.data_parallel_sharding_strategy in ("no_shard", "optim")
                          and not config.overlap_grad_reduce),
          registry.UNSHARDED_GRADS_REDUCED_TWICE.symptom,
          " or ".join(registry.UNSHARDED_GRADS_REDUCED_TWICE.workarounds)),
    Limit(registry.CORE_LINEAR_ACCUMULATE.id,
          "ZeRO-1 (optim) with megatron-core's own linear layers (ColumnParallelLinear, "
          "RowParallelLinear) and gradient_accumulation_fusion",
          lambda config: config.data_parallel_sharding_strategy == "optim",
          registry.CORE_LINEAR_FUSED_WGRAD_OVERWRITE.symptom
          + ", with 2 or more microbatches per step",
          " or ".join(registry.CORE_LINEAR_FUSED_WGRAD_OVERWRITE.workarounds),
          in_model=_fused_core_linears),
)

# Fix states that leave a configuration failing, and whether building a model in it is refused.
_UNCOVERED = {"unverified": True, "failed": True, "disabled": False, "off": False,
              "refused": False}


def limits(found: Detection, fixes: dict[str, tuple[str, str]]) -> list[dict[str, Any]]:
    """Per configuration this copy needs a fix for: whether it is covered, and if not why."""
    out = []
    for limit in LIMITS:
        state = fixes.get(limit.fix, ("not needed", ""))[0]
        if state == "not needed":
            continue
        entry: dict[str, Any] = {"configuration": limit.configuration, "fix": limit.fix,
                                 "covered": state not in _UNCOVERED}
        if not entry["covered"]:
            entry.update(failure=_failure(limit, found), workaround=limit.workaround,
                         refused_at_model_construction=_UNCOVERED[state])
        out.append(entry)
    return out


def check(found: Detection, fixes: dict[str, tuple[str, str]], ddp_config: Any,
          model: Any = None) -> None:
    """Raise :class:`~mfsdp_hotfix.UnsupportedConfiguration` if the ``MegatronFSDP`` just built
    with ``ddp_config`` (``model``; None: judged by the config alone) is in a configuration this
    copy needs an unavailable fix for."""
    from .errors import UnsupportedConfiguration

    for limit in LIMITS:
        state, reason = fixes.get(limit.fix, ("not needed", ""))
        if (_UNCOVERED.get(state) and limit.matches(ddp_config)
                and (limit.in_model is None or model is None or limit.in_model(model))):
            raise UnsupportedConfiguration(
                f"mfsdp_hotfix: {found.copy.label} {found.copy.distribution} "
                f"{found.version or '(version unknown)'} at {found.module_path} is not covered "
                f"for {limit.configuration}: the fix {limit.fix} is {state} ({reason}). "
                f"As shipped this configuration fails ({_failure(limit, found)}). "
                f"Workaround: {limit.workaround}.")


def _failure(limit: Limit, found: Detection) -> str:
    return limit.failure.format(defect=found.era.defect if found.era else "unknown")
