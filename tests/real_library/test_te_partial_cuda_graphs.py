"""The release defect ``te-partial-cuda-graphs``, which no fix repairs: a Megatron-FSDP model
(megatron-core's vendored copy, real ``TransformerConfig``) is refused when it is built with
TransformerEngine's per-layer CUDA graphs asked for, builds as shipped, and builds with the hotfix
without them (``cuda_graph_job.py``). The defect itself needs TransformerEngine on a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import releases
from cuda_graph_job import run_job

from mfsdp_hotfix import release_defects

TE = {"cuda_graph_impl": "transformer_engine"}


def holding(config: object) -> SimpleNamespace:
    import torch

    root = torch.nn.Sequential(torch.nn.Linear(2, 2))
    root[0].config = config
    return SimpleNamespace(module=root)


@pytest.mark.parametrize(("config", "refused"), [
    (SimpleNamespace(cuda_graph_impl="transformer_engine"), True),
    (SimpleNamespace(cuda_graph_impl="none", external_cuda_graph=True), True),  # 0.14's name
    (SimpleNamespace(cuda_graph_impl="full_iteration"), False),
    (SimpleNamespace(cuda_graph_impl="local"), False),
    (None, False)], ids=["te", "external", "full-iteration", "local", "no-config"])
def test_the_configurations_it_hits(config: object, refused: bool) -> None:
    assert release_defects.te_partial_cuda_graphs(holding(config)) is refused


@pytest.mark.slow
def test_refused_when_built_with_the_hotfix_and_built_without() -> None:
    core = releases.unpacked("megatron-core", "0.17.1")
    refused = run_job(core, True, **TE)
    assert not refused["built"] and "UnsupportedConfiguration" in refused["exception"], refused
    assert "per-layer CUDA graphs" in refused["exception"]
    assert "cuda_graph_impl='none'" in refused["exception"]  # the workaround
    assert run_job(core, True, external_cuda_graph=True)["built"] is False
    assert run_job(core, False, **TE)["built"] is True  # as shipped: nothing stops it
    assert run_job(core, True)["built"] is True  # no CUDA graphs: built as before
