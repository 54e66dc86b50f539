"""gloo's stand-in for NCCL's PREMUL_SUM (``mfsdp_hotfix.selftest.premul``): the reduced values
are the scaled sum, and a reduce-scatter leaves its input buffer unscaled, as NCCL does."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

from mfsdp_hotfix.selftest import premul


def test_premul_sum_on_a_one_rank_gloo_group() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        saved = (dist.reduce_scatter_tensor, dist.all_reduce, dist._make_nccl_premul_sum)
        try:
            premul.install()
            op = dist._make_nccl_premul_sum(0.5)
            buffer = torch.tensor([2.0, 4.0])
            out = torch.empty(2)
            dist.reduce_scatter_tensor(out, buffer, op=op)
            assert out.tolist() == [1.0, 2.0] and buffer.tolist() == [2.0, 4.0]
            dist.all_reduce(buffer, op=op)
            assert buffer.tolist() == [1.0, 2.0]
            plain = torch.tensor([3.0])
            dist.all_reduce(plain)  # other ops pass through
            assert plain.tolist() == [3.0]
        finally:
            dist.reduce_scatter_tensor, dist.all_reduce = saved[0], saved[1]
            dist._make_nccl_premul_sum = saved[2]
            dist._mfsdp_premul_emulated = False
            dist.destroy_process_group()
