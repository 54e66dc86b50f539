"""The defects of released Megatron-FSDP that users are told about (``status``,
docs/RELEASE_DEFECTS.md): those a fix repairs, declared beside their fix (``fix_catalogue``), and
those no fix repairs, declared here with the function whose shape carries each and the
configurations each hits (refused at model construction); and which of them a copy has."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from .defects import ReleaseDefect as ReleaseDefect
from .defects import carried as carried
from .fix_catalogue import CORE_LINEAR_FUSED_WGRAD_OVERWRITE as CORE_LINEAR_FUSED_WGRAD_OVERWRITE
from .fix_catalogue import FIXES
from .fix_catalogue import SINGLE_RANK_GRADS as SINGLE_RANK_GRADS
from .fix_catalogue import UNSHARDED_GRADS_REDUCED_TWICE as UNSHARDED_GRADS_REDUCED_TWICE
from .fix_catalogue import ZERO1_FUSED_WGRAD_OVERWRITE as ZERO1_FUSED_WGRAD_OVERWRITE
from .limits import (
    Limit,
    has_one_rank_gradient_group,
    scales_before_summing_a_shard,
    sharded,
    te_partial_cuda_graphs,
)
from .registry import BUCKET_REDUCE, HOOKS, Shape
from .states import FixState

SHARDED_GRADS_SUMMED_UNSCALED = ReleaseDefect(
    "sharded-grads-summed-unscaled",
    None,
    {"megatron-fsdp": "0.1.0-0.2.3", "megatron-core": "0.14.0-0.15.3"},
    "any copy whose GradReducePipeline._bucket_group_gradient_reduce has the text these "
    "releases shipped (it pre-scales gbuf.data, not the bucket it reduces)",
    "ZeRO-2/3 (optim_grads, optim_grads_params) over 2 or more data-parallel ranks with the "
    "gradients scaled before a SUM reduction: gradient_reduce_div_fusion=False, or a bf16 "
    "gradient buffer (bf16 gradients with grad_reduce_in_fp32=False); not with "
    "calculate_per_token_loss=True or average_in_collective=True (nothing is scaled then), nor "
    "with fp32 gradient buffers and gradient_reduce_div_fusion=True (scaled in the collective)",
    "silently wrong gradients: the scale 1/data-parallel size is applied to the rank's "
    "accumulated gradient shard instead of the bucket that is reduce-scattered, which is "
    "summed unscaled: gradients data-parallel size times too large, and wrong beyond a "
    "constant factor when accumulated over microbatches",
    ("calculate_per_token_loss=True (the release scales nothing; the loss carries the "
     "normalisation)",
     "fp32 gradient reduction (grad_reduce_in_fp32=True) with gradient_reduce_div_fusion=True, "
     "the default",
     "megatron-fsdp >= 0.3.0 / megatron-core >= 0.16.0, which scale the bucket they reduce"),
    "fixed in megatron-fsdp 0.3.0 / megatron-core 0.16.0",
    "every configuration it hits: no fix repairs it, and a model built in one is refused "
    "(UnsupportedConfiguration) while the hotfix is loaded",
    carrier=BUCKET_REDUCE,
    limits=(Limit("ZeRO-2/3 (optim_grads, optim_grads_params) over 2 or more data-parallel ranks "
                  "with the gradients scaled before a SUM reduction "
                  "(gradient_reduce_div_fusion=False or a bf16 gradient buffer, without "
                  "calculate_per_token_loss or average_in_collective)",
                  lambda model: sharded(model) and scales_before_summing_a_shard(model),
                  "", ""),),
)
UNSHARDED_SHARD_ADDED_TO_ITSELF = ReleaseDefect(
    "unsharded-shard-added-to-itself",
    None,
    {"megatron-fsdp": "0.3.0-0.3.1", "megatron-core": "0.16.0-0.16.1"},
    "any copy whose GradReducePipeline._bucket_group_gradient_reduce has the text these "
    "releases shipped (it adds every reduce-scattered shard onto the gradient buffer, sharded or "
    "not)",
    "ZeRO-1 (optim) with overlap_grad_reduce=True (the default), whatever the number of ranks "
    "and microbatches; and HSDP whose DP-Shard group has one rank, with ZeRO-2/3, or with "
    "ZeRO-1 whatever the overlap",
    "silently wrong gradients: the backward hooks reduce-scatter an unsharded gradient buffer "
    "into its own shard and then add the reduced shard onto that shard, so each rank's "
    "gradients are its own unreduced ones plus the mean (or twice the mean, with the double "
    "buffer, whose shard is the bucket itself)",
    ("ZeRO-1 with overlap_grad_reduce=False, without HSDP (with the hotfix: reduce-once leaves "
     "the reduction to finish_grad_sync, which does not add)",
     "ZeRO-2 or ZeRO-3",
     "megatron-fsdp >= 0.4.0 / megatron-core >= 0.17.0, which copy the reduced shard"),
    "fixed in megatron-fsdp 0.4.0 / megatron-core 0.17.0",
    "every configuration it hits: no fix repairs it, and a model built in one is refused "
    "(UnsupportedConfiguration) while the hotfix is loaded",
    carrier=BUCKET_REDUCE,
    limits=(Limit("ZeRO-1 (optim) with overlap_grad_reduce=True, or HSDP with ZeRO-1/2/3 and a "
                  "one-rank DP-Shard gradient group",
                  lambda model: ((model.ddp_config.data_parallel_sharding_strategy == "optim"
                                  and model.ddp_config.overlap_grad_reduce)
                                 or ((sharded(model) or model.ddp_config
                                      .data_parallel_sharding_strategy == "optim")
                                     and model.dist_index.use_hybrid_fsdp
                                     and has_one_rank_gradient_group(model))),
                  "", ""),),
)

# The first releases after those whose one-rank reduction adds the buffer onto itself
# (megatron-fsdp 0.3.x, megatron-core 0.16), by distribution: from these on one microbatch per
# step keeps a one-rank buffer right (SINGLE_RANK_GRADS's first workaround) and
# single-rank-reduce repairs HSDP too (its not_covered). The audit takes a copy labelled before
# them, or with no release label, as one that may add the buffer onto itself.
SINGLE_RANK_NO_SELF_ADD_FROM = {"megatron-fsdp": "0.4.0", "megatron-core": "0.17.0"}
TE_PARTIAL_CUDA_GRAPHS = ReleaseDefect(
    "te-partial-cuda-graphs",
    None,
    {"megatron-fsdp": "0.1.0-0.6.1", "megatron-core": "0.14.0-0.19.2"},
    "every copy: no release prepares Megatron-FSDP's hooks for TransformerEngine's graph "
    "capture (NVIDIA main neither)",
    "TransformerEngine's per-layer (partial) CUDA graphs with Megatron-FSDP: "
    "TransformerConfig.cuda_graph_impl='transformer_engine' (Megatron-LM's --cuda-graph-impl "
    "transformer_engine), or external_cuda_graph=True",
    "numerical divergence and illegal memory access: TransformerEngine's "
    "make_graphed_callables captures Megatron-FSDP's forward hooks, which wrap its backward "
    "handlers, in the wrong phase (upstream's report; not measured here, it needs a GPU)",
    ("cuda_graph_impl='none' (no CUDA graphs)",
     "cuda_graph_impl='full_iteration' (full-iteration CUDA graphs, the kind upstream supports "
     "with Megatron-FSDP)"),
    "NVIDIA/Megatron-LM#4231 and #4232 (open; they also need a TransformerEngine change)",
    "every configuration it hits: no fix repairs it, and a model built in one is refused "
    "(UnsupportedConfiguration) while the hotfix is loaded",
    carrier=HOOKS, refused_when_built=True,
    limits=(Limit("TransformerEngine's per-layer CUDA graphs (cuda_graph_impl="
                  "'transformer_engine' or external_cuda_graph)", te_partial_cuda_graphs,
                  "", ""),),
)
UNREPAIRED_DEFECTS = (SHARDED_GRADS_SUMMED_UNSCALED, UNSHARDED_SHARD_ADDED_TO_ITSELF,
                      TE_PARTIAL_CUDA_GRAPHS)
RELEASE_DEFECTS = (*(fix.defect for fix in FIXES if fix.defect is not None), *UNREPAIRED_DEFECTS)
# The limits of the defects no fix repairs, marked with their defect ("" failure or workaround:
# the defect's symptom, its workarounds).
DEFECT_LIMITS = tuple(
    replace(limit, defect=defect, failure=limit.failure or defect.symptom,
            workaround=limit.workaround or " or ".join(defect.workarounds))
    for defect in UNREPAIRED_DEFECTS for limit in defect.limits)


def defects_of(fixes: Mapping[str, str],
               shapes: Mapping[str, Shape | None] | None = None) -> list[ReleaseDefect]:
    """The release defects a copy has, from the state of each fix (``fixes``: id -> state):
    every one whose fix the copy's code needs, or may need (its shape unknown), whatever the
    hotfix then did about it; and, from the copy's ``shapes``, every one no fix repairs whose
    carrier has it (:func:`carried`: yes or unknown). A carrier absent from ``shapes`` (None:
    the code was not read) decides nothing."""
    return [defect for defect in RELEASE_DEFECTS
            if (carried(defect, shapes or {}) is not False if defect.fix is None else
                fixes.get(defect.fix, FixState.NOT_NEEDED) != FixState.NOT_NEEDED)]

