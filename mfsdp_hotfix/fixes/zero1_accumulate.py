"""Fix ``zero1-accumulate``: fused wgrad accumulation must add, not overwrite, where the
gradient buffer is not sharded.

TransformerEngine's fused wgrad accumulation writes each weight gradient straight into
``param.main_grad``: it overwrites when ``param.overwrite_main_grad`` is True, else it adds.
megatron-fsdp 0.2.0-0.6.1 / megatron-core 0.15-0.19 set the attribute True for every parameter
after each all-gather (``MegatronFSDP.all_gather_and_wait_parameters_ready``), whatever the
sharding strategy. With sharded gradients (ZeRO-2/3) that is right: each microbatch's wgrad lands
in a fresh bucket that is reduce-scattered and accumulated into the shard. With ZeRO-1
(``optim``) ``main_grad`` is a view of the one unsharded buffer that gathers the microbatches of
an optimizer step under ``no_sync()``, so each microbatch erases the ones before it.

After the release's own method has set the attribute, it is set back to False for the
parameters it just marked unless the strategy shards gradients, which is what NVIDIA/Megatron-LM
#6357 does in that method. #6357's one reduction of unsharded buffers without
``overlap_grad_reduce`` repairs another release defect, and is the fix ``reduce-once``
(:mod:`.reduce_once`); the rest of it (FSDP units for ZeRO-1/2 in megatron-core's adapter, the
post-forward hook kept to ZeRO-3) changes how ZeRO-1/2 communicate, not what a gradient adds up
to, and is not taken.

If this fix raises, the step is stopped (:class:`~mfsdp_hotfix.UnsupportedConfiguration`): going
on would overwrite the gradients again, silently, for the rest of the job.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .. import guard
from ..fix_catalogue import ZERO1_ACCUMULATE
from ..patching import Undo, wrap_attribute

SHARDED_GRADIENTS = ("optim_grads", "optim_grads_params")


def accumulates(model: Any, params: Any) -> int:
    """Let fused wgrad add into ``main_grad`` for ``params`` of ``model`` when its gradients are
    not sharded; returns how many parameters were changed."""
    if model.data_parallel_sharding_strategy in SHARDED_GRADIENTS:
        return 0
    changed = 0
    for param in params:
        if getattr(param, "overwrite_main_grad", False) is True:
            param.overwrite_main_grad = False
            changed += 1
    return changed


def apply(model_module: ModuleType) -> Undo:
    """Wrap ``MegatronFSDP.all_gather_and_wait_parameters_ready`` of this copy."""

    def after_all_gather(wrapped: Any, instance: Any, args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> Any:
        result = wrapped(*args, **kwargs)
        guard.attempt(ZERO1_ACCUMULATE, "all_gather_and_wait_parameters_ready",
                      lambda: accumulates(instance, list(
                          kwargs["params"] if "params" in kwargs else args[0])))
        return result

    return wrap_attribute(model_module.MegatronFSDP, "all_gather_and_wait_parameters_ready",
                          after_all_gather, ZERO1_ACCUMULATE.id)
