"""One rank of ``fully_shard`` over a model whose parameters are tensor-parallel DTensors,
column-wise (``Shard(0)``) and row-wise (``Shard(1)``), on real Megatron-FSDP (CPU, gloo).

Run as ``python rowwise_tp_job.py CONFIG_JSON RANK WORLD STORE OUT`` with the release first on
``PYTHONPATH`` and the repository after it. ``CONFIG_JSON``: ``dp`` and ``tp``, the sizes of the
(data-parallel, tensor-parallel) mesh; ``rowwise`` false shards both linears column-wise (each
output gathered).
Writes ``OUT/rank<R>.json``: ``built``, or the ``exception`` raised while building; once built,
the largest difference of the forward output and of every gathered gradient from plain PyTorch
(the same model, seed and data).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any


def run(config: dict[str, Any], rank: int, world: int, store: str) -> dict[str, Any]:
    from mfsdp_hotfix.selftest import cuda_standin

    cuda_standin.install()
    import torch
    import torch.distributed as dist
    from megatron_fsdp.fully_shard import fully_shard_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dist.init_process_group("gloo", store=dist.FileStore(store, world),  # type: ignore
                            rank=rank, world_size=world, timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (config["dp"], config["tp"]), mesh_dim_names=("fsdp", "tp"))

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = torch.nn.Linear(8, 16, bias=False)
            self.down = torch.nn.Linear(16, 8, bias=False)

        def forward(self, x: Any) -> Any:
            return x + self.down(torch.tanh(self.up(x)))

    def model() -> Any:
        torch.manual_seed(0)
        return torch.nn.Sequential(Block(), Block())

    net, ref = model(), model()
    if config.get("rowwise", True):  # Megatron's MLP: column-wise up, row-wise down
        plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    else:  # both column-wise, each output gathered whole
        plan = {name: ColwiseParallel(output_layouts=Replicate()) for name in ("up", "down")}
    for block in net:
        parallelize_module(block, mesh["tp"], plan)
    try:
        fsdp = fully_shard_model(module=net, device_mesh=mesh, dp_shard_dim="fsdp", tp_dim="tp",
                                 fsdp_unit_modules=[Block], zero_dp_strategy="optim_grads_params",
                                 device=torch.device("cpu"), sync_model_each_microbatch=True)
    except Exception as exc:
        return {"built": False, "exception": f"{type(exc).__name__}: {exc}"}
    fsdp.ddp_config.gradient_reduce_div_fusion = False
    gen = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(config["dp"], 4, 8, generator=gen), torch.randn(
        config["dp"], 4, 8, generator=gen)
    me = mesh["fsdp"].get_local_rank()
    out = fsdp(inputs[me])
    ((out - targets[me]) ** 2).mean().backward()
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
             for n, p in fsdp.module.named_parameters()}
    (sum(((ref(inputs[r]) - targets[r]) ** 2).mean() for r in range(config["dp"]))
     / config["dp"]).backward()
    local = out.full_tensor() if isinstance(out, DTensor) else out
    return {"built": True, "out": float((local - ref(inputs[me])).abs().max()),
            "grads": {n: float((grads[n].reshape(p.shape) - p.grad).abs().max())
                      for n, p in ref.named_parameters()}}


if __name__ == "__main__":
    import rank_jobs

    rank_jobs.main(run)
