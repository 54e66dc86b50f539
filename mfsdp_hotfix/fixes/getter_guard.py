"""Fix ``getter-guard``: drain the reduce-scatter queue before the lazy getter allocates.

Fused wgrad accumulation (TransformerEngine, megatron-core) calls ``param.get_main_grad()`` in
backward; before megatron-core 0.19 / megatron-fsdp 0.6 that closure takes a bucket from the
2-slot pool without retiring queued reduce-scatters first, so the third unit finds no slot
(era A) or, with 0.18's over-eager drain, reuses a slot too early (era B).

Right after ``MegatronFSDP._init_fsdp_param_and_grad_buffer`` has built the buffer and the
pipeline (before any forward, because TransformerEngine captures the bound method at forward
time), the pipeline is linked into the buffer and each parameter's ``get_main_grad`` is rebound to
``guarded_get_main_grad``: a plain module-level function bound to the parameter, so the parameter
stays deep-copyable. It reaches the pipeline through a weak reference (never keeping a model
alive) and then fetches exactly as the original getter did.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from .. import guard
from ..fix_catalogue import GETTER_GUARD
from ..patching import Undo, wrap_attribute

_PIPELINE = "_mfsdp_hotfix_pipeline"
_ORIGINAL = "_mfsdp_hotfix_unguarded_getter"

_linked_models: weakref.WeakSet[Any] = weakref.WeakSet()


def guarded_get_main_grad(param: Any) -> Any:
    """Make room in the pool for this parameter's unit, then run the release's own getter."""
    pipeline = getattr(param, _PIPELINE)()
    if pipeline is not None:
        guard.attempt(GETTER_GUARD, "get_main_grad",
                      lambda: pipeline._enforce_double_buffer_limit([param._gbuf.bucket_id]))
    return getattr(param, _ORIGINAL)(param)


def is_guarded(param: Any) -> bool:
    return getattr(param.__dict__.get("get_main_grad"), "__func__", None) is guarded_get_main_grad


def link(model: Any) -> int:
    """Guard every getter of one built ``MegatronFSDP``; returns how many were rebound."""
    buffer, pipeline = model.param_and_grad_buffer, model.grad_reduce_pipeline
    buffer.grad_reduce_pipeline = pipeline
    rebound = 0
    for param in _getter_params(buffer):
        if is_guarded(param):
            continue
        setattr(param, _ORIGINAL, param.__dict__["get_main_grad"].__func__)
        setattr(param, _PIPELINE, weakref.ref(pipeline))
        param.get_main_grad = types.MethodType(guarded_get_main_grad, param)
        rebound += 1
    _linked_models.add(model)
    return rebound


def unlink(model: Any) -> None:
    """Restore the original getters of one model (only those still guarded by us)."""
    buffer = model.param_and_grad_buffer
    for param in _getter_params(buffer):
        if is_guarded(param):
            param.get_main_grad = types.MethodType(getattr(param, _ORIGINAL), param)
            delattr(param, _ORIGINAL)
            delattr(param, _PIPELINE)
    if getattr(buffer, "grad_reduce_pipeline", None) is model.grad_reduce_pipeline:
        del buffer.grad_reduce_pipeline
    _linked_models.discard(model)


def apply(model_module: ModuleType) -> Undo:
    """Guard the getters of every ``MegatronFSDP`` of this copy built from now on."""
    model_class = model_module.MegatronFSDP

    def after_buffer_init(wrapped: Any, instance: Any, args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> Any:
        result = wrapped(*args, **kwargs)
        guard.attempt(GETTER_GUARD, "_init_fsdp_param_and_grad_buffer", lambda: link(instance))
        return result

    restore_class = wrap_attribute(model_class, "_init_fsdp_param_and_grad_buffer",
                                   after_buffer_init, GETTER_GUARD.id)

    def undo() -> bool:
        for model in list(_linked_models):
            if isinstance(model, model_class):
                unlink(model)
        return restore_class()

    return undo


def _getter_params(buffer: Any) -> Iterator[Any]:
    for group in buffer.parameter_groups:
        for param in group.params:
            if "get_main_grad" in param.__dict__:
                yield param
