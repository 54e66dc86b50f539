"""The release defect ``te-partial-cuda-graphs``, which no fix repairs: a Megatron-FSDP model
(megatron-core's vendored copy, real ``TransformerConfig``) is refused when it is built with
TransformerEngine's per-layer CUDA graphs asked for, builds as shipped, and builds with the hotfix
without them (``cuda_graph_job.py``). The defect itself needs TransformerEngine on a GPU: it is
upstream's report, not reproduced here."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import rank_jobs
import releases

from mfsdp_hotfix import limits

JOB = Path(__file__).with_name("cuda_graph_job.py")
TE = {"cuda_graph_impl": "transformer_engine"}


def holding(config: object) -> SimpleNamespace:
    import torch

    root = torch.nn.Sequential(torch.nn.Linear(2, 2))
    root[0].config = config  # type: ignore[assignment]
    return SimpleNamespace(module=root)


@pytest.mark.parametrize(("config", "refused"), [
    (SimpleNamespace(cuda_graph_impl="transformer_engine"), True),
    (SimpleNamespace(cuda_graph_impl="none", external_cuda_graph=True), True),  # 0.14's name
    (SimpleNamespace(cuda_graph_impl="full_iteration"), False),
    (SimpleNamespace(cuda_graph_impl="local"), False),
    (None, False)], ids=["te", "external", "full-iteration", "local", "no-config"])
def test_the_configurations_it_hits(config: object, refused: bool) -> None:
    assert limits.te_partial_cuda_graphs(holding(config)) is refused


def build(hotfix: bool, **config: Any) -> dict[str, Any]:
    core = releases.unpacked("megatron-core", "0.17.1")
    (report,), _, logs = rank_jobs.run_ranks(JOB, core, config, world=1, hotfix=hotfix)
    assert report is not None and "traceback" not in report, (report, logs)
    return report


@pytest.mark.slow
def test_refused_when_built_with_the_hotfix_and_built_without() -> None:
    refused = build(True, **TE)
    assert not refused["built"] and "UnsupportedConfiguration" in refused["exception"], refused
    assert "per-layer CUDA graphs" in refused["exception"]
    assert "cuda_graph_impl='none'" in refused["exception"]  # the workaround
    assert build(True, external_cuda_graph=True)["built"] is False
    assert build(False, **TE)["built"] is True  # as shipped: nothing stops it
    assert build(True)["built"] is True  # no CUDA graphs: built as before
