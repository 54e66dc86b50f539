"""``replicated-grad-stats`` and the release defect it repairs,
``no-shard-grad-norm-counts-every-rank``: megatron-core's own Megatron-FSDP path (its adapter,
``get_megatron_optimizer``'s distributed optimizer) on two gloo ranks on CPU
(``grad_norm_job.py``), the norm the optimizer clips by against plain PyTorch's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import rank_jobs
import releases

pytestmark = pytest.mark.slow
JOB = Path(__file__).with_name("grad_norm_job.py")
# What the test asserts, and docs/RELEASE_DEFECTS.md reports: the no_shard norm over the
# reference's at two data-parallel ranks on megatron-core 0.17.1 (the square root of 2).
SHIPPED_RATIO = 1.41421


def run_ranks(version: str, strategy: str, hotfix: bool = False) -> dict[str, Any]:
    reports, _, logs = rank_jobs.run_ranks(JOB, releases.unpacked("megatron-core", version),
                                           {"strategy": strategy}, hotfix=hotfix)
    report = reports[0]
    assert report is not None and "exception" not in report, (report or {}).get("traceback", logs)
    return report


def test_no_shard_counts_each_rank_as_shipped_and_once_with_the_fix() -> None:
    shipped = run_ranks("0.17.1", "no_shard")
    assert shipped["local_norm"] == pytest.approx(shipped["ref"], rel=1e-6)  # gradients right
    assert shipped["norm"] / shipped["ref"] == pytest.approx(SHIPPED_RATIO, rel=1e-5)
    fixed = run_ranks("0.17.1", "no_shard", hotfix=True)
    assert fixed["replicated_grad_stats"] == "applied"
    assert fixed["norm"] == pytest.approx(fixed["ref"], rel=1e-6)
    assert fixed["stats_group_size"] == 1  # the model-parallel group


@pytest.mark.parametrize(("version", "strategy"), [("0.18.2", "no_shard"),
                                                   ("0.17.1", "optim"),
                                                   ("0.17.1", "optim_grads_params")])
def test_right_where_fixed_or_sharded_and_left_as_shipped(version: str, strategy: str) -> None:
    shipped, fixed = run_ranks(version, strategy), run_ranks(version, strategy, hotfix=True)
    assert shipped["norm"] == pytest.approx(shipped["ref"], rel=1e-6)
    assert fixed["norm"] == shipped["norm"]  # bit for bit
    assert fixed["replicated_grad_stats"] == ("not needed" if version == "0.18.2" else "applied")
