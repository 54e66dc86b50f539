"""Fix ``single-rank-reduce``: a gradient buffer whose data-parallel group has one rank
accumulates its microbatches in place and is scaled once per optimizer step.

With ZeRO-2/3 the releases reduce every gradient buffer in every microbatch's backward hooks
and let fused wgrad overwrite ``main_grad``: right where the buffer is sharded, because each
microbatch's gradients land in a fresh bucket that is reduce-scattered and added into the shard.
A buffer whose group has one rank (every buffer at data-parallel size 1; the experts' buffers
when expert-parallel equals data-parallel) is not sharded: ``main_grad`` is the buffer itself,
which must hold the sum of the step's microbatches. So, as shipped:

- fused wgrad overwrites it, keeping only the last microbatch (megatron-fsdp 0.2.0 /
  megatron-core 0.15.0 and later, which set ``overwrite_main_grad``);
- each microbatch's reduction over one rank rescales the accumulated buffer by the gradient
  scaling factor (1/data-parallel size for experts), and megatron-fsdp 0.3.0-0.3.1 /
  megatron-core 0.16 add the reduced shard onto itself (``local_grad += reduced_grad`` on
  aliased memory): the buffer doubles every microbatch, ``buf_k = 2 buf_(k-1) + g_k``.

A reduction over one rank moves nothing; what it must do is apply the scale once. This fix, as
NVIDIA/Megatron-LM#6773 does (facts from that change, not its code): fused wgrad adds into such a
buffer (``overwrite_main_grad = False`` after the release's all-gather sets it), the backward
hooks' ``GradReducePipeline.reduce_gradients`` leaves its parameters out, and
``finish_grad_sync`` scales each buffer so left out once, as the release's own
``gradient_reduce_preprocessing`` and collective would over one rank (none for
``calculate_per_token_loss``; none for ``average_in_collective``, an average over one rank;
otherwise the factor, which a premul-sum over one rank may not apply on NCCL either).

Under HSDP the hooks' reduction of the last microbatch also carries the DP-Outer all-reduce:
there the parameters are left out of every other microbatch's reduction and passed on in the
last one, whose reduction over the one DP-Shard rank scales the sum once, as the release's own.
Only where the model shards gradients (ZeRO-2/3): ZeRO-1 and no_shard reduce once per step
already (their fused-wgrad overwrite is ``zero1-accumulate``). If this fix raises, the step is
stopped: going on would train on wrong gradients silently.

Model auto-sync (``sync_model_each_microbatch=True``) runs ``finish_grad_sync`` after every
microbatch, and the buffer accumulates in place: a scale other than 1 (the experts') would
apply again to the microbatches already scaled. No second scale makes that right, so the second
microbatch of a step is stopped there (before anything is scaled), naming the way around it;
one microbatch per step, or a scale of 1, is exact and runs.
"""

from __future__ import annotations

import weakref
from types import ModuleType
from typing import Any

from ..errors import UnsupportedConfiguration
from ..fix_catalogue import SINGLE_RANK_REDUCE
from ..guard import stopped
from ..patching import Undo, wrap_attributes

SHARDED_GRADIENTS = ("optim_grads", "optim_grads_params")

# Per gradient pipeline: the buckets whose hooks' reduction was left out since the last
# finish_grad_sync, so each is scaled once however many microbatches added into it.
_LEFT_OUT: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()
# Per gradient pipeline: the buckets scaled by a factor other than 1 since the last
# zero_grad_buffer (auto-sync scales at every microbatch's finish_grad_sync).
_SCALED: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()


# Per ParamAndGradBuffer: the ids of its one-rank gradient buckets (groups do not change).
_ONE_RANK: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def one_rank_buckets(buffer: Any) -> frozenset[int]:
    """The ids of the buckets of ``buffer`` (a ``ParamAndGradBuffer``) whose gradient buffer
    shards gradients (ZeRO-2/3) over a data-parallel group of one rank."""
    found = _ONE_RANK.get(buffer)
    if found is None:
        sharded = buffer.ddp_config.data_parallel_sharding_strategy in SHARDED_GRADIENTS
        found = frozenset(
            bucket_id for bucket_id, group in enumerate(buffer.parameter_groups)
            if sharded and group.main_grad_buffer is not None
            and group.main_grad_buffer.data_parallel_group.size() == 1)
        _ONE_RANK[buffer] = found
    return found


def one_rank_bucket(buffer: Any, param: Any) -> int | None:
    """The bucket id of ``param``'s gradient buffer when it is one of :func:`one_rank_buckets`,
    else None."""
    one_rank = one_rank_buckets(buffer)
    if not one_rank:
        return None
    bucket_id: int = buffer.param_to_param_group[param]
    return bucket_id if bucket_id in one_rank else None


def one_rank_scale(grads: Any, ddp_config: Any) -> float | None:
    """What a reduction of ``grads`` over one rank multiplies it by (None: nothing)."""
    factor = grads.gradient_scaling_factor
    if factor is None or ddp_config.average_in_collective:
        return None
    return float(factor)


def scale_left_out(pipeline: Any) -> list[float]:
    """Scale, once, every bucket whose reduction the hooks left out since the last call; returns
    the factors other than 1 applied. A bucket scaled already since the last
    ``zero_grad_buffer`` (auto-sync's next microbatch) raises
    :class:`~mfsdp_hotfix.UnsupportedConfiguration` before anything is scaled: its buffer holds
    the scaled microbatches before and the new one unscaled, which no second scale makes
    right."""
    buckets = _LEFT_OUT.pop(pipeline, set())
    scales = []
    for bucket_id in sorted(buckets):
        grads = pipeline.buffer.parameter_groups[bucket_id].main_grad_buffer
        factor = one_rank_scale(grads, pipeline.buffer.ddp_config)
        if factor is not None and factor != 1.0:
            scales.append((bucket_id, grads, factor))
    scaled = _SCALED.setdefault(pipeline, set())
    if any(bucket_id in scaled for bucket_id, _, _ in scales):
        raise UnsupportedConfiguration(AUTO_SYNC.format(factor=scales[0][2]))
    for bucket_id, grads, factor in scales:
        grads.fetch_bucket().data.mul_(factor)
        scaled.add(bucket_id)
    return [factor for _, _, factor in scales]


AUTO_SYNC = (
    "mfsdp_hotfix: single-rank-reduce: model auto-sync (sync_model_each_microbatch=True) with a "
    "gradient buffer whose data-parallel group has one rank and a gradient scale of {factor:g} "
    "(the experts' 1/data-parallel size), and a second microbatch before zero_grad_buffer(): "
    "each microbatch's finish_grad_sync would scale the whole accumulated buffer again, "
    "silently wrong gradients (as the release warns of its in-place buffers), so the step is "
    "stopped. Workaround: accumulate the microbatches under no_sync() with "
    "sync_model_each_microbatch=False (Megatron-LM's protocol, exact with the hotfix), or one "
    "microbatch per optimizer step, or calculate_per_token_loss=True (no scale)")


def apply(model_module: ModuleType) -> Undo:
    """Wrap ``MegatronFSDP.all_gather_and_wait_parameters_ready``, ``.finish_grad_sync`` and
    ``.zero_grad_buffer``, and ``GradReducePipeline.reduce_gradients`` (the class the model
    module builds its pipeline from), of this copy."""

    def accumulate_in_place(wrapped: Any, instance: Any, args: tuple[Any, ...],
                            kwargs: dict[str, Any]) -> Any:
        result = wrapped(*args, **kwargs)
        try:
            params = kwargs["params"] if "params" in kwargs else args[0]
            for param in params:
                if one_rank_bucket(instance.param_and_grad_buffer, param) is not None:
                    param.overwrite_main_grad = False
        except Exception as exc:
            raise stopped(SINGLE_RANK_REDUCE, "all_gather_and_wait_parameters_ready", exc) from exc
        return result

    def leave_out_one_rank(wrapped: Any, instance: Any, args: tuple[Any, ...],
                           kwargs: dict[str, Any]) -> Any:
        try:
            params = list(kwargs.pop("params") if "params" in kwargs else args[0])
            hybrid = instance.buffer.dist_index.use_hybrid_fsdp
            outer = kwargs.get("outer_fsdp_group_grad_reduce",
                               args[2] if len(args) > 2 else False)
            kept = []
            for param in params:
                bucket_id = one_rank_bucket(instance.buffer, param)
                if bucket_id is None or (hybrid and outer):
                    kept.append(param)
                elif not hybrid:
                    _LEFT_OUT.setdefault(instance, set()).add(bucket_id)
        except Exception as exc:
            raise stopped(SINGLE_RANK_REDUCE, "GradReducePipeline.reduce_gradients", exc) from exc
        if params and not kept:
            return None
        return wrapped(kept, *args[1:], **kwargs)

    def scale_once(wrapped: Any, instance: Any, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
        try:
            scale_left_out(instance.grad_reduce_pipeline)
        except UnsupportedConfiguration:  # auto-sync's second microbatch: said why
            raise
        except Exception as exc:
            raise stopped(SINGLE_RANK_REDUCE, "finish_grad_sync", exc) from exc
        return wrapped(*args, **kwargs)

    def zeroed(wrapped: Any, instance: Any, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
        result = wrapped(*args, **kwargs)
        _SCALED.pop(instance.grad_reduce_pipeline, None)  # a new step: nothing scaled yet
        return result

    model = model_module.MegatronFSDP
    return wrap_attributes([(model, "all_gather_and_wait_parameters_ready", accumulate_in_place),
                            (model_module.GradReducePipeline, "reduce_gradients",
                             leave_out_one_rank),
                            (model, "finish_grad_sync", scale_once),
                            (model, "zero_grad_buffer", zeroed)], SINGLE_RANK_REDUCE.id)
