"""How the selftest, its GPU runs and the example shard a model with Megatron-FSDP: the release's
``fully_shard_model`` over all ranks of the default group, found from whatever names
Megatron-FSDP, with the options that release accepts.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from types import ModuleType
from typing import Any

from mfsdp_hotfix.selftest import protocol as accumulation


def fully_shard_model_of(release: Any) -> Any:
    """Megatron-FSDP's ``fully_shard_model`` from whatever names it: the package
    (``megatron_fsdp`` or megatron-core's vendored copy), its ``fully_shard`` module, the
    ``fully_shard`` function the package exports under the same name, or ``fully_shard_model``
    itself; anything else is a TypeError that says what is accepted."""
    found = None
    if isinstance(release, ModuleType):
        found = getattr(release, "fully_shard_model", None)
    elif callable(release) and getattr(release, "__name__", None) in ("fully_shard",
                                                                       "fully_shard_model"):
        found = getattr(sys.modules.get(getattr(release, "__module__", "") or ""),
                        "fully_shard_model", None)
    if not callable(found):
        raise TypeError(
            "wrap() takes Megatron-FSDP as its first argument: the package (megatron_fsdp, or "
            "megatron.core.distributed.fsdp.src.megatron_fsdp), its fully_shard module or "
            f"function, or fully_shard_model; got {release!r}")
    return found


def wrap(release: Any, module: Any, unit_cls: type, strategy: str,
         double_buffer: bool, device: Any, per_token_loss: bool = False,
         options: dict[str, Any] | None = None, outer: int = 1,
         grad_comm_dtype: str | None = None, protocol: str = accumulation.DEFAULT,
         div_fusion: bool = False, overlap_grad_reduce: bool = True,
         experts: bool = False) -> Any:
    """``fully_shard_model`` over all ranks of the default group, as a (ranks, 1) dp/tp mesh
    (megatron-fsdp 0.5.x needs a registered TP submesh), with the options this release accepts;
    ``options`` must all be accepted. ``outer`` > 1: HSDP, an (outer, ranks/outer, 1) mesh.
    ``release``: Megatron-FSDP, as :func:`fully_shard_model_of` accepts it (e.g.
    ``megatron_fsdp``, or ``from megatron_fsdp import fully_shard``).
    ``protocol``: the accumulation protocol the caller will drive (``protocol.accumulate``); it
    sets ``sync_model_each_microbatch``, which the release must accept.
    ``div_fusion``: keep the release's ``gradient_reduce_div_fusion=True`` (PREMUL_SUM: on gloo
    only with ``premul.install()``); False scales the buffer, then reduces with SUM.
    ``overlap_grad_reduce``: False reduces ZeRO-1 / no_shard gradients in ``finish_grad_sync``.
    ``experts``: the module has expert parameters (``model.Experts``), expert-parallel over all
    ranks: ``expt_device_mesh`` is an (expert-data-parallel 1, tp 1) mesh of this rank, as
    megatron-core's adapter builds it; a release without that option fails."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard_model = fully_shard_model_of(release)

    world = dist.get_world_size()
    hybrid: dict[str, Any] = {}
    if outer > 1:
        mesh = init_device_mesh(device.type, (outer, world // outer, 1),
                                mesh_dim_names=("dp_outer", "fsdp", "tp"))
        flat = mesh["dp_outer", "fsdp"]._flatten("dp")
        hybrid = {"dp_outer_dim": "dp_outer", "hybrid_fsdp_group": flat.get_group()}
    else:
        mesh = init_device_mesh(device.type, (world, 1), mesh_dim_names=("fsdp", "tp"))
    if experts:
        if outer > 1:
            raise ValueError("harness: expert units are not built with HSDP")
        per_expert = init_device_mesh(device.type, (world, 1, 1),
                                      mesh_dim_names=("ep", "fsdp", "tp"))
        hybrid["expt_device_mesh"] = per_expert["fsdp", "tp"]
    if grad_comm_dtype is not None:
        import torch

        mixed = importlib.import_module(fully_shard_model.__module__.rsplit(".", 1)[0]
                                        + ".mixed_precision")
        hybrid["mixed_precision_policy"] = mixed.MixedPrecisionPolicy(
            grad_comm_dtype=getattr(torch, grad_comm_dtype))
    wanted: dict[str, Any] = {
        "module": module, "device_mesh": mesh, "dp_shard_dim": "fsdp", "tp_dim": "tp",
        "fsdp_unit_modules": [unit_cls],
        "zero_dp_strategy": strategy,
        "device": device, "fsdp_double_buffer": double_buffer,
        "overlap_grad_reduce": True, "overlap_param_gather": True,
        "calculate_per_token_loss": per_token_loss,
    }
    accepted = inspect.signature(fully_shard_model).parameters
    required = {**hybrid, **accumulation.wrap_options(protocol), **(options or {})}
    if not overlap_grad_reduce:  # a setting studied, so a release without it fails the case
        wanted.pop("overlap_grad_reduce")
        required["overlap_grad_reduce"] = False
    unknown = sorted(set(required) - set(accepted))
    if unknown:
        raise TypeError(f"this release's fully_shard_model has no option {', '.join(unknown)}")
    model = fully_shard_model(**{k: v for k, v in wanted.items() if k in accepted}, **required)
    accumulation.verify(model, protocol)
    # gloo has no PREMUL_SUM: by default scale first, then SUM (a setting, not a patch; the GPU
    # runs use the same, so that every backend reduces alike).
    if not div_fusion:
        if not hasattr(model.ddp_config, "gradient_reduce_div_fusion"):
            raise TypeError("this release's DistributedDataParallelConfig has no "
                            "gradient_reduce_div_fusion")
        model.ddp_config.gradient_reduce_div_fusion = False
    return model
