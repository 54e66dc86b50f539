"""The configurations a defect hits, declared as data on the fix that repairs it or on the
release defect no fix repairs: what a built ``MegatronFSDP`` is in (the ``matches`` tests read
its config, buffers and groups), what it does as shipped, and the way around it. ``coverage``
decides from a copy's fix states which of them are covered, and refuses the others."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import registry

SHARDED_GRADS = ("optim_grads", "optim_grads_params")


@dataclass(frozen=True)
class Limit:
    """The configurations one fix covers, what they do without it, and the way around it; or,
    declared on a release defect no fix repairs, the configurations that defect hits.

    ``reduction``: a synchronous reduction (:data:`registry.SYNCHRONOUS_REDUCTIONS`) the defect
    needs to reduce; a copy whose code skips every buffer there does not have it.
    ``repaired`` False: no state of the fix makes the configuration right (neither the shipped
    code nor the fixed one): it is refused whatever that state, except with the hotfix off.
    ``shape``: a configuration that stays wrong only where one of the copy's functions has one
    shape (megatron-core 0.14.0's Megatron-FSDP, which sets no ``overwrite_main_grad``), so
    that a defect's "not covered" case is a limit, not only words.
    ``matches`` may read the built model's buffers and groups; where it cannot (a fork's
    model), the model counts as in the configuration.
    ``fix`` and ``defect`` are filled in from the declaration the limit is part of
    (:data:`mfsdp_hotfix.coverage.LIMITS`), never written by hand.
    """

    configuration: str
    matches: Callable[[Any], bool]  # the MegatronFSDP just built -> in this configuration?
    failure: str  # without the fix; "{defect}" is the copy's era defect; "" on a release
    #               defect: its symptom
    workaround: str  # "" on a release defect: its workarounds
    reduction: str | None = None
    repaired: bool = True
    shape: tuple[str, str] | None = None  # (function, shape name): only copies whose function
    #                                       has that shape, or an unknown one, are limited
    fix: str | None = None  # the fix that declares it
    defect: Any = None  # the ReleaseDefect (``defects.py``) no fix repairs that declares it


def fused_core_linears(model: Any) -> bool:
    """Whether the module ``model`` wraps holds a megatron-core ``ColumnParallelLinear`` or
    ``RowParallelLinear`` with ``gradient_accumulation_fusion`` on (none where megatron-core's
    layers are not imported)."""
    layers = sys.modules.get(registry.CORE_LINEAR_MODULE)
    if layers is None:
        return False
    classes = (layers.ColumnParallelLinear, layers.RowParallelLinear)
    return any(isinstance(child, classes) and child.gradient_accumulation_fusion
               for child in model.module.modules())


def sharded(model: Any) -> bool:
    return model.ddp_config.data_parallel_sharding_strategy in SHARDED_GRADS


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


def scales_before_summing_a_shard(model: Any) -> bool:
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


def without_overlap(strategy: str) -> Callable[[Any], bool]:
    return lambda model: (model.ddp_config.data_parallel_sharding_strategy == strategy
                          and not model.ddp_config.overlap_grad_reduce)


def replicated_over_outer_group(model: Any) -> bool:
    """HSDP: a DP-Outer group of 2 or more ranks, replicated over it."""
    return bool(model.dist_index.use_hybrid_fsdp
                and model.ddp_config.outer_dp_sharding_strategy == "no_shard"
                and model.dist_index.get_outer_fsdp_group().size() > 1)


def summed_over_one_shard_rank(model: Any) -> bool:
    """Every gradient buffer is reduced over a DP-Shard group of one rank, unscaled (a SUM:
    calculate_per_token_loss): a second reduction there changes nothing."""
    groups = [group for group in model.param_and_grad_buffer.parameter_groups
              if group.main_grad_buffer is not None]
    return all(group.main_grad_buffer.data_parallel_group.size() == 1
               and group.main_grad_buffer.gradient_scaling_factor is None for group in groups)


def _averaged_over_one_shard_rank(model: Any) -> bool:
    """Every gradient buffer is reduced over a DP-Shard group of one rank, and scaled (an
    average, not calculate_per_token_loss's SUM)."""
    groups = [group for group in model.param_and_grad_buffer.parameter_groups
              if group.main_grad_buffer is not None]
    return all(group.main_grad_buffer.data_parallel_group.size() == 1
               and group.main_grad_buffer.gradient_scaling_factor is not None
               for group in groups)


def _averaged_over_its_group(grads: Any) -> bool:
    """The buffer's reduction scales by one over its group's size (``gradient_scaling_factor``
    times the size is one): an average, whose terms already averaged come back unchanged but
    for rounding, as every rank holds them. NCCL's AVG of ``average_in_collective`` (a factor
    of 1.0 over two or more ranks) is left out: gloo has no AVG, so it was not measured."""
    factor = grads.gradient_scaling_factor
    return factor is not None and math.isclose(factor * grads.data_parallel_group.size(), 1.0)


def reduced_in_place(model: Any) -> str | None:
    """What of ``model`` (a built ``MegatronFSDP``) each gradient synchronisation reduces in
    place so that terms already reduced change, in words (HSDP's DP-Outer all-reduce; ZeRO-1's
    reduce-scatter over two or more ranks; no_shard's all-reduce over two or more ranks where
    it does not average; a one-rank buffer scaled at each reduction); None where a reduction of
    an accumulated buffer is right, or right but for rounding (an average)."""
    if replicated_over_outer_group(model):
        # Over a one-rank DP-Shard group, what an averaging all-reduce over DP-Outer reduces
        # again is the same on every rank, so it comes back unchanged; a SUM doubles it.
        return None if _averaged_over_one_shard_rank(model) else "HSDP's all-reduce over DP-Outer"
    strategy = model.ddp_config.data_parallel_sharding_strategy
    if strategy in SHARDED_GRADS:
        return None
    for group in model.param_and_grad_buffer.parameter_groups:
        grads = group.main_grad_buffer
        if grads is None:
            continue
        if grads.data_parallel_group.size() > 1:
            if strategy == "optim":
                # The reduce-scatter writes the rank's shard only: the rest of the buffer keeps
                # the rank's own terms, which the next reduction adds again.
                return "ZeRO-1's buffer, reduce-scattered over two or more data-parallel ranks"
            if not _averaged_over_its_group(grads):
                return ("no_shard's buffer over two or more data-parallel ranks, not averaged "
                        "over them")
        elif grads.gradient_scaling_factor not in (None, 1.0):
            return "an unsharded buffer scaled at each reduction"
    return None


def hsdp_without_overlap(strategy: str) -> Callable[[Any], bool]:
    """HSDP (:func:`replicated_over_outer_group`) with ``strategy`` and
    ``overlap_grad_reduce=False``, but where the release's second reduction, over a DP-Shard
    group of one rank and unscaled, changes nothing (the hooks' reduction, which carries the
    DP-Outer all-reduce, is then right as shipped; reduce-once leaves it under HSDP)."""
    return lambda model: (without_overlap(strategy)(model) and replicated_over_outer_group(model)
                          and not summed_over_one_shard_rank(model))


UNSHARDED = {"optim": "ZeRO-1 (optim)", "no_shard": "no_shard"}
OVERLAP = "overlap_grad_reduce=True (the default)"
HSDP_FAILURE = (
    "silently wrong gradients with a DP-Outer group of 2 or more ranks: without overlap, "
    "finish_grad_sync reduces unsharded gradients over the DP-Shard group only, and the "
    "all-reduce over DP-Outer is only in the backward "
    "hooks' reduction, which the release runs as well (reducing twice) and reduce-once, like "
    "NVIDIA/Megatron-LM#6357, leaves out (never reduced over DP-Outer)")


def te_partial_cuda_graphs(model: Any) -> bool:
    """Whether a module the built ``model`` wraps carries a megatron-core ``TransformerConfig``
    asking for TransformerEngine's per-layer CUDA graphs: ``cuda_graph_impl="transformer_engine"``,
    or ``external_cuda_graph`` (its older name)."""
    for module in model.module.modules():
        config = getattr(module, "config", None)
        if (getattr(config, "cuda_graph_impl", None) == "transformer_engine"
                or getattr(config, "external_cuda_graph", False) is True):
            return True
    return False
