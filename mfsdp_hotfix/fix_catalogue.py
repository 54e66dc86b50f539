"""The fixes the hotfix declares, each whole in one entry: what it repairs, the copy module its
code patches, which functions' shapes it rests on or is gated by, why a copy may not need it,
where it stands upstream, the release defect it repairs (declared beside it), the configurations
it covers (its limits) and what happens if it fails. The code of each is in
``mfsdp_hotfix.fixes``; nothing else names a fix (the installer, the coverage gate, ``status``
and the release defects read it from here)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from . import registry
from .defects import ReleaseDefect
from .eras import ORDERED_DRAIN_UPSTREAM, era_of
from .fix_catalogue_outside import OUTSIDE_THE_BUFFER
from .fix_type import Fix as Fix
from .fix_type import OnFailure as OnFailure
from .limits import (
    HSDP_FAILURE,
    OVERLAP,
    UNSHARDED,
    Limit,
    fused_core_linears,
    has_one_rank_gradient_group,
    hsdp_without_overlap,
    reduced_in_place,
    sharded,
    without_overlap,
)
from .registry import (
    ALL_REDUCE,
    BUFFER,
    CORE_LINEAR_BACKWARD,
    CORE_LINEAR_MODULE,
    DRAIN,
    GETTER,
    HOOKS,
    MODEL,
    OVERWRITE_SETTER,
    REDUCE_SCATTER,
    SYNCHRONOUS_REDUCTIONS,
    WAIT,
    Shape,
)


def _zero23_double_buffer(model: object) -> bool:
    config = model.ddp_config  # type: ignore[attr-defined]
    return bool(config.fsdp_double_buffer) and sharded(model)

GETTER_GUARD = Fix(
    "getter-guard",
    "main_grad_getter drains the reduce-scatter queue before it allocates a gradient bucket",
    "getter_guard", MODEL,
    "its main_grad_getter already drains before it allocates, as NVIDIA/Megatron-LM#5222 and "
    "ROCm/Megatron-LM#146 do",
    "NVIDIA/Megatron-LM#5222, first released in megatron-core 0.19.0 / megatron-fsdp 0.6.0",
    depends_on=(GETTER, DRAIN, WAIT), only_unguarded=True,
    limits=(Limit("ZeRO-2/3 (optim_grads, optim_grads_params) with fsdp_double_buffer=True and "
                  "fused wgrad accumulation", _zero23_double_buffer, "{defect}",
                  "set fsdp_double_buffer=False, or upgrade to megatron-core >= 0.19.0 / "
                  "megatron-fsdp >= 0.6.0"),),
)
ORDERED_DRAIN = Fix(
    "ordered-drain",
    "at most pool-size units live, counting the incoming one; the stream that writes into a "
    "recycled slot waits on the reduce-scatter that last read it",
    "ordered_drain", BUFFER,
    "its getter drains before it allocates and its drain waits on the caller's stream (the one "
    "that writes the recycled slot), keeping at most pool-size units live: "
    + ORDERED_DRAIN_UPSTREAM,
    "not fixed upstream as of megatron-core 0.19.2 / megatron-fsdp 0.6.1; proposed as "
    + ORDERED_DRAIN_UPSTREAM,
    depends_on=(DRAIN, WAIT), only_unordered=True,
    limits=(Limit("ZeRO-2/3 (optim_grads, optim_grads_params) with fsdp_double_buffer=True",
                  _zero23_double_buffer, "{defect}", "set fsdp_double_buffer=False"),),
)
MISSED_POST_BACKWARD = Fix(
    "missed-post-backward",
    "a ZeRO-3 unit whose post-backward hook never ran (no input needs a gradient, e.g. the "
    "first unit) is released before the next forward gathers, instead of keeping one of the 2 "
    "slots of the double-buffered parameter pool: '[fsdp_params] No buffer found for "
    "bucket_id' up to megatron-fsdp 0.2.3; from 0.3.0 to 0.5.1 its lazy release lets the next "
    "all-gather recycle its slot, and the backward's weights are another unit's",
    "missed_post_backward", MODEL,
    "its post-forward releases the parameters of a unit whose post-backward hook did not run, "
    "or its parameter pool keeps each bucket in its own slot",
    "not fixed as such; megatron-fsdp 0.3.0 / megatron-core 0.16.0 release such a unit's "
    "parameters lazily, which avoids the crash, and megatron-fsdp 0.6.0 / megatron-core "
    "0.19.0 keep each bucket in its own slot of the pool, which avoids the wrong gradients",
    gate=HOOKS,
    limits=(Limit("ZeRO-3 (optim_grads_params) with fsdp_double_buffer=True",
                  lambda model: (model.ddp_config.fsdp_double_buffer
                                 and model.ddp_config.data_parallel_sharding_strategy
                                 == "optim_grads_params"),
                  "when a unit's inputs need no gradient (the first unit of a model fed data): "
                  "crash '[fsdp_params] No buffer found for bucket_id' at the first forward "
                  "after a backward (megatron-fsdp 0.1.0-0.2.3), or silently wrong gradients "
                  "from the second forward on (0.3.0-0.5.1)",
                  "set fsdp_double_buffer=False, or upgrade to megatron-core >= 0.19.0 / "
                  "megatron-fsdp >= 0.6.0"),),
)

ZERO1_UPSTREAM = ("NVIDIA/Megatron-LM#6357 (on main; not in a release as of megatron-core "
                  "0.19.2 / megatron-fsdp 0.6.1)")
ZERO1_FUSED_WGRAD_OVERWRITE = ReleaseDefect(
    "zero1-fused-wgrad-overwrite",
    "zero1-accumulate",
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
    ZERO1_UPSTREAM,
    "",
)
ZERO1_ACCUMULATE = Fix(
    "zero1-accumulate",
    "with unsharded gradients (ZeRO-1 'optim'), fused wgrad accumulation adds each microbatch "
    "into main_grad instead of overwriting it: overwrite_main_grad is left True only for "
    "sharded gradients (optim_grads, optim_grads_params)",
    "zero1_accumulate", MODEL,
    "it sets overwrite_main_grad only where gradients are sharded (NVIDIA/Megatron-LM#6357), "
    "or not at all",
    ZERO1_UPSTREAM,
    gate=OVERWRITE_SETTER, defect=ZERO1_FUSED_WGRAD_OVERWRITE,
    limits=(Limit("ZeRO-1 (optim)",
                  lambda model: model.ddp_config.data_parallel_sharding_strategy == "optim",
                  ZERO1_FUSED_WGRAD_OVERWRITE.symptom
                  + ", with fused wgrad accumulation and 2 or more microbatches per step",
                  " or ".join(ZERO1_FUSED_WGRAD_OVERWRITE.workarounds)),),
    on_failure=OnFailure.STOP,
    stop_because="let fused wgrad overwrite the ZeRO-1 gradients of every later microbatch",
)

REDUCE_ONCE_UPSTREAM = ZERO1_UPSTREAM
UNSHARDED_GRADS_REDUCED_TWICE = ReleaseDefect(
    "unsharded-grads-reduced-twice",
    "reduce-once",
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
    REDUCE_ONCE_UPSTREAM,
    "HSDP (a DP-Outer group of 2 or more ranks) with ZeRO-1 or no_shard and "
    "overlap_grad_reduce=False: finish_grad_sync reduces over the DP-Shard group only, and the "
    "DP-Outer all-reduce is only in the hooks' reduction, so reducing once there is wrong too "
    "(NVIDIA main, with NVIDIA/Megatron-LM#6357, as well). Building such a model is refused, "
    "whatever the fix's state; use overlap_grad_reduce=True",
)
# Without overlap, finish_grad_sync reduces unsharded gradients over the DP-Shard group only;
# the DP-Outer all-reduce is in the hooks' reduction alone, which reduces a second time as
# shipped and not at all with reduce-once (or NVIDIA/Megatron-LM#6357).
REDUCE_ONCE = Fix(
    "reduce-once",
    "with unsharded gradients (ZeRO-1 'optim', 'no_shard') and overlap_grad_reduce=False, the "
    "backward hooks leave the reduction to finish_grad_sync, which reduces the buffer once",
    "reduce_once", BUFFER,
    "its backward hooks reduce unsharded gradients only with overlap_grad_reduce "
    "(NVIDIA/Megatron-LM#6357), or its finish_grad_sync reduces none of them without overlap "
    "(the hooks' reduction is their only one)",
    REDUCE_ONCE_UPSTREAM,
    gate=HOOKS, reductions=(REDUCE_SCATTER, ALL_REDUCE), defect=UNSHARDED_GRADS_REDUCED_TWICE,
    limits=(*(Limit(f"HSDP with {label} and overlap_grad_reduce=False",
                    hsdp_without_overlap(strategy), HSDP_FAILURE, OVERLAP,
                    reduction=SYNCHRONOUS_REDUCTIONS[strategy], repaired=False)
              for strategy, label in UNSHARDED.items()),
            *(Limit(f"{label} with overlap_grad_reduce=False", without_overlap(strategy),
                    UNSHARDED_GRADS_REDUCED_TWICE.symptom,
                    " or ".join(UNSHARDED_GRADS_REDUCED_TWICE.workarounds),
                    reduction=SYNCHRONOUS_REDUCTIONS[strategy])
              for strategy, label in UNSHARDED.items())),
)

SINGLE_RANK_UPSTREAM = ("NVIDIA/Megatron-LM#6773 (on main; not in a release as of megatron-core "
                        "0.19.2 / megatron-fsdp 0.6.1)")
SINGLE_RANK_GRADS = ReleaseDefect(
    "single-rank-grads-reduced-every-microbatch",
    "single-rank-reduce",
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
    SINGLE_RANK_UPSTREAM,
    "HSDP with a one-rank DP-Shard group on megatron-fsdp 0.3.0-0.3.1 / megatron-core 0.16, "
    "whose last reduction still adds the buffer onto itself (unsharded-shard-added-to-itself: "
    "refused)",
)
SINGLE_RANK_REDUCE = Fix(
    "single-rank-reduce",
    "with ZeRO-2/3, a gradient buffer whose data-parallel group has one rank (data-parallel size "
    "1; the experts' when expert-parallel equals data-parallel) accumulates its microbatches in "
    "place (fused wgrad adds into it) and is scaled once per step in finish_grad_sync, instead "
    "of being reduced over that one rank in every microbatch",
    "single_rank_reduce", MODEL,
    "its backward hooks reduce a gradient buffer whose data-parallel group has one rank once per "
    "step, not every microbatch (NVIDIA/Megatron-LM#6773)",
    SINGLE_RANK_UPSTREAM,
    gate=HOOKS, defect=SINGLE_RANK_GRADS,
    limits=(Limit("ZeRO-2/3 (optim_grads, optim_grads_params) with a gradient buffer whose "
                  "data-parallel group has one rank (data-parallel size 1; experts with "
                  "expert-parallel size equal to the data-parallel size)",
                  lambda model: sharded(model) and has_one_rank_gradient_group(model),
                  SINGLE_RANK_GRADS.symptom, " or ".join(SINGLE_RANK_GRADS.workarounds)),),
    on_failure=OnFailure.STOP,
    stop_because="train on wrong gradients of every one-rank gradient buffer",
)

CORE_LINEAR_UPSTREAM = (
    "not fixed upstream as of megatron-core 0.19.2 and NVIDIA main d98e8a64dd; proposed as the "
    "upstream change 'megatron-core fused linear: accumulate into a Megatron-FSDP main_grad "
    "unless overwrite_main_grad' (mfsdp-hotfix upstream/core_linear.patch)")
CORE_LINEAR_FUSED_WGRAD_OVERWRITE = ReleaseDefect(
    "core-linear-fused-wgrad-overwrite",
    "core-linear-accumulate",
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
    CORE_LINEAR_UPSTREAM,
    # megatron-core 0.14.0's Megatron-FSDP sets no overwrite_main_grad: the fix adds where the
    # weight's gradient buffer is not distributed, as TransformerEngine does.
    "",
)
CORE_LINEAR_ACCUMULATE = Fix(
    "core-linear-accumulate",
    "megatron-core's own fused linear (ColumnParallelLinear, RowParallelLinear) adds a "
    "Megatron-FSDP weight's wgrad into main_grad where overwrite_main_grad is False (unsharded "
    "gradients, with zero1-accumulate or NVIDIA/Megatron-LM#6357), as TransformerEngine does",
    "core_linear_accumulate", CORE_LINEAR_MODULE,
    "no megatron-core fused linear is in this copy's tree (megatron-core's own copy carries the "
    "fix), or its Megatron-FSDP wgrad reads overwrite_main_grad",
    CORE_LINEAR_UPSTREAM,
    gate=CORE_LINEAR_BACKWARD, defect=CORE_LINEAR_FUSED_WGRAD_OVERWRITE,
    limits=(Limit("ZeRO-1 (optim), or ZeRO-2/3 with a one-rank gradient group, with "
                  "megatron-core's own linear layers (ColumnParallelLinear, RowParallelLinear) "
                  "and gradient_accumulation_fusion",
                  lambda model: ((model.ddp_config.data_parallel_sharding_strategy == "optim"
                                  or (sharded(model) and has_one_rank_gradient_group(model)))
                                 and fused_core_linears(model)),
                  CORE_LINEAR_FUSED_WGRAD_OVERWRITE.symptom
                  + ", with 2 or more microbatches per step",
                  " or ".join(CORE_LINEAR_FUSED_WGRAD_OVERWRITE.workarounds)),),
    on_failure=OnFailure.STOP,
    stop_because="let megatron-core's fused linear overwrite the ZeRO-1 gradients of every "
                 "later microbatch",
)


def _auto_sync_in_place(model: object) -> bool:
    return bool(model.model_auto_sync  # type: ignore[attr-defined]
                and reduced_in_place(model) is not None)


AUTO_SYNC_STOP = Fix(
    "auto-sync-stop",
    "with model auto-sync (sync_model_each_microbatch=True) and a gradient buffer reduced in "
    "place (ZeRO-1 over 2 or more ranks, no_shard over 2 or more without an average, HSDP), a "
    "second microbatch before zero_grad_buffer stops the step instead of reducing the reduced "
    "sum again",
    "auto_sync_stop", MODEL,
    "never: every release and NVIDIA main reduce such a buffer in place",
    "not fixed upstream as of megatron-core 0.19.2 / megatron-fsdp 0.6.1 and NVIDIA main: the "
    "release warns that the buffer must then be zeroed every microbatch",
    limits=(Limit("model auto-sync (sync_model_each_microbatch=True) with a gradient buffer "
                  "reduced in place (ZeRO-1 over 2 or more ranks, no_shard over 2 or more "
                  "without an average, HSDP)",
                  _auto_sync_in_place,
                  "silently wrong gradients with 2 or more microbatches per step: each "
                  "microbatch's synchronisation reduces the microbatches already reduced again",
                  "accumulate under no_sync() with sync_model_each_microbatch=False "
                  "(Megatron-LM's protocol), or one microbatch per optimizer step"),),
)
# The double buffer's fixes (the eras); the others repair release defects outside it and rest on
# none of the double buffer's functions, so they apply to a copy refused for those.
DOUBLE_BUFFER_FIXES = (GETTER_GUARD, ORDERED_DRAIN, MISSED_POST_BACKWARD)
FIXES = (*DOUBLE_BUFFER_FIXES, ZERO1_ACCUMULATE, REDUCE_ONCE, SINGLE_RANK_REDUCE,
         CORE_LINEAR_ACCUMULATE, *OUTSIDE_THE_BUFFER, AUTO_SYNC_STOP)
FIX_IDS = frozenset(fix.id for fix in FIXES)
# Every gate: where it is read (``Copy.module``) and its known shapes, the registry's and those a
# fix declares.
GATE_MODULES = {**registry.GATE_MODULES,
                **{fix.gate: fix.gate_module for fix in FIXES if fix.gate and fix.gate_module}}
SHAPES = {**registry.SHAPES,
          **{fix.gate: fix.gate_shapes for fix in FIXES if fix.gate and fix.gate_shapes}}
GATE_ABSENT_UNLESS_NAMED = {fix.gate: fix.gate_absent_unless_named for fix in FIXES
                            if fix.gate and fix.gate_absent_unless_named}
# Each fix's limits, marked with the fix that declares them.
FIX_LIMITS = tuple(replace(limit, fix=fix.id) for fix in FIXES for limit in fix.limits)


def needed(fix: Fix, shapes: Mapping[str, Shape]) -> bool:
    """Whether a copy with these (known) shapes needs ``fix`` (a gated fix: its gate's shape)."""
    if fix.reductions and not any(name in shapes and shapes[name].reduces
                                  for name in fix.reductions):
        return False
    if fix.gate is not None:
        return fix.gate in shapes and fix.id in shapes[fix.gate].needs
    if fix.only_unordered and era_of(shapes[GETTER], shapes[DRAIN]).name == "none":
        return False
    return not fix.only_unguarded or shapes[GETTER].guarded is False
