"""Fix ``missed-post-backward``: finish, before the next forward, the post-backward of a ZeRO-3
unit whose hook never ran.

megatron-fsdp 0.1.0-0.2.3 / megatron-core 0.14-0.15 attach a unit's post-backward hook to the
unit's *inputs* that need a gradient. A unit with none (the first unit when the model's input is
data, a unit fed a detached tensor) never gets it: at the start of backward the root hook sets
every unit to ``PRE_BACKWARD``, and only the post-backward hook sets a unit back to ``IDLE``.
At the next forward the stale unit looks like an activation recomputation in progress: its
post-forward keeps its parameters gathered. With ``fsdp_double_buffer`` the parameter pool has 2
slots, so the stale unit and the next unit fill it and the first prefetch asserts
``[fsdp_params] No buffer found for bucket_id``.

megatron-fsdp 0.3.0-0.5.1 / megatron-core 0.16-0.18 release such a unit lazily instead, which
avoids the crash but not a silent error: the next unit's all-gather recycles the stale unit's
slot, while the pool, which does not pin a bucket to a slot, gathers it into the other slot in
backward. An ``nn.Linear`` computes its input gradient from the weight view it saved in forward,
so from the second forward on the gradients are wrong (0.6.0 / 0.19.0 pin each bucket to its
slot).

Before the parameters of a forward are gathered, and only when no backward is in progress (a
forward inside backward is a recomputation, whose states are live), each unit still in
``PRE_BACKWARD`` gets what its post-backward hook would have done to it: its parameter buckets
are released and it is set to ``IDLE``. Its gradients need nothing: the root post-backward hook
already reduced them.
"""

from __future__ import annotations

import functools
import inspect
from types import ModuleType
from typing import Any

from .. import guard
from ..fix_catalogue import MISSED_POST_BACKWARD
from ..patching import Undo, wrap_attribute


@functools.cache
def _released_per_pass(pipeline_type: Any) -> bool:
    """From 0.16 a bucket has a key per pass (``bwd``); the missed hook releases the backward
    one. Read once per pipeline class: this runs before every forward."""
    return "bwd" in inspect.signature(pipeline_type.release_bucket).parameters


def finish_missed_post_backwards(model: Any) -> int:
    """Release and reset the units of ``model`` that a finished backward left in
    ``PRE_BACKWARD`` (from 0.16, reset the modules outside every unit too: the root, whose hooks
    run with root-forward-hooks, and the modules between units); returns how many there were."""
    config = model.ddp_config
    if not (config.fsdp_double_buffer
            and config.data_parallel_sharding_strategy == "optim_grads_params"):
        return 0  # no 2-slot parameter pool: a stale unit costs memory, not a crash
    if getattr(model, "_root_pre_backward_hook_issued", True):
        return 0  # inside backward (activation recomputation), or a shape we do not know
    units = tuple(model.fsdp_unit_modules)
    bucket_of = model.param_and_grad_buffer.param_to_param_group
    release = model.all_gather_pipeline.release_bucket
    per_pass = _released_per_pass(model.all_gather_pipeline.__class__)
    # Between steps the module holds the optimizer's DTensor parameters; the buffer knows the
    # raw ones, by the same names.
    raw = model.raw_param
    finished = 0
    for prefix, module in model.module.named_modules():
        state: Any = getattr(module, "_training_state", None)
        if getattr(state, "name", None) != "PRE_BACKWARD":
            continue
        if not isinstance(module, units):
            if per_pass:  # its forward would cancel the prefetch, as in a recomputation
                module._training_state = type(state).IDLE
                finished += 1
            continue  # a module outside every unit keeps its parameters gathered
        names = (f"{prefix}.{name}" if prefix else name for name, _ in module.named_parameters())
        for bucket_id in sorted({bucket_of[raw[name]] for name in names}):
            if per_pass:
                release(bucket_id, True)
            else:
                release(bucket_id)
        module._training_state = type(state).IDLE
        finished += 1
    return finished


def apply(model_module: ModuleType) -> Undo:
    """Run :func:`finish_missed_post_backwards` at the start of
    ``MegatronFSDP._replace_param_with_raw_if_needed``: every release calls it first in
    ``forward`` and in ``start_param_sync`` (before a step's first all-gather), and so does
    root-forward-hooks' forward, which does not call the release's."""

    def before_gathering(wrapped: Any, instance: Any, args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> Any:
        guard.attempt(MISSED_POST_BACKWARD, "MegatronFSDP._replace_param_with_raw_if_needed",
                      lambda: finish_missed_post_backwards(instance))
        return wrapped(*args, **kwargs)

    return wrap_attribute(model_module.MegatronFSDP, "_replace_param_with_raw_if_needed",
                          before_gathering, MISSED_POST_BACKWARD.id)
