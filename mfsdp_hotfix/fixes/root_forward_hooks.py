"""Fix ``root-forward-hooks``: the root module's own parameters are gathered before its forward.

megatron-fsdp 0.1.0-0.5.1 (megatron-core 0.14.0-0.18.2) run the wrapped module with
``self.module.forward(...)``, which skips ``nn.Module.__call__`` and with it the hooks
Megatron-FSDP registered on that module: among them the pre-forward hook that all-gathers the
parameters the root module owns itself (not through a child). With ZeRO-3
(``optim_grads_params``) those parameters are sharded after wrapping, so the root's forward reads
freed storage: a crash (SIGSEGV) or garbage. Parameters of child modules gather through their own
hooks and are right.

As NVIDIA/Megatron-LM#5808 does (facts from that change, not its code), ``MegatronFSDP.forward``
runs the wrapped module through ``__call__``, so its hooks run, where the root module owns a
parameter and parameters are sharded; anywhere else the release's forward runs unchanged.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .. import guard
from ..fix_catalogue_outside import ROOT_FORWARD_HOOKS
from ..patching import Undo, wrap_attribute


def needs_hooks(model: Any) -> bool:
    """Whether the root module of ``model`` (a ``MegatronFSDP``) owns a parameter."""
    return any(True for _ in model.module.parameters(recurse=False))


def apply(model_module: ModuleType) -> Undo:
    """Wrap this copy's ``MegatronFSDP.forward``."""

    def through_call(wrapped: Any, instance: Any, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> Any:
        if guard.attempt(ROOT_FORWARD_HOOKS, "MegatronFSDP.forward",
                         lambda: needs_hooks(instance)) is not True:
            return wrapped(*args, **kwargs)
        instance._replace_param_with_raw_if_needed()
        return instance.module(*args, **kwargs)

    return wrap_attribute(model_module.MegatronFSDP, "forward", through_call,
                          ROOT_FORWARD_HOOKS.id)
