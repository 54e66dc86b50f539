"""The cross-rank check on two real gloo ranks running Megatron-FSDP 0.6.1: ranks that applied
different fixes, or a rank without the hotfix, are named; ``warn`` downgrades it."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SPEC = {"flavour": "standalone", "units": 5, "iterations": 2, "timeout_s": 60.0}


def rank_log(tmp_path: Path, rank: int) -> str:
    return (tmp_path / f"rank{rank}.log").read_text(errors="replace")


def test_a_rank_without_the_hotfix_is_named(tmp_path: Path, fsdp_release) -> None:
    from conftest import launch_ranks

    reports = launch_ranks(SPEC,
                           [{"MFSDP_HOTFIX_CROSS_RANK_TIMEOUT": "5"}, {"MFSDP_HOTFIX": "0"}],
                           tmp_path, path=(fsdp_release("0.6.1"),))
    patched = reports[0]
    assert patched is not None and patched["crashed"], rank_log(tmp_path, 0)
    assert patched["exception"].startswith("RankMismatch")
    assert "ranks 1: no report within 5 s (mfsdp_hotfix not loaded or disabled there)" in \
        patched["exception"]


def test_ranks_with_different_fixes_both_fail(tmp_path: Path, fsdp_release) -> None:
    from conftest import launch_ranks

    reports = launch_ranks(SPEC,
                           [{}, {"MFSDP_HOTFIX_DISABLED_FIXES": "ordered-drain"}], tmp_path,
                           path=(fsdp_release("0.6.1"),))
    for rank, report in enumerate(reports):
        assert report is not None and report["crashed"], rank_log(tmp_path, rank)
        assert report["exception"].startswith("RankMismatch")
        assert "ranks 0:" in report["exception"] and "ranks 1:" in report["exception"]
        assert "(this rank)" in report["exception"]


def test_warn_mode_lets_the_job_run(tmp_path: Path, fsdp_release) -> None:
    from conftest import launch_ranks

    warn = {"MFSDP_HOTFIX_CROSS_RANK_CHECK": "warn"}
    reports = launch_ranks(SPEC,
                           [warn, {**warn, "MFSDP_HOTFIX_DISABLED_FIXES": "ordered-drain"}],
                           tmp_path, path=(fsdp_release("0.6.1"),))
    for rank, report in enumerate(reports):
        assert report is not None and not report["crashed"], rank_log(tmp_path, rank)
        assert "ranks run differently patched Megatron-FSDP code" in rank_log(tmp_path, rank)


def test_identical_ranks_pass_silently(tmp_path: Path, fsdp_release) -> None:
    from conftest import launch_ranks

    reports = launch_ranks(SPEC, [{}, {}], tmp_path, path=(fsdp_release("0.6.1"),))
    for rank, report in enumerate(reports):
        assert report is not None and not report["crashed"], rank_log(tmp_path, rank)
        assert "differently patched" not in rank_log(tmp_path, rank)


def test_a_store_that_cannot_set_keys_only_warns() -> None:
    """torch's fake process group (used for one-GPU validation) has a store without ``set``: the
    check must disable itself with one warning, never break the model's construction."""
    from conftest import run_python

    code = """
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import mfsdp_hotfix
from mfsdp_hotfix import installer
mfsdp_hotfix.install()
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
from types import SimpleNamespace
built = []
record = SimpleNamespace(detection=SimpleNamespace(shapes={}), fixes={})  # needs no fix
for _ in range(2):
    installer._after_model_init(record, lambda: built.append(1),
                                SimpleNamespace(ddp_config=None), (), {})
print("REPORT", len(built), sorted(mfsdp_hotfix.status()["failures"]))
"""
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REPORT 2 ['cross-rank-check']" in proc.stdout
    assert proc.stderr.count("cross-rank-check failed in") == 1
