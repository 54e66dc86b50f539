"""What a selftest rank's gradients are checked against: the full gradients gathered from the
ranks' shards, a single-process plain-PyTorch reference of the same steps, and how far the
one is from the other.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

from mfsdp_hotfix.compare import compare
from mfsdp_hotfix.selftest import protocol as accumulation
from mfsdp_hotfix.selftest.spec import CaseSpec


def gather_full(grads: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                shard_ranks: int | None = None) -> dict[str, Any]:
    """Full gradients from the ranks' row shards (Megatron-FSDP shards dim 0, rank order).

    A rank whose shard of a parameter is empty has ``grad is None`` there. An expert parameter
    (``.experts.`` in its name) is whole on every rank (its data-parallel group has one rank):
    rank 0's is taken.

    Written here rather than taken from the release: its uneven-DTensor gather uses an
    all-gather of unequal sizes, which gloo refuses.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    local = {n: (g.to_local() if isinstance(g, DTensor) else g).detach().clone()
             for n, g in grads.items() if g is not None}
    shards: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shards, local)
    full = {}
    # HSDP: the first DP-Outer group's shards make a whole; no_shard: rank 0's gradients
    shards = shards[:shard_ranks]
    for name, shape in shapes.items():
        owners = shards[:1] if ".experts." in name else shards
        pieces = [s[name].reshape(-1, *shape[1:]) for s in owners if name in s]
        if not pieces:
            raise AssertionError(f"no rank has a gradient for {name} after finish_grad_sync")
        joined = torch.cat(pieces, dim=0)
        if tuple(joined.shape) != tuple(shape):
            raise RuntimeError(f"harness: shards of {name} join to {tuple(joined.shape)}, "
                               f"expected {tuple(shape)}")
        full[name] = joined
    return full


def reference_gradients(spec: CaseSpec, inputs: Any, targets: Any, dtype: Any
                        ) -> list[dict[str, Any]]:
    """Plain single-process PyTorch: per iteration, the sum over microbatches of the mean over
    ranks of each rank's loss gradient (what both protocols define, ``protocol``), then an SGD
    step. The additions are made in the order the release's reduction makes them, so that a
    correct run is bit-identical: where the protocol reduces once per step
    (``protocol.reduces_once``), each rank's gradients are summed over microbatches first and
    the ranks' sums then averaged; otherwise each microbatch is averaged over ranks first."""
    from mfsdp_hotfix.selftest import model as model_lib

    ref = model_lib.build(spec.hidden, spec.units, spec.seed, "plain", dtype, spec.wide_units,
                          spec.experts, spec.norm, spec.outside, spec.head)
    ranks = inputs.shape[2]
    once = accumulation.reduces_once(spec.protocol, spec.strategy, spec.outer)
    out: list[dict[str, Any]] = []
    for it in range(spec.iterations):
        if once:
            per_rank = []
            for r in range(ranks):
                ref.zero_grad(set_to_none=True)
                for mb in range(spec.microbatches):
                    loss: Any = model_lib.loss_fn(ref(inputs[it, mb, r]), targets[it, mb, r])
                    loss.backward()
                per_rank.append({n: p.grad.detach().clone() for n, p in ref.named_parameters()
                                 if p.grad is not None})
            grads = {n: sum(g[n] * (1.0 / ranks) for g in per_rank) for n in per_rank[0]}
        else:
            ref.zero_grad(set_to_none=True)
            for mb in range(spec.microbatches):
                loss = sum(model_lib.loss_fn(ref(inputs[it, mb, r]), targets[it, mb, r])
                           for r in range(ranks)) / ranks
                loss.backward()
            grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()
                     if p.grad is not None}
        out.append(grads)
        for n, p in ref.named_parameters():
            p.grad = grads.get(n)
        sgd_step(ref.parameters(), spec.lr)
    return out


def sgd_step(params: Any, lr: float) -> None:
    """Plain SGD, the same elementwise op on full tensors (reference) and on shards (FSDP):
    on a DTensor's local tensor (DTensor refuses it in place over some meshes, e.g. HSDP's
    replicated no_shard parameters)."""
    import torch
    from torch.distributed.tensor import DTensor

    def local(tensor: Any) -> Any:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    with torch.no_grad():
        for p in params:
            if p.grad is not None and lr:
                local(p).add_(local(p.grad), alpha=-lr)


@dataclass
class GradCheck:
    """The gathered gradients of every iteration: a digest of them, and how far they are from
    the reference's where rank 0 compared them."""

    digest: Any = field(default_factory=hashlib.sha256)
    worst_abs: float = 0.0
    worst_rel: float = 0.0
    compared: int = 0
    per_param: dict[str, float] = field(default_factory=dict)  # "name@iteration" -> error > 0

    def add(self, grads: dict[str, Any], it: int, reference: dict[str, Any] | None) -> None:
        """Iteration ``it``'s gradients, and (rank 0) the reference's for that iteration."""
        for name in sorted(grads):
            self.digest.update(name.encode())
            self.digest.update(grads[name].contiguous().numpy().tobytes())
        for name, want in (reference or {}).items():
            got = grads[name].reshape(want.shape)
            # not bit-identity (another computation): how far from it, NaN/Inf: inf
            diff = compare([{name: got}], [{name: want}]).max_abs
            if diff is None:
                diff = math.inf
            self.compared += 1
            scale = want.abs().max().item() or 1.0
            self.worst_abs = max(self.worst_abs, diff)
            self.worst_rel = max(self.worst_rel, diff / scale)
            if diff > 0:
                self.per_param[f"{name}@{it}"] = diff

    def fields(self) -> dict[str, Any]:
        """Rank 0's report fields."""
        worst = sorted(self.per_param.items(), key=lambda kv: -kv[1])[:8]
        return {"grads_compared": self.compared,  # gradients, over all iterations
                "max_abs_grad_error": self.worst_abs if self.compared else None,  # none: no match
                "max_rel_grad_error": self.worst_rel,
                "grad_digest": self.digest.hexdigest(),
                "worst_grads": dict(worst)}
