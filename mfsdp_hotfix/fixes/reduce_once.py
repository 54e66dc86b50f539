"""Fix ``reduce-once``: unsharded gradients are reduced once per optimizer step, not twice.

With unsharded gradients (ZeRO-1 ``optim``, ``no_shard``) and ``overlap_grad_reduce=False``,
``finish_grad_sync`` reduces the whole gradient buffer synchronously (``start_grad_sync``: a
reduce-scatter, or an all-reduce for no_shard). The releases' backward hooks
(``MegatronFSDP._register_fsdp_hooks``: ``_process_post_backward_gradients`` and
``_root_post_backward``) also reduce it, through ``GradReducePipeline.reduce_gradients``, whenever
``is_last_microbatch or model_auto_sync``, whatever ``overlap_grad_reduce`` says: the buffer is
reduced twice, and the second reduction starts from the first one's result.

NVIDIA/Megatron-LM#6357 makes the hooks' condition ``overlap_grad_reduce and (is_last_microbatch
or model_auto_sync)`` for unsharded gradients, so that without overlap the hooks leave the
pipeline alone (no ``reduce_gradients``, and no ``reset`` after it). The hooks are closures; the
pipeline they call is the class this fix wraps: ``reduce_gradients`` and ``reset`` do nothing for
a buffer of unsharded gradients without overlap. Nothing else calls them in that configuration
(``synchronize_gradient_reduce`` resets the pipeline only with overlap), so this is exactly the
upstream condition.

Only for the strategies whose synchronous reduction does reduce: megatron-fsdp 0.1.0-0.4.0 /
megatron-core 0.14-0.17 skip every buffer in ``all_reduce_gradients`` (and 0.1.0-0.2.3 / 0.14-0.15
in ``reduce_scatter_gradients``), so there the hooks' reduction is the only one and is kept
(:data:`~mfsdp_hotfix.registry.SYNCHRONOUS_REDUCTIONS`, read from the copy's code).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .. import fingerprints
from ..fix_catalogue import REDUCE_ONCE
from ..patching import Undo, wrap_attribute
from ..registry import SYNCHRONOUS_REDUCTIONS, short_name
from ..structure.synchronous_reductions import reduces_every_buffer


def reducing_strategies(buffer_class: type) -> frozenset[str]:
    """The unsharded strategies whose synchronous reduction in ``buffer_class`` reduces every
    gradient buffer
    (:func:`~mfsdp_hotfix.structure.synchronous_reductions.reduces_every_buffer`)."""
    return frozenset(strategy for strategy, qualname in SYNCHRONOUS_REDUCTIONS.items()
                     if reduces_every_buffer(fingerprints.source_of(
                         getattr(buffer_class, short_name(qualname)))))


def reduced_in_finish_grad_sync(pipeline: Any, strategies: frozenset[str]) -> bool:
    """Whether ``finish_grad_sync`` reduces this pipeline's gradients itself, synchronously, so
    that the backward hooks must not: ``overlap_grad_reduce=False`` and a strategy of
    ``strategies`` (:func:`reducing_strategies`), without HSDP (a DP-Outer group of 2 or more
    ranks), whose all-reduce over DP-Outer only the hooks' reduction carries: there the hooks
    keep it (HSDP without overlap is refused at model construction, but where the second
    reduction, over a one-rank DP-Shard group and unscaled, changes nothing: coverage.py)."""
    config = pipeline.buffer.ddp_config
    if config.data_parallel_sharding_strategy not in strategies or config.overlap_grad_reduce:
        return False
    index = pipeline.buffer.dist_index  # HSDP: the hooks' reduction carries DP-Outer's
    return not (index.use_hybrid_fsdp and index.get_outer_fsdp_group().size() > 1)


def apply(buffer_module: ModuleType) -> Undo:
    """Wrap ``GradReducePipeline.reduce_gradients`` and ``.reset`` of this copy."""
    strategies = reducing_strategies(buffer_module.ParamAndGradBuffer)

    def only_with_overlap(wrapped: Any, instance: Any, args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> Any:
        # No try/except: a failure here must stop the step, not let it reduce twice.
        if reduced_in_finish_grad_sync(instance, strategies):
            return None
        return wrapped(*args, **kwargs)

    pipeline = buffer_module.GradReducePipeline
    undo_reduce = wrap_attribute(pipeline, "reduce_gradients", only_with_overlap, REDUCE_ONCE.id)
    try:
        undo_reset = wrap_attribute(pipeline, "reset", only_with_overlap, REDUCE_ONCE.id)
    except Exception:
        undo_reduce()
        raise

    def undo() -> bool:
        reset_restored = undo_reset()
        return undo_reduce() and reset_restored

    return undo
