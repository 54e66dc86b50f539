"""The fixes the hotfix declares: what each repairs, which functions' shapes it rests on or is
gated by, where it stands upstream, and whether a copy with given shapes needs it. The code of
each is in ``mfsdp_hotfix.fixes``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .eras import ORDERED_DRAIN_UPSTREAM, era_of
from .registry import (
    ALL_REDUCE,
    CORE_LINEAR_BACKWARD,
    DRAIN,
    GETTER,
    HOOKS,
    OVERWRITE_SETTER,
    REDUCE_SCATTER,
    ROOT_FORWARD,
    WAIT,
    Shape,
)


@dataclass(frozen=True)
class Fix:
    """One repair, what it replaces or relies on, and where it stands upstream.

    ``depends_on``: functions that must have a known shape for the fix to be applied (or for
    its need to be decided); an unknown shape there refuses the copy, and this fix with it
    (``refused``), while a fix that depends on none of them still applies.
    ``only_unguarded``: needed only where the getter's shape is unguarded.
    ``only_unordered``: not needed where the getter drains and the drain orders the caller's
    stream with at most pool-size units live (era "none": the change proposed upstream).
    ``gate``: a model-module function (:data:`~mfsdp_hotfix.registry.GATES`), or megatron-core's
    fused linear (:data:`~mfsdp_hotfix.registry.CORE_LINEAR_BACKWARD`), whose shape decides the
    need (its :attr:`~mfsdp_hotfix.registry.Shape.needs`); an unknown shape there leaves the fix
    unverified, not the copy refused; a gate whose code is not in the copy's tree at all
    (megatron-core's linear beside megatron-fsdp): not needed.
    ``reductions``: buffer-module functions of which at least one must reduce
    (:attr:`~mfsdp_hotfix.registry.Shape.reduces`) for the fix to be needed; an unknown shape
    there: unverified.
    """

    id: str
    summary: str
    depends_on: tuple[str, ...]
    only_unguarded: bool
    upstream: str
    gate: str | None = None
    reductions: tuple[str, ...] = ()
    only_unordered: bool = False  # not needed where the getter and drain form era "none"


GETTER_GUARD = Fix(
    "getter-guard",
    "main_grad_getter drains the reduce-scatter queue before it allocates a gradient bucket",
    (GETTER, DRAIN, WAIT), True,
    "NVIDIA/Megatron-LM#5222, first released in megatron-core 0.19.0 / megatron-fsdp 0.6.0",
)
ORDERED_DRAIN = Fix(
    "ordered-drain",
    "at most pool-size units live, counting the incoming one; the stream that writes into a "
    "recycled slot waits on the reduce-scatter that last read it",
    (DRAIN, WAIT), False,
    "not fixed upstream as of megatron-core 0.19.2 / megatron-fsdp 0.6.1; proposed as "
    + ORDERED_DRAIN_UPSTREAM,
    only_unordered=True,
)
MISSED_POST_BACKWARD = Fix(
    "missed-post-backward",
    "a ZeRO-3 unit whose post-backward hook never ran (no input needs a gradient, e.g. the "
    "first unit) is released before the next forward instead of keeping one of the 2 slots of "
    "the double-buffered parameter pool ('[fsdp_params] No buffer found for bucket_id')",
    (), False,
    "not fixed as such; megatron-fsdp 0.3.0 / megatron-core 0.16.0 release such a unit's "
    "parameters lazily, which avoids the crash",
    gate=HOOKS,
)
ZERO1_ACCUMULATE = Fix(
    "zero1-accumulate",
    "with unsharded gradients (ZeRO-1 'optim'), fused wgrad accumulation adds each microbatch "
    "into main_grad instead of overwriting it: overwrite_main_grad is left True only for "
    "sharded gradients (optim_grads, optim_grads_params)",
    (), False,
    "NVIDIA/Megatron-LM#6357 (on main; not in a release as of megatron-core 0.19.2 / "
    "megatron-fsdp 0.6.1)",
    gate=OVERWRITE_SETTER,
)
REDUCE_ONCE = Fix(
    "reduce-once",
    "with unsharded gradients (ZeRO-1 'optim', 'no_shard') and overlap_grad_reduce=False, the "
    "backward hooks leave the reduction to finish_grad_sync, which reduces the buffer once",
    (), False,
    "NVIDIA/Megatron-LM#6357 (on main; not in a release as of megatron-core 0.19.2 / "
    "megatron-fsdp 0.6.1)",
    gate=HOOKS, reductions=(REDUCE_SCATTER, ALL_REDUCE),
)
SINGLE_RANK_REDUCE = Fix(
    "single-rank-reduce",
    "with ZeRO-2/3, a gradient buffer whose data-parallel group has one rank (data-parallel size "
    "1; the experts' when expert-parallel equals data-parallel) accumulates its microbatches in "
    "place (fused wgrad adds into it) and is scaled once per step in finish_grad_sync, instead "
    "of being reduced over that one rank in every microbatch",
    (), False,
    "NVIDIA/Megatron-LM#6773 (on main; not in a release as of megatron-core 0.19.2 / "
    "megatron-fsdp 0.6.1)",
    gate=HOOKS,
)
CORE_LINEAR_ACCUMULATE = Fix(
    "core-linear-accumulate",
    "megatron-core's own fused linear (ColumnParallelLinear, RowParallelLinear) adds a "
    "Megatron-FSDP weight's wgrad into main_grad where overwrite_main_grad is False (unsharded "
    "gradients, with zero1-accumulate or NVIDIA/Megatron-LM#6357), as TransformerEngine does",
    (), False,
    "not fixed upstream as of megatron-core 0.19.2 and NVIDIA main d98e8a64dd; proposed as the "
    "upstream change 'megatron-core fused linear: accumulate into a Megatron-FSDP main_grad "
    "unless overwrite_main_grad' (mfsdp-hotfix upstream/core_linear.patch)",
    gate=CORE_LINEAR_BACKWARD,
)
ROOT_FORWARD_HOOKS = Fix(
    "root-forward-hooks",
    "MegatronFSDP.forward calls the root module through its hooks, so the parameters the root "
    "owns are gathered before its forward and the root pre-backward hook fires first in "
    "backward, not when the module registered last runs backward",
    (), False,
    "NVIDIA/Megatron-LM#5808 (for #5789), first released in megatron-core 0.19.0 / "
    "megatron-fsdp 0.6.0",
    gate=ROOT_FORWARD,
)
AUTO_SYNC_STOP = Fix(
    "auto-sync-stop",
    "with model auto-sync (sync_model_each_microbatch=True) and a gradient buffer reduced in "
    "place (ZeRO-1 or no_shard over 2 or more ranks, HSDP), a second microbatch before "
    "zero_grad_buffer stops the step instead of reducing the reduced sum again",
    (), False,
    "not fixed upstream as of megatron-core 0.19.2 / megatron-fsdp 0.6.1 and NVIDIA main: the "
    "release warns that the buffer must be zeroed every microbatch",
)
# The double buffer's fixes (the eras); the others repair release defects outside it and rest on
# none of the double buffer's functions, so they apply to a copy refused for those.
DOUBLE_BUFFER_FIXES = (GETTER_GUARD, ORDERED_DRAIN, MISSED_POST_BACKWARD)
FIXES = (*DOUBLE_BUFFER_FIXES, ZERO1_ACCUMULATE, REDUCE_ONCE, SINGLE_RANK_REDUCE,
         CORE_LINEAR_ACCUMULATE, ROOT_FORWARD_HOOKS, AUTO_SYNC_STOP)
FIX_IDS = frozenset(fix.id for fix in FIXES)


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
