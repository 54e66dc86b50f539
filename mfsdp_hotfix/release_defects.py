"""The defects of released Megatron-FSDP that users are told about (``status``,
docs/RELEASE_DEFECTS.md): where each stands, what triggers it, what it does, what protects from
it, and the fix that repairs it or the function whose shape carries it; and which of them a copy
has."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .fix_catalogue import (
    CORE_LINEAR_ACCUMULATE,
    REDUCE_ONCE,
    ROOT_FORWARD_HOOKS,
    SINGLE_RANK_REDUCE,
    ZERO1_ACCUMULATE,
)
from .registry import BUCKET_REDUCE, Shape


@dataclass(frozen=True)
class ReleaseDefect:
    """A defect of released Megatron-FSDP outside the double buffer that users are told about
    (``status``, docs/RELEASE_DEFECTS.md), and what protects them from it.

    ``fix``: the fix (in :data:`~mfsdp_hotfix.fix_catalogue.FIXES`) that repairs it; the
    releases it affects are the copies whose code needs that fix (a fix's gate shape decides,
    whatever the label), so a copy is judged by its code and the ranges here only say where the
    shipped releases stand.
    ``fix`` None: no fix repairs it; ``carrier`` (in
    :data:`~mfsdp_hotfix.registry.DEFECT_CARRIERS`) is the function whose shape decides, by its
    :attr:`~mfsdp_hotfix.registry.Shape.carries` (an unknown shape: the copy may have it).
    A copy with such a defect is not protected, and a model built in a configuration the
    defect hits is refused (``coverage.py``).
    ``not_covered``: where the defect remains even with the fix (told, not repaired).
    """

    name: str
    fix: str | None
    releases: dict[str, str]  # distribution -> affected release range
    git_trees: str  # how a git install or fork is recognised
    configuration: str  # what triggers it
    symptom: str
    workarounds: tuple[str, ...]  # for users who cannot take the fix, each verified
    upstream: str
    not_covered: str
    carrier: str | None = None  # fix None: the function whose shape has the defect


ZERO1_FUSED_WGRAD_OVERWRITE = ReleaseDefect(
    "zero1-fused-wgrad-overwrite",
    ZERO1_ACCUMULATE.id,
    {"megatron-fsdp": "0.2.0-0.6.1", "megatron-core": "0.15.0-0.19.2"},
    "any copy whose MegatronFSDP.all_gather_and_wait_parameters_ready sets "
    "param.overwrite_main_grad = True (git installs of NVIDIA main before "
    "NVIDIA/Megatron-LM#6357, forks based on those releases)",
    "ZeRO-1 (data_parallel_sharding_strategy='optim') with fused wgrad accumulation "
    "(TransformerEngine fuse_wgrad_accumulation / gradient_accumulation_fusion) and 2 or more "
    "microbatches per optimizer step under no_sync() (Megatron-LM's schedule)",
    "silently wrong gradients: each microbatch's weight gradient overwrites the ones before it "
    "in the unsharded gradient buffer, so the step sees only the last microbatch's weight "
    "gradients",
    ("ZeRO-2 or ZeRO-3 (optim_grads, optim_grads_params)",
     "fused wgrad accumulation off (gradient_accumulation_fusion=False)",
     "one microbatch per optimizer step"),
    ZERO1_ACCUMULATE.upstream,
    "MoE experts through TransformerEngine's op fuser set overwrite_main_grad = True again in "
    "their forward pre-hook: not repaired, use a workaround there. megatron-core's own fused "
    "linear (tensor_parallel/layers.py: the GPT output layer, every layer with "
    "--transformer-impl local) overwrites main_grad whatever overwrite_main_grad says: that is "
    "the release defect core-linear-fused-wgrad-overwrite, repaired by core-linear-accumulate",
)
UNSHARDED_GRADS_REDUCED_TWICE = ReleaseDefect(
    "unsharded-grads-reduced-twice",
    REDUCE_ONCE.id,
    {"megatron-fsdp": "0.3.0-0.6.1", "megatron-core": "0.16.0-0.19.2"},
    "any copy whose MegatronFSDP._register_fsdp_hooks reduces unsharded gradients on "
    "is_last_microbatch or model_auto_sync without asking overlap_grad_reduce and whose "
    "ParamAndGradBuffer.reduce_scatter_gradients or all_reduce_gradients reduces every buffer "
    "(git installs of NVIDIA main before NVIDIA/Megatron-LM#6357, forks based on those "
    "releases)",
    "ZeRO-1 (data_parallel_sharding_strategy='optim'), and from megatron-fsdp 0.5.0 / "
    "megatron-core 0.18.0 no_shard, with overlap_grad_reduce=False, any number of "
    "microbatches, fused wgrad accumulation or not (fully_shard users who turn "
    "overlap_grad_reduce off; Megatron-LM and Megatron-Bridge keep it on wherever they "
    "accumulate)",
    "silently wrong gradients: the backward hooks reduce the unsharded buffer on the last "
    "microbatch and finish_grad_sync reduces it again (ZeRO-1: a second reduce-scatter of the "
    "already reduced buffer; no_shard: a second all-reduce, harmless with averaging but a factor "
    "of the data-parallel size with a SUM reduction, calculate_per_token_loss)",
    ("overlap_grad_reduce=True (the default)",),
    REDUCE_ONCE.upstream,
    "HSDP (a DP-Outer group of 2 or more ranks) with ZeRO-1 or no_shard and "
    "overlap_grad_reduce=False: finish_grad_sync reduces over the DP-Shard group only, and the "
    "DP-Outer all-reduce is only in the hooks' reduction, so reducing once there is wrong too "
    "(NVIDIA main, with NVIDIA/Megatron-LM#6357, as well). Building such a model is refused, "
    "whatever the fix's state; use overlap_grad_reduce=True",
)
CORE_LINEAR_FUSED_WGRAD_OVERWRITE = ReleaseDefect(
    "core-linear-fused-wgrad-overwrite",
    CORE_LINEAR_ACCUMULATE.id,
    {"megatron-core": "0.14.0-0.19.2"},
    "any megatron-core tree whose LinearWithGradAccumulationAndAsyncCommunication.backward "
    "writes a Megatron-FSDP weight's wgrad into main_grad without reading overwrite_main_grad "
    "(NVIDIA main as of d98e8a64dd, forks based on those releases)",
    "ZeRO-1 (data_parallel_sharding_strategy='optim'), and ZeRO-2/3 where a gradient buffer's "
    "data-parallel group has one rank (once single-rank-reduce lets it accumulate), with "
    "gradient_accumulation_fusion on "
    "(Megatron-LM's default) in megatron-core's own linear layers (ColumnParallelLinear, "
    "RowParallelLinear: the GPT output layer of every Megatron-LM model, every layer with "
    "--transformer-impl local) and 2 or more microbatches per optimizer step",
    "silently wrong gradients: each microbatch's weight gradient of those layers overwrites the "
    "ones before it in the unsharded gradient buffer, even where zero1-accumulate (or "
    "NVIDIA/Megatron-LM#6357) has set overwrite_main_grad = False",
    ("fused wgrad accumulation off (gradient_accumulation_fusion=False, Megatron-LM's "
     "--no-gradient-accumulation-fusion)",
     "ZeRO-2 or ZeRO-3 (optim_grads, optim_grads_params)",
     "one microbatch per optimizer step"),
    CORE_LINEAR_ACCUMULATE.upstream,
    "megatron-core 0.14.0, whose Megatron-FSDP sets no overwrite_main_grad, so the fix has "
    "nothing to follow there: its ZeRO-1 through these layers stays wrong, use a workaround",
)
SINGLE_RANK_GRADS = ReleaseDefect(
    "single-rank-grads-reduced-every-microbatch",
    SINGLE_RANK_REDUCE.id,
    {"megatron-fsdp": "0.1.0-0.6.1", "megatron-core": "0.14.0-0.19.2"},
    "any copy whose MegatronFSDP._register_fsdp_hooks reduces every ZeRO-2/3 gradient buffer in "
    "every microbatch whatever the size of its data-parallel group (git installs of NVIDIA main "
    "before NVIDIA/Megatron-LM#6773, forks based on those releases)",
    "ZeRO-2/3 (optim_grads, optim_grads_params) where a gradient buffer's data-parallel group "
    "has one rank: every run with data-parallel size 1 (one GPU, or all of them given to "
    "tensor/pipeline/context parallelism), and the expert gradients of MoE runs whose "
    "expert-parallel size equals their data-parallel size; with 2 or more microbatches per "
    "step, and from one microbatch on megatron-fsdp 0.3.0-0.3.1 / megatron-core 0.16",
    "silently wrong gradients: that buffer is main_grad itself and must add up the step's "
    "microbatches, but fused wgrad overwrites it (only the last microbatch is kept), every "
    "microbatch's reduction over its one rank rescales what it holds (by 1/data-parallel size "
    "for experts), and megatron-fsdp 0.3.0-0.3.1 / megatron-core 0.16 add it onto itself "
    "(it doubles every microbatch); clip-grad hides it until the norm overflows to inf",
    ("one microbatch per step, on megatron-fsdp 0.4.0 and later / megatron-core 0.17 and later",
     "fused wgrad accumulation off (gradient_accumulation_fusion=False), on megatron-fsdp 0.4.0 "
     "and later / megatron-core 0.17 and later, where the scale is 1 (data-parallel size 1, "
     "not experts)"),
    SINGLE_RANK_REDUCE.upstream,
    "HSDP with a one-rank DP-Shard group on megatron-fsdp 0.3.0-0.3.1 / megatron-core 0.16, "
    "whose last reduction still adds the buffer onto itself (unsharded-shard-added-to-itself: "
    "refused)",
)
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
)
UNSHARDED_SHARD_ADDED_TO_ITSELF = ReleaseDefect(
    "unsharded-shard-added-to-itself",
    None,
    {"megatron-fsdp": "0.3.0-0.3.1", "megatron-core": "0.16.0-0.16.1"},
    "any copy whose GradReducePipeline._bucket_group_gradient_reduce has the text these "
    "releases shipped (it adds every reduce-scattered shard onto the gradient buffer, sharded or "
    "not)",
    "ZeRO-1 (optim) with overlap_grad_reduce=True (the default), whatever the number of ranks "
    "and microbatches; and HSDP with ZeRO-2/3 whose DP-Shard group has one rank",
    "silently wrong gradients: the backward hooks reduce-scatter an unsharded gradient buffer "
    "into its own shard and then add the reduced shard onto that shard, so each rank's "
    "gradients are its own unreduced ones plus the mean (or twice the mean, with the double "
    "buffer, whose shard is the bucket itself)",
    ("ZeRO-1 with overlap_grad_reduce=False (with the hotfix: reduce-once leaves the reduction "
     "to finish_grad_sync, which does not add)",
     "ZeRO-2 or ZeRO-3",
     "megatron-fsdp >= 0.4.0 / megatron-core >= 0.17.0, which copy the reduced shard"),
    "fixed in megatron-fsdp 0.4.0 / megatron-core 0.17.0",
    "every configuration it hits: no fix repairs it, and a model built in one is refused "
    "(UnsupportedConfiguration) while the hotfix is loaded",
    carrier=BUCKET_REDUCE,
)
ROOT_HOOKS_SKIPPED = ReleaseDefect(
    "root-hooks-skipped",
    ROOT_FORWARD_HOOKS.id,
    {"megatron-fsdp": "0.1.0-0.5.1", "megatron-core": "0.14.0-0.18.2"},
    "any copy whose MegatronFSDP.forward calls self.module.forward(...) (git installs of NVIDIA "
    "main before NVIDIA/Megatron-LM#5808, forks based on those releases)",
    "a model whose module registered last is not the last to run in forward: no "
    "parameter-free module registered after everything else, e.g. a model ending in a pre-norm "
    "block, or a root-level linear or norm outside every FSDP unit registered after the units "
    "but run before them; and, with ZeRO-3, a root module that owns parameters itself; any "
    "strategy, number of ranks and microbatches",
    "the root pre-backward hook, hung on the module registered last instead of the root, fires "
    "in the middle of backward and marks every gradient as still to be handled: the gradients "
    "of the modules that ran backward before it are handled and reduced again (silently wrong "
    "gradients, e.g. 0.18 off on a 2-unit ZeRO-3 model; 'Found 2 out of 3 parameters ... "
    "pipeline is being reset'; gloo timeouts; with the double buffer unzeroed slot contents or "
    "'No buffer found for bucket_id'); with ZeRO-3 the root's own parameters are used "
    "ungathered (SIGSEGV)",
    ("register a parameter-free module last, run last (e.g. an nn.Identity head applied to "
     "the output), and keep no parameter on the root module itself",
     "megatron-fsdp >= 0.6.0 / megatron-core >= 0.19.0"),
    ROOT_FORWARD_HOOKS.upstream,
    "nothing known",
)
# The first releases after those whose one-rank reduction adds the buffer onto itself
# (megatron-fsdp 0.3.x, megatron-core 0.16), by distribution: from these on one microbatch per
# step keeps a one-rank buffer right (SINGLE_RANK_GRADS's first workaround) and
# single-rank-reduce repairs HSDP too (its not_covered). The audit takes a copy labelled before
# them, or with no release label, as one that may add the buffer onto itself.
SINGLE_RANK_NO_SELF_ADD_FROM = {"megatron-fsdp": "0.4.0", "megatron-core": "0.17.0"}
RELEASE_DEFECTS = (ZERO1_FUSED_WGRAD_OVERWRITE, UNSHARDED_GRADS_REDUCED_TWICE, SINGLE_RANK_GRADS,
                   CORE_LINEAR_FUSED_WGRAD_OVERWRITE, SHARDED_GRADS_SUMMED_UNSCALED,
                   UNSHARDED_SHARD_ADDED_TO_ITSELF, ROOT_HOOKS_SKIPPED)


def defects_of(fixes: Mapping[str, str],
               shapes: Mapping[str, Shape | None] | None = None) -> list[ReleaseDefect]:
    """The release defects a copy has, from the state of each fix (``fixes``: id -> state):
    every one whose fix the copy's code needs, or may need (its shape unknown), whatever the
    hotfix then did about it; and, from the copy's ``shapes``, every one no fix repairs whose
    carrier has it (:func:`carried`: yes or unknown). A carrier absent from ``shapes`` (None:
    the code was not read) decides nothing."""
    return [defect for defect in RELEASE_DEFECTS
            if (carried(defect, shapes or {}) is not False if defect.fix is None else
                fixes.get(defect.fix, "not needed") != "not needed")]


def carried(defect: ReleaseDefect, shapes: Mapping[str, Shape | None]) -> bool | None:
    """Whether a copy with these shapes has ``defect``, one no fix repairs: True, False, or None
    where its carrier's shape is unknown (the copy may have it). False where the carrier was not
    read at all (absent from ``shapes``: a copy refused before its code was read)."""
    assert defect.carrier is not None, f"{defect.name} has a fix; its fix's state decides"
    if defect.carrier not in shapes:
        return False
    shape = shapes[defect.carrier]
    return None if shape is None else defect.name in shape.carries
