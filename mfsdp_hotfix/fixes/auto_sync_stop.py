"""Fix ``auto-sync-stop``: model auto-sync does not accumulate a gradient buffer reduced in
place, so a step's second microbatch is stopped instead of reduced again.

With ``sync_model_each_microbatch=True`` (``fully_shard``'s default) every backward ends with a
full gradient synchronisation. Where the gradient buffer is reduced in place (ZeRO-1 over two or
more data-parallel ranks; no_shard over two or more without an average over them, or scaled over
one; HSDP's all-reduce over DP-Outer, any inner strategy), a second microbatch added to it is
reduced again together with the first, which was reduced already: silently wrong gradients, in
every release and on NVIDIA main. The release warns of it when the option is set
(``set_model_auto_sync``: the buffer must be zeroed every microbatch), and Megatron-LM's protocol
(``no_sync()``, ``sync_model_each_microbatch=False``) never does it. No repair makes an already
reduced sum right, so the second synchronisation of a step (``finish_grad_sync`` twice without
``zero_grad_buffer`` in between) raises :class:`~mfsdp_hotfix.UnsupportedConfiguration` with the
way around it, before the optimizer step can use the gradients. One microbatch per step,
ZeRO-2/3 without HSDP (sharded buffers, whose microbatches land in fresh buckets), an unscaled
one-rank buffer and no_shard averaging over its group (every rank holds the same average of the
earlier microbatches, which averaging again gives back but for rounding) are right and run
untouched.
"""

from __future__ import annotations

import weakref
from types import ModuleType
from typing import Any

from ..errors import UnsupportedConfiguration
from ..fix_catalogue import AUTO_SYNC_STOP
from ..limits import reduced_in_place
from ..patching import Undo, wrap_attributes

STOPPED = (
    "mfsdp_hotfix: auto-sync-stop: model auto-sync (sync_model_each_microbatch=True, "
    "fully_shard's default) with a gradient buffer reduced in place ({what}) and a second "
    "microbatch before zero_grad_buffer(): its reduction would reduce the microbatches already "
    "reduced once more, silently wrong gradients (the release asks for the buffer to be zeroed "
    "every microbatch), so the step is stopped. Workaround: accumulate the microbatches under "
    "no_sync() with sync_model_each_microbatch=False (Megatron-LM's protocol, exact with the "
    "hotfix), or one microbatch per optimizer step")
# The models that synchronised since their last zero_grad_buffer.
_SYNCED: weakref.WeakSet[Any] = weakref.WeakSet()


def apply(model_module: ModuleType) -> Undo:
    """Wrap ``MegatronFSDP.finish_grad_sync`` and ``.zero_grad_buffer`` of this copy."""

    def once_per_step(wrapped: Any, instance: Any, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> Any:
        # No try/except: a failure here must stop the step, not let it reduce again.
        if instance.model_auto_sync:
            what = reduced_in_place(instance)
            if what is not None and instance in _SYNCED:
                raise UnsupportedConfiguration(STOPPED.format(what=what))
            _SYNCED.add(instance)
        return wrapped(*args, **kwargs)

    def zeroed(wrapped: Any, instance: Any, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
        result = wrapped(*args, **kwargs)
        _SYNCED.discard(instance)  # a new step
        return result

    model = model_module.MegatronFSDP
    return wrap_attributes([(model, "finish_grad_sync", once_per_step),
                            (model, "zero_grad_buffer", zeroed)], AUTO_SYNC_STOP.id)
