"""The release defect ``rowwise-tp-global-shape-view``: ``fully_shard`` over row-wise
tensor-parallel DTensors, on the real releases (``rowwise_tp_job.py``, gloo ranks on CPU). Its
claim in docs/RELEASE_DEFECTS.md is that it is loud, at construction, where it was tried: no
silent error is left for the hotfix to refuse. Column-wise sharding builds and matches plain
PyTorch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import releases

pytestmark = pytest.mark.slow
JOB = Path(__file__).with_name("rowwise_tp_job.py")
INVALID = "DTensor chunk metadata is invalid"


def run_ranks(release: str, dp: int, tp: int, rowwise: bool = True) -> list[dict[str, Any]]:
    world = dp * tp
    with tempfile.TemporaryDirectory(prefix="mfsdp-rowwise-") as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MFSDP_HOTFIX")}
        env.update(PYTHONPATH=os.pathsep.join([str(releases.unpacked("megatron-fsdp", release)),
                                               str(releases.REPO)]),
                   GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                   MFSDP_HOTFIX="0")
        config = json.dumps({"dp": dp, "tp": tp, "rowwise": rowwise})
        procs = [subprocess.Popen([sys.executable, str(JOB), config, str(rank), str(world),
                                   f"{tmp}/store", tmp], env=env, stderr=subprocess.DEVNULL)
                 for rank in range(world)]
        for proc in procs:
            proc.wait(timeout=240)
        return [json.loads(Path(tmp, f"rank{rank}.json").read_text()) for rank in range(world)]


@pytest.mark.parametrize(("release", "dp"), [("0.4.0", 1), ("0.6.1", 1), ("0.6.1", 2)],
                         ids=["0.4.0-dp1", "0.6.1-dp1", "0.6.1-dp2"])
def test_rowwise_fails_loudly_when_built(release: str, dp: int) -> None:
    reports = run_ranks(release, dp, 2)
    assert not any(r.get("built") for r in reports), reports
    assert any(INVALID in r.get("exception", "") for r in reports), reports


def test_columnwise_builds_and_matches_plain_pytorch() -> None:
    reports = run_ranks("0.6.1", 1, 2, rowwise=False)
    assert all(r.get("built") for r in reports), reports
    assert reports[0]["out"] <= 1e-6 and max(reports[0]["grads"].values()) <= 1e-6, reports[0]
