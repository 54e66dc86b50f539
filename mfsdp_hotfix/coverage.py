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
    # the built model -> is its layout one this limit is about (its groups, not its config)
    layout: Callable[[Any], bool] = lambda model: True


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
    Limit(registry.SINGLE_RANK_REDUCE.id,
          "ZeRO-2/3 (optim_grads, optim_grads_params) with a gradient buffer whose "
          "data-parallel group has one rank (data-parallel size 1; experts with expert-parallel "
          "size equal to the data-parallel size)",
          lambda config: config.data_parallel_sharding_strategy in _SHARDED_GRADS,
          registry.SINGLE_RANK_GRADS.symptom,
          " or ".join(registry.SINGLE_RANK_GRADS.workarounds),
          layout=lambda model: has_one_rank_gradient_group(model)),
)


def has_one_rank_gradient_group(model: Any) -> bool:
    """Whether a gradient buffer of ``model`` (a built ``MegatronFSDP``) is reduced over a
    data-parallel group of one rank."""
    return any(group.main_grad_buffer is not None
               and group.main_grad_buffer.data_parallel_group.size() == 1
               for group in model.param_and_grad_buffer.parameter_groups)


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
    """Raise :class:`~mfsdp_hotfix.UnsupportedConfiguration` if the model just built with
    ``ddp_config`` is in a configuration this copy needs an unavailable fix for (``model``: the
    built model, whose layout a limit may ask about; None: any layout)."""
    from .errors import UnsupportedConfiguration

    for limit in LIMITS:
        state, reason = fixes.get(limit.fix, ("not needed", ""))
        if (_UNCOVERED.get(state) and limit.matches(ddp_config)
                and (model is None or limit.layout(model))):
            raise UnsupportedConfiguration(
                f"mfsdp_hotfix: {found.copy.label} {found.copy.distribution} "
                f"{found.version or '(version unknown)'} at {found.module_path} is not covered "
                f"for {limit.configuration}: the fix {limit.fix} is {state} ({reason}). "
                f"As shipped this configuration fails ({_failure(limit, found)}). "
                f"Workaround: {limit.workaround}.")


def _failure(limit: Limit, found: Detection) -> str:
    return limit.failure.format(defect=found.era.defect if found.era else "unknown")
