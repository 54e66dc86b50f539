"""Fix ``inert-warm-up``: ``fully_shard_optimizer``'s warm-up step leaves the parameters and the
optimizer state as if no step had run.

megatron-fsdp 0.4.0-0.6.1 (megatron-core 0.17.0-0.19.2) build the optimizer state before
training (so that a DCP checkpoint has tensors to load into) by giving every parameter a zero
gradient and calling ``optimizer.step()``. That step is not inert: Adam's and AdamW's ``step``
counters advance (the first real step then uses step 2's bias correction: its update is 1.344x
too small), AdamW's decoupled weight decay and Adam's or SGD's coupled one move the parameters,
and coupled decay fills the moments and momentum buffers.

This fix, after the facts of NVIDIA/Megatron-LM#5976 (not its code), wraps
``fully_shard_optimizer``: each parameter's local values are copied before it and written back
after it, and the state the warm-up created is set to what a fresh optimizer's first step
starts from, keeping its tensors (a checkpoint still loads into them): ``step`` 0 and zero
moments for ``torch.optim.Adam`` / ``AdamW``; for ``torch.optim.SGD`` a zero momentum buffer
where ``dampening`` is 0 (the first step then gives ``buf = grad``, as a fresh one does), and
none where it is not. Any other optimizer's state is left as the warm-up made it and a warning
says so (its parameters are still restored).
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from .. import guard
from ..fix_catalogue_outside import INERT_WARM_UP
from ..patching import Undo, wrap_function

log = logging.getLogger("mfsdp_hotfix")
UNKNOWN_STATE = ("mfsdp_hotfix: inert-warm-up: fully_shard_optimizer ran one warm-up step of "
                 "{name} on zero gradients; its parameters were restored, but its state (step "
                 "counters, moments) is left as that step made it, because the hotfix knows how a "
                 "fresh state looks only for torch.optim.Adam, AdamW and SGD. If no checkpoint is "
                 "loaded into this optimizer, call optimizer.state.clear() right after "
                 "fully_shard_optimizer, or use one of those optimizers")


def _local(param: Any) -> Any:
    """The tensor holding this rank's values (a DTensor's local shard)."""
    return getattr(param, "_local_tensor", param)


def snapshot(optimizer: Any) -> dict[Any, Any]:
    """Each parameter's local values, and which parameters have state, before the warm-up."""
    return {param: (_local(param).detach().clone(), param in optimizer.state)
            for group in optimizer.param_groups for param in group["params"]}


def _fresh_adam(state: dict[str, Any], group: dict[str, Any]) -> None:
    for key, value in state.items():
        if key == "step":
            state[key] = value.zero_() if hasattr(value, "zero_") else 0.0
        elif hasattr(value, "zero_"):
            value.zero_()


def _fresh_sgd(state: dict[str, Any], group: dict[str, Any]) -> None:
    buffer = state.get("momentum_buffer")
    if buffer is None:
        return
    if group["dampening"] == 0:
        buffer.zero_()  # momentum * 0 + grad == grad: a fresh first step, bit for bit
    else:
        del state["momentum_buffer"]  # a fresh first step takes the gradient undamped


def _state_reset(optimizer: Any) -> Any:
    """How a fresh state of this optimizer looks (None: not known). Decided by its ``step``
    function: a subclass that replaces torch's ``step`` is not known."""
    import torch

    step = type(optimizer).step
    for cls, reset in ((torch.optim.Adam, _fresh_adam), (torch.optim.AdamW, _fresh_adam),
                       (torch.optim.SGD, _fresh_sgd)):
        if step is cls.step:
            return reset
    return None


def undo_warm_up(optimizer: Any, before: dict[Any, Any]) -> bool:
    """Write back each parameter's values and give the state the warm-up created the values of
    a fresh optimizer; returns whether the state was known (else it is left as it is)."""
    import torch

    with torch.no_grad():
        for param, (values, _) in before.items():
            _local(param).copy_(values)
    reset = _state_reset(optimizer)
    if reset is None:
        return False
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not before[param][1] and param in optimizer.state:
                reset(optimizer.state[param], group)
    return True


def apply(fully_shard_module: ModuleType) -> Undo:
    """Wrap this copy's ``fully_shard_optimizer`` (``fully_shard`` calls it by that name)."""

    def inert(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        optimizer = kwargs["optimizer"] if "optimizer" in kwargs else args[0]
        before = guard.attempt(INERT_WARM_UP, "fully_shard_optimizer",
                               lambda: snapshot(optimizer))
        result = wrapped(*args, **kwargs)
        if guard.attempt(INERT_WARM_UP, "fully_shard_optimizer",
                         lambda: undo_warm_up(optimizer, before)) is False:
            log.warning(UNKNOWN_STATE.format(name=type(optimizer).__qualname__))
        return result

    return wrap_function(fully_shard_module, "fully_shard_optimizer", inert, INERT_WARM_UP.id)
