"""Megatron-FSDP v2 (``experimental``): ``status`` names it and says the hotfix does nothing
there; the audit reports a job that builds a v2 model as UNWATCHED with the reason, and a job that
only imports the package (as megatron-core's adapter does in every job) not at all.

The job is real v2 code from the NVIDIA/Megatron-LM clone's main branch, on CPU (gloo, one rank)
with the CUDA stand-in for its streams. Two things only a CUDA build has are stood in for: NVTX
ranges (a profiler annotation) are no-ops, and a DBuffer records the stand-in's current stream as
its allocation stream, as it does for a CUDA tensor (``allocation_stream`` is None on CPU).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import releases
from conftest import run_python

from mfsdp_hotfix import v2
from mfsdp_hotfix.audit import report

V2_JOB = """
import json, os, sys
from mfsdp_hotfix.selftest import cuda_standin
cuda_standin.install()
import torch, torch.distributed as dist
torch.cuda.nvtx.range_push = lambda message: 0
torch.cuda.nvtx.range_pop = lambda: 0
import mfsdp_hotfix
from mfsdp_hotfix import audit
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from torch.distributed import DeviceMesh
from torch.distributed.tensor import Shard
import megatron_fsdp.experimental as v2
from megatron_fsdp.experimental.dbuffer import DBuffer
allocate = DBuffer.__init__
def on_current_stream(self, *args, **kwargs):
    allocate(self, *args, **kwargs)
    self.allocation_stream = torch.cuda.current_stream()
DBuffer.__init__ = on_current_stream
imported = {"status": mfsdp_hotfix.status()["v2_copies"], "audit": audit.snapshot()["copies"]}
mesh = DeviceMesh("cpu", [0], mesh_dim_names=("dp",))
model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(3)))
placements = v2.Placements(dp_axes=[0], parameter=[Shard(0)], gradient=[Shard(0)],
                           optimizer=[Shard(0)])
with v2.fully_shard_context(device=torch.device("cuda", 0)):
    for layer in model:
        v2.fully_shard(layer, mesh=mesh, placements=placements)
    v2.fully_shard(model, mesh=mesh, placements=placements)
model(torch.randn(2, 4, requires_grad=True)).sum().backward()
print("V2JOB" + json.dumps(imported))
"""


def test_a_v2_job_is_named_by_status_and_unwatched_by_the_audit(tmp_path: Path) -> None:
    main = releases.git_tree("main")
    if main is None:
        pytest.skip(f"no clone of NVIDIA/Megatron-LM with refs/heads/main at "
                    f"{releases.MEGATRON_LM_GIT} (set MFSDP_TEST_MEGATRON_LM)")
    out = run_python(V2_JOB, main, args=("-c", V2_JOB, str(tmp_path / "store")),
                     env={"MFSDP_HOTFIX_AUDIT": str(tmp_path / "audit")})
    assert out.returncode == 0, out.stderr[-3000:]
    imported = json.loads(out.stdout.split("V2JOB", 1)[1])
    (named,) = imported["status"]
    assert named["package"] == "megatron_fsdp.experimental" and named["imported"]
    assert (named["hotfix"], named["reason"]) == ("nothing", v2.WHY)
    # importing the package is no v2 job: only the v1 copy, which built no pool, is listed
    assert [c["package"] for c in imported["audit"]] == ["megatron_fsdp"]

    reports, unreadable = report.read_rank_files(str(tmp_path / "audit"))
    assert unreadable == [] and reports[0]["final"]
    verdict, lines = report.summarise(reports, str(tmp_path / "audit"))
    assert verdict == "UNWATCHED"
    (line,) = [line for line in lines if line.startswith("megatron_fsdp.experimental")]
    assert "(era v2, hotfix fixes applied: none)" in line and f"[{v2.AUDIT_NOTE}]" in line
    assert "audit, 1 rank: UNWATCHED" in out.stderr  # the job line at exit
