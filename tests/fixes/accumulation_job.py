"""One rank of a gradient-accumulation run on real Megatron-FSDP (CPU, gloo), driven as
Megatron-LM drives it: ``sync_model_each_microbatch=False`` and ``no_sync()`` around every
microbatch but the last, then ``finish_grad_sync()``.

Run as ``python accumulation_job.py CONFIG_JSON RANK WORLD STORE OUT`` with the release first on
``PYTHONPATH`` and the repository after it; ``MFSDP_HOTFIX=0`` in the environment runs the
release as shipped. ``CONFIG_JSON``: ``strategy``, ``microbatches``, ``linear`` ("emulated":
fused wgrad with TransformerEngine's contract; "unfused": plain autograd), ``iterations``;
``auto_sync`` true: fully_shard's default instead (gradients synchronised after every
microbatch, no ``no_sync()``).
Writes ``OUT/rank<R>.json``: rank 0 adds the comparison (``mfsdp_hotfix.compare``) of the full
gradients with plain PyTorch, and every rank the ``overwrite_main_grad`` values its parameters
carried in the last backward, and what the hotfix reports for the copy.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any


def run(config: dict[str, Any], rank: int, world: int, store_path: str) -> dict[str, Any]:
    import mfsdp_hotfix
    from mfsdp_hotfix.selftest import cuda_standin

    cuda_standin.install()
    import megatron_fsdp  # noqa: F401  (the hooks patch it here)
    import torch
    import torch.distributed as dist
    from megatron_fsdp import fully_shard

    from mfsdp_hotfix.compare import compare
    from mfsdp_hotfix.selftest import model as model_lib
    from mfsdp_hotfix.selftest.gradient_check import gather_full
    from mfsdp_hotfix.selftest.spec import CaseSpec
    from mfsdp_hotfix.selftest.wrapping import wrap

    spec = CaseSpec(strategy=config["strategy"], microbatches=config["microbatches"],
                    linear=config.get("linear", "emulated"),
                    iterations=config.get("iterations", 2), units=3, double_buffer=False)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world),  # type: ignore
                            rank=rank, world_size=world, timeout=timedelta(seconds=60))
    inputs = model_lib.batches(spec.hidden, spec.tokens, world, spec.microbatches,
                               spec.iterations, spec.seed)
    targets = model_lib.batches(spec.hidden, spec.tokens, world, spec.microbatches,
                                spec.iterations, spec.seed + 7)
    net = model_lib.build(spec.hidden, spec.units, spec.seed, spec.linear)
    fsdp = wrap(fully_shard, net, model_lib.Unit, spec.strategy, False, torch.device("cpu"),
                options={"sync_model_each_microbatch": bool(config.get("auto_sync"))})
    seen: dict[str, Any] = {}
    steps: list[dict[str, Any]] = []
    for it in range(spec.iterations):
        fsdp.zero_grad_buffer()
        for mb in range(spec.microbatches):
            last = mb == spec.microbatches - 1
            plain = last or config.get("auto_sync")
            if last and not config.get("auto_sync"):
                # what leaving no_sync() sets; with one microbatch nothing else would (this
                # release reduces unsharded gradients only on a last microbatch or auto-sync)
                fsdp.is_last_microbatch = True
            with contextlib.nullcontext() if plain else fsdp.no_sync():
                out = fsdp(inputs[it, mb, rank])
                model_lib.loss_fn(out, targets[it, mb, rank]).backward()
        seen = {name: getattr(param, "overwrite_main_grad", None)
                for name, param in fsdp.module.named_parameters()}
        fsdp.finish_grad_sync()
        named = dict(fsdp.module.named_parameters())
        steps.append(gather_full({n: p.grad for n, p in named.items()},
                                 {n: tuple(p.shape) for n, p in named.items()}))
        with torch.no_grad():
            for param in fsdp.module.parameters():
                if param.grad is not None:
                    param.add_(param.grad, alpha=-spec.lr)
        fsdp.install_optimized_model_weights()
    report: dict[str, Any] = {"overwrite_main_grad": seen, "status": mfsdp_hotfix.status()}
    if rank == 0:
        want = reference(spec, inputs, targets, world)
        got = [{n: step[n].reshape(ref[n].shape) for n in ref} for step, ref in zip(
            steps, want, strict=True)]
        report["comparison"] = compare(got, want).to_dict()
    return report


def reference(spec: Any, inputs: Any, targets: Any, world: int) -> list[dict[str, Any]]:
    """Plain PyTorch, adding in the order the strategy does. Unsharded gradients (ZeRO-1): each
    rank accumulates its microbatches, then the ranks' sums are averaged once. Sharded ones
    (ZeRO-2/3): each microbatch is averaged over the ranks, then the microbatches are added.
    Averaging is scaling by 1/world (a power of two) and summing in rank order, as the release
    reduces with ``gradient_reduce_div_fusion=False``. An SGD step per iteration."""
    import torch

    from mfsdp_hotfix.selftest import model as model_lib

    ref = model_lib.build(spec.hidden, spec.units, spec.seed, "plain")
    out: list[dict[str, Any]] = []
    for it in range(spec.iterations):
        per_microbatch = spec.strategy in ("optim_grads", "optim_grads_params")
        total: dict[str, Any] = {}
        for group in ([[mb] for mb in range(spec.microbatches)] if per_microbatch
                      else [list(range(spec.microbatches))]):
            mean: dict[str, Any] = {}
            for rank in range(world):
                ref.zero_grad(set_to_none=True)
                for mb in group:
                    model_lib.loss_fn(ref(inputs[it, mb, rank]),
                                      targets[it, mb, rank]).backward()
                for name, param in ref.named_parameters():
                    share = param.grad.detach() * (1.0 / world)
                    mean[name] = share if name not in mean else mean[name] + share
            for name, value in mean.items():
                total[name] = value if name not in total else total[name] + value
        out.append(total)
        with torch.no_grad():
            for name, param in ref.named_parameters():
                param.add_(total[name], alpha=-spec.lr)
    return out


if __name__ == "__main__":
    import rank_jobs

    rank_jobs.main(run)
