"""The harness's optional optimizer step (``optimizer="adam"``) on Megatron-FSDP's shards."""

from __future__ import annotations

from typing import Any


class ShardOptimizer:
    """A real optimizer step on Megatron-FSDP's sharded parameters, as every release supports it:
    ``finish_grad_sync()`` attaches the reduced gradient shards to the distributed optimizer
    parameters (``model.parameters()`` after construction), ``torch.optim.Adam`` updates their
    local shards, ``install_optimized_model_weights()`` copies them into the model weights.
    Adam runs on the local tensors so that no DTensor dispatch (and no collective) is involved."""

    def __init__(self, torch: Any, model: Any, lr: float) -> None:
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.local = [_local(p).detach() for p in self.params]
        self.opt = torch.optim.Adam(self.local, lr=lr, foreach=False)

    def step(self) -> None:
        for p, loc in zip(self.params, self.local, strict=False):
            g = p.grad
            loc.grad = None if g is None else _local(g).detach().view_as(loc)
        self.opt.step()
        self.model.install_optimized_model_weights()
        for loc in self.local:
            loc.grad = None

    def local_params(self) -> Any:
        import torch

        return torch.cat([loc.detach().float().reshape(-1).cpu() for loc in self.local])


def _local(t: Any) -> Any:
    return t._local_tensor if hasattr(t, "_local_tensor") else t
