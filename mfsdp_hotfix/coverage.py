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
synchronous reductions' shapes say which strategies reduce twice. A release defect no fix
repairs (:class:`~mfsdp_hotfix.release_defects.ReleaseDefect` with no ``fix``) leaves the
configurations it hits uncovered wherever the copy's code has it, or may have it: building a
model in one is refused while the hotfix is loaded. ``status()`` lists every entry per copy
under ``limits``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import fix_catalogue, registry, release_defects
from .detection import Detection

_SHARDED_GRADS = ("optim_grads", "optim_grads_params")


@dataclass(frozen=True)
class Limit:
    """The configurations one fix covers, what they do without it, and the way around it; or
    (``fix`` None) the configurations a release defect no fix repairs hits (``defect``).

    ``reduction``: a synchronous reduction (:data:`registry.SYNCHRONOUS_REDUCTIONS`) the defect
    needs to reduce; a copy whose code skips every buffer there does not have it.
    ``repaired`` False: no state of ``fix`` makes the configuration right (neither the shipped
    code nor the fixed one): it is refused whatever that state, except with the hotfix off.
    ``matches`` may read the built model's buffers and groups; where it cannot (a fork's
    model), the model counts as in the configuration.
    """

    fix: str | None
    configuration: str
    matches: Callable[[Any], bool]  # the MegatronFSDP just built -> in this configuration?
    failure: str  # without the fix; "{defect}" is the copy's era defect
    workaround: str
    reduction: str | None = None
    repaired: bool = True
    # fix None: the defect, decided by its carrier
    defect: release_defects.ReleaseDefect | None = None


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


def _sharded(model: Any) -> bool:
    return model.ddp_config.data_parallel_sharding_strategy in _SHARDED_GRADS


def has_one_rank_gradient_group(model: Any) -> bool:
    """Whether a gradient buffer of ``model`` (a built ``MegatronFSDP``) is reduced over a
    data-parallel group of one rank."""
    return bool(one_rank_gradient_groups(model))


def one_rank_gradient_groups(model: Any) -> list[Any]:
    """The parameter groups of ``model`` (a built ``MegatronFSDP``) whose gradient buffer is
    reduced over a data-parallel group of one rank (each carries ``is_expert_param``)."""
    return [group for group in model.param_and_grad_buffer.parameter_groups
            if group.main_grad_buffer is not None
            and group.main_grad_buffer.data_parallel_group.size() == 1]


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


def root_hooks_matter(model: Any) -> bool:
    """Whether the root module of ``model`` (a built ``MegatronFSDP``) owns parameters, or its
    module registered last has parameters (so may not be the last to run in forward): where the
    release's root pre-backward hook, hung on that module, can fire in the middle of
    backward."""
    root = model.module
    last = list(root.modules())[-1]
    return any(True for _ in root.parameters(recurse=False)) or any(
        True for _ in last.parameters())


def _without_overlap(strategy: str) -> Callable[[Any], bool]:
    return lambda model: (model.ddp_config.data_parallel_sharding_strategy == strategy
                          and not model.ddp_config.overlap_grad_reduce)


def replicated_over_outer_group(model: Any) -> bool:
    """HSDP: a DP-Outer group of 2 or more ranks, replicated over it."""
    return bool(model.dist_index.use_hybrid_fsdp
                and model.ddp_config.outer_dp_sharding_strategy == "no_shard"
                and model.dist_index.get_outer_fsdp_group().size() > 1)


def _summed_over_one_shard_rank(model: Any) -> bool:
    """Every gradient buffer is reduced over a DP-Shard group of one rank, unscaled (a SUM:
    calculate_per_token_loss): a second reduction there changes nothing."""
    groups = [group for group in model.param_and_grad_buffer.parameter_groups
              if group.main_grad_buffer is not None]
    return all(group.main_grad_buffer.data_parallel_group.size() == 1
               and group.main_grad_buffer.gradient_scaling_factor is None for group in groups)


def _hsdp_without_overlap(strategy: str) -> Callable[[Any], bool]:
    """HSDP (:func:`replicated_over_outer_group`) with ``strategy`` and
    ``overlap_grad_reduce=False``, but where the release's second reduction, over a DP-Shard
    group of one rank and unscaled, changes nothing (the hooks' reduction, which carries the
    DP-Outer all-reduce, is then right as shipped; reduce-once leaves it under HSDP)."""
    return lambda model: (_without_overlap(strategy)(model) and replicated_over_outer_group(model)
                          and not _summed_over_one_shard_rank(model))


_UNSHARDED = {"optim": "ZeRO-1 (optim)", "no_shard": "no_shard"}
_OVERLAP = "overlap_grad_reduce=True (the default)"
_HSDP_FAILURE = (
    "silently wrong gradients with a DP-Outer group of 2 or more ranks: without overlap, "
    "finish_grad_sync reduces unsharded gradients over the DP-Shard group only, and the "
    "all-reduce over DP-Outer is only in the backward "
    "hooks' reduction, which the release runs as well (reducing twice) and reduce-once, like "
    "NVIDIA/Megatron-LM#6357, leaves out (never reduced over DP-Outer)")

LIMITS = (
    Limit(fix_catalogue.GETTER_GUARD.id,
          "ZeRO-2/3 (optim_grads, optim_grads_params) with fsdp_double_buffer=True and fused "
          "wgrad accumulation",
          lambda model: (model.ddp_config.fsdp_double_buffer
                         and model.ddp_config.data_parallel_sharding_strategy in _SHARDED_GRADS),
          "{defect}",
          "set fsdp_double_buffer=False, or upgrade to megatron-core >= 0.19.0 / "
          "megatron-fsdp >= 0.6.0"),
    Limit(fix_catalogue.ORDERED_DRAIN.id,
          "ZeRO-2/3 (optim_grads, optim_grads_params) with fsdp_double_buffer=True",
          lambda model: (model.ddp_config.fsdp_double_buffer
                         and model.ddp_config.data_parallel_sharding_strategy in _SHARDED_GRADS),
          "{defect}",
          "set fsdp_double_buffer=False"),
    Limit(fix_catalogue.MISSED_POST_BACKWARD.id,
          "ZeRO-3 (optim_grads_params) with fsdp_double_buffer=True",
          lambda model: (model.ddp_config.fsdp_double_buffer
                         and model.ddp_config.data_parallel_sharding_strategy
                         == "optim_grads_params"),
          "crash: '[fsdp_params] No buffer found for bucket_id' at the first forward after a "
          "backward, when a unit's inputs need no gradient (the first unit of a model fed "
          "data)",
          "set fsdp_double_buffer=False, or upgrade to megatron-core >= 0.16.0 / "
          "megatron-fsdp >= 0.3.0"),
    Limit(fix_catalogue.ZERO1_ACCUMULATE.id,
          "ZeRO-1 (optim)",
          lambda model: model.ddp_config.data_parallel_sharding_strategy == "optim",
          release_defects.ZERO1_FUSED_WGRAD_OVERWRITE.symptom
          + ", with fused wgrad accumulation and 2 or more microbatches per step",
          " or ".join(release_defects.ZERO1_FUSED_WGRAD_OVERWRITE.workarounds)),
    # Without overlap, finish_grad_sync reduces unsharded gradients over the DP-Shard group
    # only; the DP-Outer all-reduce is in the hooks' reduction alone, which reduces a second
    # time as shipped and not at all with reduce-once (or NVIDIA/Megatron-LM#6357).
    *(Limit(fix_catalogue.REDUCE_ONCE.id,
            f"HSDP with {label} and overlap_grad_reduce=False",
            _hsdp_without_overlap(strategy),
            _HSDP_FAILURE, _OVERLAP,
            reduction=registry.SYNCHRONOUS_REDUCTIONS[strategy], repaired=False)
      for strategy, label in _UNSHARDED.items()),
    *(Limit(fix_catalogue.REDUCE_ONCE.id, f"{label} with overlap_grad_reduce=False",
            _without_overlap(strategy),
            release_defects.UNSHARDED_GRADS_REDUCED_TWICE.symptom,
            " or ".join(release_defects.UNSHARDED_GRADS_REDUCED_TWICE.workarounds),
            reduction=registry.SYNCHRONOUS_REDUCTIONS[strategy])
      for strategy, label in _UNSHARDED.items()),
    Limit(fix_catalogue.SINGLE_RANK_REDUCE.id,
          "ZeRO-2/3 (optim_grads, optim_grads_params) with a gradient buffer whose "
          "data-parallel group has one rank (data-parallel size 1; experts with expert-parallel "
          "size equal to the data-parallel size)",
          lambda model: _sharded(model) and has_one_rank_gradient_group(model),
          release_defects.SINGLE_RANK_GRADS.symptom,
          " or ".join(release_defects.SINGLE_RANK_GRADS.workarounds)),
    Limit(None,
          "ZeRO-2/3 (optim_grads, optim_grads_params) over 2 or more data-parallel ranks with "
          "the gradients scaled before a SUM reduction (gradient_reduce_div_fusion=False or a "
          "bf16 gradient buffer, without calculate_per_token_loss or average_in_collective)",
          lambda model: _sharded(model) and _scales_before_summing_a_shard(model),
          release_defects.SHARDED_GRADS_SUMMED_UNSCALED.symptom,
          " or ".join(release_defects.SHARDED_GRADS_SUMMED_UNSCALED.workarounds),
          defect=release_defects.SHARDED_GRADS_SUMMED_UNSCALED),
    Limit(None,
          "ZeRO-1 (optim) with overlap_grad_reduce=True, or HSDP with ZeRO-2/3 and a one-rank "
          "DP-Shard gradient group",
          lambda model: ((model.ddp_config.data_parallel_sharding_strategy == "optim"
                          and model.ddp_config.overlap_grad_reduce)
                         or (_sharded(model) and model.dist_index.use_hybrid_fsdp
                             and has_one_rank_gradient_group(model))),
          release_defects.UNSHARDED_SHARD_ADDED_TO_ITSELF.symptom,
          " or ".join(release_defects.UNSHARDED_SHARD_ADDED_TO_ITSELF.workarounds),
          defect=release_defects.UNSHARDED_SHARD_ADDED_TO_ITSELF),
    Limit(fix_catalogue.ROOT_FORWARD_HOOKS.id,
          "a root module that owns parameters, or whose module registered last has parameters "
          "(it may not be the last to run in forward)",
          root_hooks_matter,
          release_defects.ROOT_HOOKS_SKIPPED.symptom,
          " or ".join(release_defects.ROOT_HOOKS_SKIPPED.workarounds)),
    Limit(fix_catalogue.CORE_LINEAR_ACCUMULATE.id,
          "ZeRO-1 (optim), or ZeRO-2/3 with a one-rank gradient group, with megatron-core's "
          "own linear layers (ColumnParallelLinear, RowParallelLinear) and "
          "gradient_accumulation_fusion",
          lambda model: ((model.ddp_config.data_parallel_sharding_strategy == "optim"
                          or (_sharded(model) and has_one_rank_gradient_group(model)))
                         and _fused_core_linears(model)),
          release_defects.CORE_LINEAR_FUSED_WGRAD_OVERWRITE.symptom
          + ", with 2 or more microbatches per step",
          " or ".join(release_defects.CORE_LINEAR_FUSED_WGRAD_OVERWRITE.workarounds)),
)

# Fix states that leave a configuration failing, and whether building a model in it is refused.
# UNREPAIRED: a release defect no fix repairs, which the copy's code has or may have.
UNREPAIRED = "not repaired"
_UNCOVERED = {"unverified": True, "failed": True, "disabled": False, "off": False,
              "refused": False, UNREPAIRED: True}


def limits(found: Detection, fixes: dict[str, tuple[str, str]],
           enforced: bool = True) -> list[dict[str, Any]]:
    """Per configuration this copy has a defect in: whether it is covered, and if not why.
    ``enforced`` False: the hotfix is off, so nothing is refused at model construction."""
    out = []
    for limit in LIMITS:
        state, _ = _state(limit, found, fixes)
        if not _has_defect(limit, found, state):
            continue
        entry: dict[str, Any] = {"configuration": limit.configuration, "fix": limit.fix,
                                 "covered": limit.repaired and state not in _UNCOVERED}
        if limit.defect is not None:
            entry["defect"] = limit.defect.name
        if not entry["covered"]:
            entry.update(failure=_failure(limit, found), workaround=limit.workaround,
                         refused_at_model_construction=_refused(limit, state) and enforced)
        out.append(entry)
    return out


def check(found: Detection, fixes: dict[str, tuple[str, str]], model: Any) -> None:
    """Raise :class:`~mfsdp_hotfix.UnsupportedConfiguration` if ``model`` (a MegatronFSDP just
    built) is in a configuration this copy is not covered for and that is refused."""
    from .errors import UnsupportedConfiguration

    for limit in LIMITS:
        state, why = _state(limit, found, fixes)
        if not (_has_defect(limit, found, state) and _refused(limit, state)):
            continue
        try:
            if not limit.matches(model):
                continue
        except Exception as exc:  # a fork's model: cannot tell, so not covered
            why += f"; whether this model is in it could not be read ({exc!r})"
        if not limit.repaired:
            why = (f"no fix repairs it, neither the shipped code nor {limit.fix} is right "
                   f"({limit.fix} is {state} here)")
        raise UnsupportedConfiguration(
            f"mfsdp_hotfix: {found.copy.label} {found.copy.distribution} "
            f"{found.version or '(version unknown)'} at {found.module_path} is not covered "
            f"for {limit.configuration}: {why}. As shipped this configuration fails "
            f"({_failure(limit, found)}). Workaround: {limit.workaround}.")


def _state(limit: Limit, found: Detection, fixes: dict[str, tuple[str, str]]
           ) -> tuple[str | None, str]:
    """The state behind ``limit`` on this copy (its fix's, None where the fix was not judged,
    or :data:`UNREPAIRED` where the copy has its release defect or may have it), and why."""
    if limit.defect is None:
        assert limit.fix is not None
        state, reason = fixes.get(limit.fix, (None, ""))
        return state, f"the fix {limit.fix} is {state} ({reason})"
    defect = limit.defect
    assert defect.carrier is not None
    has = release_defects.carried(defect, found.shapes)
    if has is False:
        return "not needed", ""
    where = registry.short_name(defect.carrier)
    if has is None:
        return UNREPAIRED, (f"its {where} has a code shape the hotfix does not know, so the "
                            f"release defect {defect.name} is not ruled out, and no fix "
                            "repairs it")
    return UNREPAIRED, f"its {where} has the release defect {defect.name}, which no fix repairs"


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
