"""One rank of megatron-core's own Megatron-FSDP path (its ``FullyShardedDataParallel`` adapter
around a small ``GPTModel``, ``get_megatron_optimizer``'s distributed optimizer) on CPU with gloo,
and the gradient norm that optimizer clips by, next to plain PyTorch's.

Run as ``python grad_norm_job.py CONFIG_JSON RANK WORLD STORE OUT`` with the megatron-core
release first on ``PYTHONPATH`` and the repository after it (``MFSDP_HOTFIX=0``: as shipped).
``CONFIG_JSON``: ``strategy``.
One microbatch, driven as Megatron-LM's schedule leaves it (``is_last_microbatch``), then
``finish_grad_sync``. Writes ``OUT/rank<R>.json``: ``norm`` (``optimizer.get_grad_norm()``, what
``clip_grad_norm`` uses), ``ref`` (the norm of plain PyTorch's gradient of the mean loss over
ranks, the same model and seed), ``local_norm`` (the norm of this rank's own gradients, before any
reduction of statistics), ``stats_group_size`` and the state of the fix
``replicated-grad-stats``.

CPU stand-ins, for the test only: the ``torch.cuda`` stand-in; factory functions that are asked
for ``device="cuda"`` allocate on the CPU (the optimizer's scratch tensors); the adapter's
TransformerEngine version check and its CUDA device mesh; no-op RNG-tracker forks.
"""

from __future__ import annotations

import contextlib
import functools
from datetime import timedelta
from typing import Any


def _cpu_stand_ins() -> None:
    import torch

    from mfsdp_hotfix.selftest import cuda_standin

    cuda_standin.install()

    def on_cpu(factory: Any) -> Any:
        @functools.wraps(factory)
        def made(*args: Any, **kwargs: Any) -> Any:
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)
        return made

    for name in ("tensor", "zeros", "ones", "empty", "full", "arange"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    import megatron.core.distributed.fsdp.mcore_fsdp_adapter as adapter
    from torch.distributed.device_mesh import DeviceMesh

    class CpuDeviceMesh:
        @staticmethod
        def from_group(*args: Any, **kwargs: Any) -> Any:
            return DeviceMesh.from_group(*args, **dict(kwargs, device_type="cpu"))

    adapter.is_te_min_version = lambda *_a, **_k: True
    adapter.DeviceMesh = CpuDeviceMesh


def gpt(torch: Any) -> tuple[Any, Any]:
    """A two-layer GPTModel with megatron-core's local layers, the same weights every call."""
    from megatron.core.models.gpt import GPTModel, gpt_layer_specs
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
        params_dtype=torch.float32, gradient_accumulation_fusion=False, hidden_dropout=0.0,
        attention_dropout=0.0, add_bias_linear=False, use_cpu_initialization=True,
        perform_initialization=True, init_method_std=0.02, attention_backend=AttnBackend.local)
    torch.manual_seed(1234)
    spec = gpt_layer_specs.get_gpt_layer_local_spec()
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64,
                    max_sequence_length=8, pre_process=True, post_process=True,
                    share_embeddings_and_output_weights=False,
                    position_embedding_type="rope"), config


def run(config: dict[str, Any], rank: int, world: int, store: str) -> dict[str, Any]:
    _cpu_stand_ins()
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    dist.init_process_group("gloo", store=dist.FileStore(store, world),  # type: ignore
                            rank=rank, world_size=world, timeout=timedelta(seconds=90))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                             pipeline_model_parallel_size=1)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.fork = lambda *_a, **_k: contextlib.nullcontext()
    net, transformer = gpt(torch)
    ref, _ = gpt(torch)
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True, data_parallel_sharding_strategy=config["strategy"],
        overlap_grad_reduce=True, overlap_param_gather=True, use_distributed_optimizer=True,
        check_for_nan_in_grad=False, average_in_collective=False)
    ddp = FullyShardedDataParallel(config=transformer, ddp_config=ddp_config, module=net,
                                   device=torch.device("cpu"))
    ddp.ddp_config.gradient_reduce_div_fusion = False  # gloo has no PREMUL_SUM
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=0.0, use_distributed_optimizer=True, clip_grad=1.0,
                        bf16=False, fp16=False), [ddp])
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 64, (world, 2, 8), generator=gen)
    labels = torch.randint(0, 64, (world, 2, 8), generator=gen)
    positions = torch.arange(8).unsqueeze(0).expand(2, 8)
    for module in ddp.modules():
        if type(module).__name__ == "MegatronFSDP":
            module.is_last_microbatch = True  # what leaving no_sync() sets (one microbatch)
    ddp(tokens[rank], positions, None, labels=labels[rank]).float().mean().backward()
    ddp.finish_grad_sync()
    norm = float(optimizer.get_grad_norm())
    inner = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    grads = [g.to_local() if hasattr(g, "to_local") else g
             for part in inner for g in part.get_main_grads_for_grad_norm()]
    group = inner[0].get_grad_stats_parallel_group()
    (sum(ref(tokens[r], positions, None, labels=labels[r]).float().mean() for r in range(world))
     / world).backward()
    import mfsdp_hotfix

    states = {fix: entry["state"] for copy in mfsdp_hotfix.status()["copies"]
              for fix, entry in copy["fixes"].items()}
    return {"norm": norm, "replicated_grad_stats": states.get("replicated-grad-stats"),
            "ref": torch.stack([p.grad.norm() for p in ref.parameters()
                                if p.grad is not None]).norm().item(),
            "local_norm": torch.stack([g.float().norm() for g in grads]).norm().item(),
            "stats_group_size": dist.get_world_size(group) if group is not None else None}


if __name__ == "__main__":
    import rank_jobs

    rank_jobs.main(run)
