"""Fix ``core-linear-accumulate``: megatron-core's own fused linear must add a Megatron-FSDP
weight's gradient into ``main_grad`` where the parameter says not to overwrite it.

megatron-core's ``LinearWithGradAccumulationAndAsyncCommunication`` (``tensor_parallel/
layers.py``) is the autograd function of ``ColumnParallelLinear`` and ``RowParallelLinear``: the
GPT output layer of every Megatron-LM model, and every layer with ``--transformer-impl local``.
With ``gradient_accumulation_fusion`` its backward writes the weight gradient straight into
``main_grad``. For a plain parameter it adds (APEX's ``wgrad_gemm_accum_*``). For a Megatron-FSDP
parameter (``__fsdp_param__``) it takes the buffer from ``weight.get_main_grad()`` and writes
into it with ``out=`` (``matmul`` in megatron-core 0.14-0.17, TransformerEngine's
``general_gemm`` with ``accumulate=False`` in 0.18-0.19, ``_wgrad_gemm`` on NVIDIA main), never
reading ``overwrite_main_grad``. Right for sharded gradients, whose bucket is fresh each
microbatch; wrong for ZeRO-1, whose ``main_grad`` is the one unsharded buffer that gathers the
microbatches of a step: there each microbatch erases the ones before it, even after
``zero1-accumulate`` (or NVIDIA/Megatron-LM#6357) has set ``overwrite_main_grad = False``, which
TransformerEngine's layers honour and this one does not.

The repair wraps that backward. For a Megatron-FSDP weight whose ``overwrite_main_grad`` is
False, while the release's backward runs, the weight's ``get_main_grad`` fetches the real buffer
as before and hands out a zeroed tensor of its shape and dtype instead; the release writes the
gradient there, and afterwards it is added into the real buffer, which ``weight.main_grad``
names again. A weight that carries no ``overwrite_main_grad`` (megatron-fsdp 0.1.0 /
megatron-core 0.14.0 set none) is taken the same way where its gradient buffer is not
distributed (ZeRO-1), whose one buffer must add up the microbatches. Same GEMM, then one add:
the arithmetic of the unfused path (autograd's weight gradient, added into the buffer by
Megatron-FSDP's ``_grad_acc``). It costs a temporary of the weight's size for one backward, as
the unfused path does. Where ``overwrite_main_grad`` is True, or absent with a distributed
buffer, or fusion is off, the release's backward runs untouched. The weight is found without
unpacking the saved tensors (whose hooks, activation offloading's, may unpack only once): it is
the variable of the gradient accumulator that the function's second tensor input, ``weight``,
feeds.

If the fix raises, the step is stopped (:class:`~mfsdp_hotfix.UnsupportedConfiguration`): going
on would overwrite the gradients again, silently, for the rest of the job.
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any

from .. import guard
from ..fix_catalogue import CORE_LINEAR_ACCUMULATE
from ..patching import Undo, wrap_static_method

FUNCTION = "LinearWithGradAccumulationAndAsyncCommunication"
BACKWARD = f"{FUNCTION}.backward"
# forward(ctx, input, weight, ...): autograd keeps one edge per tensor input, so the weight's
# is the second.
WEIGHT_EDGE = 1


def weight_to_accumulate(ctx: Any) -> Any | None:
    """The Megatron-FSDP weight of this backward if the release would overwrite a ``main_grad``
    that the parameter says to add into; else None."""
    if not ctx.gradient_accumulation_fusion:
        return None
    weight = getattr(ctx.next_functions[WEIGHT_EDGE][0], "variable", None)
    if weight is None or not hasattr(weight, "__fsdp_param__"):
        return None
    overwrite = getattr(weight, "overwrite_main_grad", None)
    if overwrite is None:
        return weight if _unsharded_where_nothing_is_said(weight) else None
    return weight if overwrite is False else None


def _unsharded_where_nothing_is_said(weight: Any) -> bool:
    """A weight without ``overwrite_main_grad``: megatron-fsdp 0.1.0 / megatron-core 0.14.0 set
    none. There ``get_main_grad()`` returns the one unsharded buffer of a step where the
    weight's gradient buffer is not distributed (ZeRO-1, no_shard, a one-rank group), which
    must add up the microbatches, as TransformerEngine's layers do when nothing is said; a
    distributed buffer hands out a fresh bucket each microbatch, which the release's write
    over it fills. A weight without that buffer (``_gbuf``) runs as shipped."""
    buffer = getattr(weight, "_gbuf", None)
    return buffer is not None and buffer.is_data_distributed is False


def run_accumulating(backward: Any, weight: Any, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> Any:
    """Run the release's ``backward`` with ``weight``'s wgrad landing in a zeroed scratch tensor,
    then add it into the buffer ``weight.get_main_grad()`` returns."""
    try:
        getter = weight.__dict__["get_main_grad"]  # Megatron-FSDP binds one to each parameter
    except Exception as exc:
        raise guard.stopped(CORE_LINEAR_ACCUMULATE, BACKWARD, exc) from exc
    taken: list[tuple[Any, Any]] = []

    def into_scratch() -> Any:
        main_grad = getter()
        scratch = main_grad.new_zeros(main_grad.shape)
        taken.append((main_grad, scratch))
        return scratch

    weight.get_main_grad = into_scratch
    try:
        result = backward(*args, **kwargs)
    finally:
        weight.get_main_grad = getter
    try:
        for main_grad, scratch in taken:
            main_grad.add_(scratch)
            weight.main_grad = main_grad
    except Exception as exc:
        raise guard.stopped(CORE_LINEAR_ACCUMULATE, BACKWARD, exc) from exc
    return result


def apply(layers_module: ModuleType) -> Undo:
    """Wrap ``LinearWithGradAccumulationAndAsyncCommunication.backward`` of megatron-core."""
    function = getattr(layers_module, FUNCTION)
    inputs = list(inspect.signature(function.forward).parameters)[1:3]
    if inputs != ["input", "weight"]:
        raise TypeError(f"{FUNCTION}.forward takes {inputs} first, not (input, weight): not the "
                        "code shape this fix was written for")

    def accumulating_backward(backward: Any, _: Any, args: tuple[Any, ...],
                              kwargs: dict[str, Any]) -> Any:
        try:
            weight = weight_to_accumulate(args[0])
        except Exception as exc:
            raise guard.stopped(CORE_LINEAR_ACCUMULATE, BACKWARD, exc) from exc
        if weight is None:
            return backward(*args, **kwargs)
        return run_accumulating(backward, weight, args, kwargs)

    return wrap_static_method(function, "backward", accumulating_backward,
                              CORE_LINEAR_ACCUMULATE.id)
