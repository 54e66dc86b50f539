"""A minimal Megatron-FSDP training job, in the configuration the double-buffer bugs strike:
ZeRO-3 (``optim_grads_params``), ``fsdp_double_buffer=True`` and linears with fused wgrad
accumulation (TransformerEngine's contract, emulated in PyTorch by ``mfsdp_hotfix.selftest.model``
so that no TransformerEngine is needed). Run it as is, then adapt it::

    torchrun --nproc-per-node 2 examples/train_fsdp.py
    mfsdp-hotfix audit --out /tmp/mfsdp-example/run1 -- \
        torchrun --nproc-per-node 2 examples/train_fsdp.py
    MFSDP_HOTFIX=0 mfsdp-hotfix audit --out /tmp/mfsdp-example/shipped -- \
        torchrun --nproc-per-node 2 examples/train_fsdp.py

Where CUDA is available it trains on one GPU per rank over NCCL; elsewhere on the CPU over gloo,
with the selftest's ``torch.cuda`` stand-in (Megatron-FSDP calls CUDA streams and events; the
stand-in keeps their order, so that the audit can judge it, without a GPU). On a GPU with
TransformerEngine, ``--layer te-layernorm-mlp`` or ``--layer te-linear`` trains real TE layers.

Adapting it: replace ``model_lib.build_on`` by your model, ``model_lib.Unit`` by the class of
your FSDP units (e.g. your transformer layer), and the data and the plain SGD step by yours. The
hotfix itself needs nothing here: the installed ``.pth`` (or ``mfsdp-hotfix run``/``audit``)
loads it in every rank.
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    parser.add_argument("--layer", default="emulated",
                        choices=["emulated", "te-layernorm-mlp", "te-linear"],
                        help="the units' linears: 'emulated' fused wgrad (default; CPU or GPU), "
                             "or real TransformerEngine layers (GPU)")
    args = parser.parse_args()

    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        # Before anything imports, or even looks up, megatron_fsdp: that import is what loads
        # the hotfix and arms the audit, which must see the stand-in's streams.
        from mfsdp_hotfix.selftest import cuda_standin

        cuda_standin.install()
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank = dist.get_rank()

    import megatron_fsdp  # the standalone package; megatron-core's copy works the same way

    from mfsdp_hotfix.selftest import model as model_lib
    from mfsdp_hotfix.selftest.wrapping import wrap

    hidden, tokens = 64, 16
    net = model_lib.build_on(device, args.layer, hidden, units=5, seed=1234)
    # ZeRO-3 over all ranks with fsdp_double_buffer=True; every unit of this class is one FSDP
    # unit, and the units share the double-buffer pools.
    model = wrap(megatron_fsdp, net, type(net.units[0]), "optim_grads_params",
                 double_buffer=True, device=device)
    data = torch.Generator().manual_seed(rank)  # each rank its own batch, the same every step
    inputs = torch.randn(tokens, hidden, generator=data).to(device)
    targets = torch.randn(tokens, hidden, generator=data).to(device)
    for step in range(args.steps):
        model.zero_grad_buffer()
        loss = model_lib.loss_fn(model(inputs), targets)
        loss.backward()
        model.finish_grad_sync()  # the reduce-scatters are done: each rank holds its shard
        with torch.no_grad():  # plain SGD on the shards, then back into the model's weights
            for param in model.module.parameters():
                if param.grad is not None:
                    param.add_(param.grad, alpha=-0.1)
        model.install_optimized_model_weights()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    if rank == 0:
        import sys

        hotfix = sys.modules.get("mfsdp_hotfix")
        print(hotfix.summary() if hotfix else "mfsdp_hotfix: not loaded in this process",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
