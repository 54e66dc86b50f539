"""Which training configurations a copy is covered for, declared as data, and the gate that
refuses the others when a model is built.

Each fix covers the configurations in which its defect strikes. Where a copy needs a fix but
cannot have it (its code shape is ``unverified``, or installing it ``failed``), those
configurations still fail as shipped: building a ``MegatronFSDP`` in one raises
:class:`~mfsdp_hotfix.UnsupportedConfiguration` naming the release, the configuration and the
workaround, instead of the release's assertion later in training. A fix the user ``disabled``
(or ``MFSDP_HOTFIX=0``) is reported uncovered but not enforced: that is how the shipped behaviour
is studied. A release defect no fix repairs (:class:`~mfsdp_hotfix.registry.ReleaseDefect` with
no ``fix``) leaves the configurations it hits uncovered wherever the copy's code has it, or may
have it: building a model in one is refused while the hotfix is loaded. ``status()`` lists every
entry per copy under ``limits``.
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
    """The configurations one fix covers, what they do without it, and the way around it; or
    (``fix`` None) the configurations a release defect no fix repairs hits (``defect``)."""

    fix: str | None
    configuration: str
    matches: Callable[[Any], bool]  # the model's ddp_config -> in this configuration?
    failure: str  # without the fix; "{defect}" is the copy's era defect
    workaround: str
    defect: registry.ReleaseDefect | None = None  # fix None: the defect, decided by its carrier
    hits: Callable[[Any], bool] | None = None  # the built model -> on the defect's code path?
    #                                            (what its ddp_config alone cannot tell)


def _scales_before_summing_a_shard(model: Any) -> bool:
    """Whether a built model reduces a sharded gradient buffer through the branch of the
    release's ``gradient_reduce_preprocessing`` that scales in place and then SUMs: a scaling
    factor (no calculate_per_token_loss), no average_in_collective, and no fused division
    (gradient_reduce_div_fusion off, or a bf16 buffer). That branch is where megatron-fsdp
    0.1.0-0.2.3 scale the buffer's local shard instead of the bucket they reduce. A buffer is
    sharded only over 2 or more data-parallel ranks (``is_data_distributed``)."""
    config = model.ddp_config
    if config.average_in_collective:
        return False
    for group in model.param_and_grad_buffer.parameter_groups:
        buffer = group.main_grad_buffer
        if (buffer is not None and buffer.is_data_distributed
                and buffer.gradient_scaling_factor is not None
                and not (config.gradient_reduce_div_fusion
                         and str(buffer.dtype) != "torch.bfloat16")):
            return True
    return False


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
          hits=lambda model: has_one_rank_gradient_group(model)),
    Limit(None,
          "ZeRO-2/3 (optim_grads, optim_grads_params) over 2 or more data-parallel ranks with "
          "the gradients scaled before a SUM reduction (gradient_reduce_div_fusion=False or a "
          "bf16 gradient buffer, without calculate_per_token_loss or average_in_collective)",
          lambda config: config.data_parallel_sharding_strategy in _SHARDED_GRADS,
          registry.SHARDED_GRADS_SUMMED_UNSCALED.symptom,
          " or ".join(registry.SHARDED_GRADS_SUMMED_UNSCALED.workarounds),
          defect=registry.SHARDED_GRADS_SUMMED_UNSCALED, hits=_scales_before_summing_a_shard),
)


def has_one_rank_gradient_group(model: Any) -> bool:
    """Whether a gradient buffer of ``model`` (a built ``MegatronFSDP``) is reduced over a
    data-parallel group of one rank."""
    return any(group.main_grad_buffer is not None
               and group.main_grad_buffer.data_parallel_group.size() == 1
               for group in model.param_and_grad_buffer.parameter_groups)


# Fix states that leave a configuration failing, and whether building a model in it is refused.
# UNREPAIRED: a release defect no fix repairs, which the copy's code has or may have.
UNREPAIRED = "not repaired"
_UNCOVERED = {"unverified": True, "failed": True, "disabled": False, "off": False,
              "refused": False, UNREPAIRED: True}


def limits(found: Detection, fixes: dict[str, tuple[str, str]],
           enforced: bool = True) -> list[dict[str, Any]]:
    """Per configuration this copy needs a fix for, or a release defect it has hits: whether it
    is covered, and if not why. ``enforced`` False: the hotfix is off, so nothing is refused
    at model construction."""
    out = []
    for limit in LIMITS:
        state, _ = _state(limit, found, fixes)
        if state == "not needed":
            continue
        entry: dict[str, Any] = {"configuration": limit.configuration, "fix": limit.fix,
                                 "covered": state not in _UNCOVERED}
        if limit.defect is not None:
            entry["defect"] = limit.defect.name
        if not entry["covered"]:
            entry.update(failure=_failure(limit, found), workaround=limit.workaround,
                         refused_at_model_construction=_UNCOVERED[state] and enforced)
        out.append(entry)
    return out


def check(found: Detection, fixes: dict[str, tuple[str, str]], ddp_config: Any,
          model: Any = None) -> None:
    """Raise :class:`~mfsdp_hotfix.UnsupportedConfiguration` if the model just built with
    ``ddp_config`` is in a configuration this copy needs an unavailable fix for, or that a
    release defect of its code hits. ``model``: the built model, for a limit whose
    configuration its ddp_config alone cannot tell; without it, or where its code path cannot
    be read (a fork), the model counts as in that configuration."""
    from .errors import UnsupportedConfiguration

    for limit in LIMITS:
        state, why = _state(limit, found, fixes)
        if not (_UNCOVERED.get(state) and limit.matches(ddp_config)):
            continue
        if limit.hits is not None and model is not None:
            try:
                if not limit.hits(model):
                    continue
            except Exception as exc:  # a fork's model: cannot tell, so not covered
                why += f"; whether this model takes that code path could not be read ({exc!r})"
        raise UnsupportedConfiguration(
            f"mfsdp_hotfix: {found.copy.label} {found.copy.distribution} "
            f"{found.version or '(version unknown)'} at {found.module_path} is not covered "
            f"for {limit.configuration}: {why}. "
            f"As shipped this configuration fails ({_failure(limit, found)}). "
            f"Workaround: {limit.workaround}.")


def _state(limit: Limit, found: Detection, fixes: dict[str, tuple[str, str]]
           ) -> tuple[str, str]:
    """The state behind ``limit`` on this copy (its fix's, or :data:`UNREPAIRED` where the
    copy has its release defect or may have it), and why, in words."""
    if limit.defect is None:
        assert limit.fix is not None
        state, reason = fixes.get(limit.fix, ("not needed", ""))
        return state, f"the fix {limit.fix} is {state} ({reason})"
    defect = limit.defect
    assert defect.carrier is not None
    has = registry.carried(defect, found.shapes)
    if has is False:
        return "not needed", ""
    where = registry.short_name(defect.carrier)
    if has is None:
        return UNREPAIRED, (f"its {where} has a code shape the hotfix does not know, so the "
                            f"release defect {defect.name} is not ruled out, and no fix "
                            "repairs it")
    return UNREPAIRED, f"its {where} has the release defect {defect.name}, which no fix repairs"


def _failure(limit: Limit, found: Detection) -> str:
    return limit.failure.format(defect=found.era.defect if found.era else "unknown")
