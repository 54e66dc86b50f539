"""Fix ``replicated-grad-stats``: a no_shard Megatron-FSDP model's gradient statistics (the norm
clipping uses, the count of zeros) are reduced over the model-parallel group only.

megatron-core 0.14.0-0.17.1 build a Megatron-FSDP model's distributed optimizer with its
gradient statistics reduced over the distributed optimizer's group, data-parallel ranks included.
With sharded gradients each rank holds its own shard and that is right; with no_shard every rank
holds the whole gradient, so the norm counts it once per data-parallel rank (the square root of
the data-parallel size too large) and clipping scales every step too far down.

As megatron-core 0.18.0 does (its facts, not its code), where the model chunks are Megatron-FSDP
with no_shard, the optimizer ``_get_megatron_optimizer_based_on_param_groups`` builds reduces
its statistics over the model-parallel group it was given: after the release's function has set
``grad_stats_parallel_group``, it is set to that group. Every other optimizer is left as built.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .. import guard
from ..fix_catalogue_outside import REPLICATED_GRAD_STATS
from ..patching import Undo, wrap_function

BUILDER = "_get_megatron_optimizer_based_on_param_groups"


def replicated(model_chunks: Any) -> bool:
    """Whether these model chunks are Megatron-FSDP with unsharded (no_shard) gradients."""
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    configs = [getattr(chunk, "ddp_config", None) for chunk in chunks]
    return bool(configs) and all(
        config is not None and getattr(config, "use_megatron_fsdp", False)
        and config.data_parallel_sharding_strategy == "no_shard" for config in configs)


def apply(optimizer_module: ModuleType) -> Undo:
    """Wrap this megatron-core's ``_get_megatron_optimizer_based_on_param_groups`` (its
    ``get_megatron_optimizer`` calls it by that name, with keywords)."""

    def model_parallel_stats(wrapped: Any, instance: Any, args: tuple[Any, ...],
                             kwargs: dict[str, Any]) -> Any:
        optimizer = wrapped(*args, **kwargs)

        def regroup() -> None:
            if optimizer is not None and replicated(kwargs["model_chunks"]):
                optimizer.grad_stats_parallel_group = kwargs["model_parallel_group"]

        guard.attempt(REPLICATED_GRAD_STATS, BUILDER, regroup)
        return optimizer

    return wrap_function(optimizer_module, BUILDER, model_parallel_stats,
                         REPLICATED_GRAD_STATS.id)
