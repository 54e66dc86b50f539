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
from typing import Any

import pytest
import releases
from conftest import run_python

from mfsdp_hotfix import v2
from mfsdp_hotfix.audit.rank_files import read_rank_files
from mfsdp_hotfix.audit.summary import summarise

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

    reports, unreadable = read_rank_files(str(tmp_path / "audit"))
    assert unreadable == [] and reports[0]["final"]
    verdict, lines = summarise(reports, str(tmp_path / "audit"))
    assert verdict == "UNWATCHED"
    (at,) = [at for at, line in enumerate(lines) if line.startswith("megatron_fsdp.experimental")]
    assert "(era v2), ranks 0: UNWATCHED: " in lines[at], lines
    assert lines[at + 1:at + 3] == ["  hotfix fixes applied: none", f"  why: {v2.AUDIT_NOTE}"], \
        lines
    assert "audit, 1 rank: UNWATCHED" in out.stderr  # the job line at exit


# Real v2 code, three steps of one rank, each cross-stream hand-over of gradient storage checked
# on the stand-in's vector clocks. What CUDA's caching allocator does, and what this checks:
# a block freed by the host returns to the pool of the stream that allocated it and is handed to
# that stream's next allocation at once, ordered by that stream alone. So storage is safe to
# reuse when (1) another stream writing into a block allocated on the reduce-scatter stream has
# first waited for all work enqueued there (else it may overwrite an earlier reduce-scatter's
# input still being read), (2) a reduce-scatter reads its input after it is written, (3) a
# reduce-scatter writing the persistent main_grad is ordered after the previous step's
# optimizer read it, and (4) the optimizer reads gradients only after every reduce-scatter.
# Then the same with one or two of v2's waits not executed: each rule must find its wait missing.
ORDERING = V2_JOB.split("imported = ", 1)[0] + """
import linecache
from mfsdp_hotfix.selftest import cuda_standin
from megatron_fsdp.experimental.parameter_group import FsdpParameterGroup
RULES = ("rs_input_written_unordered", "rs_read_before_input_written",
         "main_grad_written_before_optimizer_read", "optimizer_read_before_rs")
skipped, found, events = set(), {}, {}
wait_stream = cuda_standin.Stream.wait_stream
def maybe_wait(self, other):
    caller = sys._getframe(1)
    if linecache.getline(caller.f_code.co_filename, caller.f_lineno).strip() not in skipped:
        wait_stream(self, other)
cuda_standin.Stream.wait_stream = maybe_wait
original_reduce_scatter = dist.reduce_scatter_tensor
def reduce_scatter(*args, **kwargs):
    stream = torch.cuda.current_stream()
    found["reduce_scatters"] += 1
    written = events["written"].pop(kwargs["input"].data_ptr())
    found["rs_read_before_input_written"] += not stream.has_waited_for(written)
    if events["optimizer"]:
        found["main_grad_written_before_optimizer_read"] += not stream.has_waited_for(
            events["optimizer"][-1])
    result = original_reduce_scatter(*args, **kwargs)
    events["reduce_scatters"].append(stream.record_event())
    return result
dist.reduce_scatter_tensor = reduce_scatter
allocate_input = FsdpParameterGroup.allocate_partial_grad_buffer
def allocated_on_rs_stream(self):
    buffer = allocate_input(self)
    events["allocated"][id(buffer)] = torch.cuda.current_stream().record_event()
    return buffer
FsdpParameterGroup.allocate_partial_grad_buffer = allocated_on_rs_stream
copy_in = FsdpParameterGroup.copy_gradients_to_partial_buffer
def write_input(self, partial_grad):
    stream = torch.cuda.current_stream()
    found["rs_input_writes"] += 1
    found["rs_input_written_unordered"] += not stream.has_waited_for(
        events["allocated"].pop(id(partial_grad)))
    copy_in(self, partial_grad)
    events["written"][partial_grad.local_buffer.data_ptr()] = stream.record_event()
FsdpParameterGroup.copy_gradients_to_partial_buffer = write_input
def train(without):
    skipped.clear()
    skipped.update(without)
    found.update(dict.fromkeys(RULES + ("reduce_scatters", "rs_input_writes"), 0))
    events.update(allocated={}, written={}, reduce_scatters=[], optimizer=[])
    mesh = DeviceMesh("cpu", [0], mesh_dim_names=("dp",))
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(3)))
    placements = v2.Placements(dp_axes=[0], parameter=[Shard(0)], gradient=[Shard(0)],
                               optimizer=[Shard(0)])
    with v2.fully_shard_context(device=torch.device("cuda", 0)):
        for layer in model:
            v2.fully_shard(layer, mesh=mesh, placements=placements)
        v2.fully_shard(model, mesh=mesh, placements=placements)
    for step in range(3):
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
        compute = torch.cuda.current_stream()
        found["optimizer_read_before_rs"] += sum(
            not compute.has_waited_for(e) for e in events["reduce_scatters"])
        grads = [p.grad for p in model.parameters()]  # the optimizer's read, then zero_grad
        model.zero_grad(set_to_none=True)
        events["optimizer"].append(compute.record_event())
    return dict(found)
print("ORDERING" + json.dumps([train(without) for without in json.loads(sys.argv[2])]))
"""
# v2's waits on main (module.py), each taken out alone or with the one that covers for it, and
# the rules that must then fail.
AFTER_ALLOCATING = "current_stream.wait_stream(reduce_scatter_stream)"
BEFORE_REDUCING = "reduce_scatter_stream.wait_stream(current_stream)"
AT_BACKWARD_START = "context.reduce_scatter_stream.wait_stream(current_stream)"
AT_BACKWARD_END = "self.current_stream().wait_stream(self.reduce_scatter_stream)"
MUTANTS: list[tuple[tuple[str, ...], set[str]]] = [
    ((), set()),
    ((AFTER_ALLOCATING,), {"rs_input_written_unordered"}),
    ((BEFORE_REDUCING,), {"rs_read_before_input_written"}),
    ((AT_BACKWARD_START,), set()),  # the wait before each reduce-scatter covers for it
    ((BEFORE_REDUCING, AT_BACKWARD_START),
     {"rs_read_before_input_written", "main_grad_written_before_optimizer_read"}),
    ((AT_BACKWARD_END,), {"optimizer_read_before_rs"}),
]


def test_v2_on_main_orders_every_reuse_of_gradient_storage(tmp_path: Path) -> None:
    main = releases.git_tree("main")
    if main is None:
        pytest.skip(f"no clone of NVIDIA/Megatron-LM with refs/heads/main at "
                    f"{releases.MEGATRON_LM_GIT} (set MFSDP_TEST_MEGATRON_LM)")
    lines = [line.strip() for line in (main / "megatron_fsdp/experimental/module.py").open()]
    for without, _ in MUTANTS:
        assert all(lines.count(wait) == 1 for wait in without), without
    runs = json.dumps([without for without, _ in MUTANTS])
    out = run_python(ORDERING, main, args=("-c", ORDERING, str(tmp_path / "store"), runs))
    assert out.returncode == 0, out.stderr[-3000:]
    for (without, broken), found in zip(MUTANTS, json.loads(out.stdout.split("ORDERING", 1)[1]),
                                        strict=True):
        assert found.pop("reduce_scatters") == found.pop("rs_input_writes") == 9  # 3 units x 3
        assert {rule for rule, count in found.items() if count} == broken, (without, found)


def test_status_names_an_installed_v2_package_that_is_not_imported(fsdp_release: Any) -> None:
    code = ("import sys, json; sys.modules['torch'] = None; import mfsdp_hotfix; "
            "print('STATUS' + json.dumps(mfsdp_hotfix.status()['v2_copies']))")
    out = run_python(code, fsdp_release("0.6.1"))
    (named,) = json.loads(out.stdout.split("STATUS", 1)[1])
    assert (named["package"], named["version"], named["imported"]) == (
        "megatron_fsdp.experimental", "0.6.1", False)
    assert named["path"] == str(fsdp_release("0.6.1") / "megatron_fsdp" / "experimental")
