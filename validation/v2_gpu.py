#!/usr/bin/env python3
"""Megatron-FSDP v2 on GPUs with a slow reduce-scatter, against the same run serialized.

docs/MEGATRON_FSDP_V2.md shows on CPU that v2 (the ``experimental`` package) waits at every
hand-over of gradient storage between its compute and reduce-scatter streams; what a CPU cannot
show is CUDA's caching allocator recycling a block across those streams and NCCL's ordering of
the collective. This runs v2 from the folder first on ``PYTHONPATH`` (``megatron_fsdp`` laid out
as the standalone package, e.g. ``tests/releases.git_tree("main")``) on N GPUs through NCCL:
6 ``nn.Linear`` units, 4 steps, fixed inputs that differ per rank, a GPU sleep enqueued before
every reduce-scatter (``--delay-ms``), with each unified/separate communication stream setting.
Every step's sharded gradients are hashed bit for bit, and the run is compared with the same
run under ``CUDA_LAUNCH_BLOCKING=1`` (every kernel serialized: no reuse can race).

    python3 validation/v2_gpu.py --gpus 2 --out v2-gpu.json      # driver; one line per case
    torchrun --nproc-per-node 2 validation/v2_gpu.py --rank-out F  # one run (the driver's child)

The last line is ``v2-gpu: PASS: ...`` (every case bit-identical to its serialized run) or
``v2-gpu: FAIL: ...``; exit 0 or 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

UNITS, STEPS, HIDDEN = 6, 4, 1024


def train(rank_out: str, delay_ms: float, unify: bool) -> None:
    import megatron_fsdp.experimental as v2
    import torch
    import torch.distributed as dist
    from torch.distributed import DeviceMesh
    from torch.distributed.tensor import Shard

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    cycles = _cycles_per_ms() * delay_ms
    collective = dist.reduce_scatter_tensor

    def slow_reduce_scatter(*args, **kwargs):  # type: ignore[no-untyped-def]
        if cycles:
            torch.cuda._sleep(int(cycles))  # on the stream the collective is ordered after
        return collective(*args, **kwargs)

    dist.reduce_scatter_tensor = slow_reduce_scatter
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(UNITS))).cuda()
    mesh = DeviceMesh("cuda", list(range(world)), mesh_dim_names=("dp",))
    placements = v2.Placements(dp_axes=[0], parameter=[Shard(0)], gradient=[Shard(0)],
                               optimizer=[Shard(0)])
    with v2.fully_shard_context(unify_communication_stream=unify):
        for layer in model:
            v2.fully_shard(layer, mesh=mesh, placements=placements)
        v2.fully_shard(model, mesh=mesh, placements=placements)
    hashes = []
    for step in range(STEPS):
        data = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(100 * step + rank))
        model(data.cuda()).square().mean().backward()
        torch.cuda.synchronize()
        grads = torch.cat([p.grad.to_local().flatten() for p in model.parameters()])
        hashes.append(hashlib.sha256(grads.cpu().numpy().tobytes()).hexdigest())
        model.zero_grad(set_to_none=True)
    with open(f"{rank_out}.rank{rank}", "w") as handle:
        json.dump(hashes, handle)
    dist.destroy_process_group()


def _cycles_per_ms() -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def drive(gpus: int, delay_ms: float, out: str) -> int:
    cases = []
    for unify in (False, True):
        runs = {}
        for serialized in (False, True):
            with tempfile.TemporaryDirectory() as folder:
                prefix = os.path.join(folder, "hashes")
                env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1" if serialized else "0")
                command = [sys.executable, "-m", "torch.distributed.run",
                           f"--nproc-per-node={gpus}", __file__, "--rank-out", prefix,
                           "--delay-ms", str(delay_ms)] + (["--unify"] if unify else [])
                try:
                    done = subprocess.run(command, env=env, capture_output=True, text=True,
                                          timeout=600)
                    failure = done.stderr[-3000:] if done.returncode else None
                except subprocess.TimeoutExpired:
                    failure = "timed out after 600 s"
                runs[serialized] = (None if failure else
                                    [_read(f"{prefix}.rank{r}") for r in range(gpus)])
                if failure:
                    print(failure, file=sys.stderr)
        identical = runs[False] is not None and runs[False] == runs[True]
        cases.append({"unify_communication_stream": unify, "delay_ms": delay_ms, "gpus": gpus,
                      "steps": STEPS, "units": UNITS, "bit_identical": identical,
                      "hashes": runs[False], "serialized_hashes": runs[True]})
        print(f"unify_communication_stream={unify}: "
              + ("bit-identical" if identical else "DIFFERENT or failed")
              + f" ({gpus} GPUs, {STEPS} steps, {delay_ms:g} ms slow reduce-scatter)")
    with open(out, "w") as handle:
        json.dump(cases, handle, indent=1)
    passed = all(case["bit_identical"] for case in cases)
    print(f"v2-gpu: {'PASS' if passed else 'FAIL'}: "
          f"{sum(c['bit_identical'] for c in cases)} of {len(cases)} cases bit-identical to "
          f"their serialized run ({out})")
    return 0 if passed else 1


def _read(path: str) -> list[str]:
    with open(path) as handle:
        return list(json.load(handle))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--out", default="v2-gpu.json")
    parser.add_argument("--rank-out", help="(child) write this rank's hashes to RANK_OUT.rank<N>")
    parser.add_argument("--unify", action="store_true", help="(child) one communication stream")
    args = parser.parse_args()
    if args.rank_out:
        train(args.rank_out, args.delay_ms, args.unify)
        return 0
    return drive(args.gpus, args.delay_ms, args.out)


if __name__ == "__main__":
    sys.exit(main())
