"""The release defect ``rowwise-tp-global-shape-view``: ``fully_shard`` over row-wise
tensor-parallel DTensors, on the real releases (``rowwise_tp_job.py``, gloo ranks on CPU). Its
claim in docs/RELEASE_DEFECTS.md is that it is loud, at construction, where it was tried: no
silent error is left for the hotfix to refuse. Column-wise sharding builds and matches plain
PyTorch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import rank_jobs
import releases

pytestmark = pytest.mark.slow
JOB = Path(__file__).with_name("rowwise_tp_job.py")
INVALID = "DTensor chunk metadata is invalid"


def run_ranks(release: str, dp: int, tp: int, rowwise: bool = True) -> list[dict[str, Any]]:
    reports, _, logs = rank_jobs.run_ranks(JOB, releases.unpacked("megatron-fsdp", release),
                                           {"dp": dp, "tp": tp, "rowwise": rowwise},
                                           world=dp * tp, hotfix=False, timeout=240)
    assert all(r is not None for r in reports), logs
    return [r for r in reports if r is not None]


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
