"""Fix ``root-forward-hooks``: ``MegatronFSDP.forward`` calls the wrapped root module through its
hooks, not past them.

megatron-fsdp 0.1.0-0.5.1 / megatron-core 0.14-0.18 run ``self.module.forward(...)``, which skips
the hooks Megatron-FSDP registered on the root module itself:

* its pre-forward hook, which gathers the parameters the root owns (outside every FSDP unit):
  with ZeRO-3 the root's forward reads freed storage (SIGSEGV), with ZeRO-1/2 a copy not
  synchronised after the optimizer step;
* its forward hook, which arms the root pre-backward hook on the root's output. What remains
  is the copy of that hook on the module registered last, which fires when that module's
  output gradient is computed. Where that module is not the last to run in forward (a model
  without a parameter-free module at its end: a pre-norm unit's norm, an embedding
  registered last), the root pre-backward hook fires in the middle of backward: it marks
  every parameter as still to be handled and clears ``grad_added_to_main_grad``, so the root
  post-backward handles again (ZeRO-2/3: zeroes and reduces again) the gradients of the
  modules that ran backward before it, and leaves the pipeline's buckets half reduced
  (wrong gradients, or "Found 2 out of 3 parameters ... pipeline is being reset", or a
  double-buffer slot reused outside the pool's bookkeeping).

megatron-fsdp 0.6.0 / megatron-core 0.19.0 call ``self.module(...)`` (NVIDIA/Megatron-LM#5808,
for NVIDIA/Megatron-LM#5789): the root's hooks run, the root pre-backward hook fires first in
backward. This fix makes the same change where the forward has the older shape (gated by its
fingerprint), for the models where the root's hooks matter (``root_hooks_matter``: the root owns
parameters, or its module registered last has some); other models keep the release's forward
bit for bit, because on megatron-fsdp 0.1.0-0.2.3 / megatron-core 0.14-0.15 the root's hooks
running there stop ZeRO-3's double buffer ("No buffer found for bucket_id") where the release
alone is exact. The rest of the method (the raw-parameter swap, the profiler range) is kept.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..fix_catalogue_outside import ROOT_FORWARD_HOOKS, root_hooks_matter
from ..patching import Undo, wrap_attribute


def apply(model_module: ModuleType) -> Undo:
    """Wrap ``MegatronFSDP.forward`` of this copy."""
    import torch

    def through_the_root_hooks(wrapped: Any, instance: Any, args: tuple[Any, ...],
                               kwargs: dict[str, Any]) -> Any:
        matters = instance.__dict__.get("_mfsdp_hotfix_root_hooks_matter")
        if matters is None:  # the module tree is fixed once wrapped
            matters = instance.__dict__["_mfsdp_hotfix_root_hooks_matter"] = root_hooks_matter(
                instance)
        if not matters:
            return wrapped(*args, **kwargs)
        instance._replace_param_with_raw_if_needed()
        with torch.autograd.profiler.record_function("CustomFSDP.forward"):
            return instance.module(*args, **kwargs)

    return wrap_attribute(model_module.MegatronFSDP, "forward", through_the_root_hooks,
                          ROOT_FORWARD_HOOKS.id)
