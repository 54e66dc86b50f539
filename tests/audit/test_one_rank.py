"""What the audit records of a copy's one-rank gradient buffers (the size-one group defect,
``release_defects.SINGLE_RANK_GRADS``): the buffers per model, dense and expert apart, the
microbatches a model accumulates, and whether the copy's code has the defect."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path
from typing import Any

import pytest
import releases
import torch

from mfsdp_hotfix import detection, registry
from mfsdp_hotfix.audit.copies import (
    CopyAudit,
    OneRankGrads,
    single_rank_defect,
    watch_model_module,
)


class _Group:
    def __init__(self, ranks: int, expert: bool = False, grads: bool = True) -> None:
        group = types.SimpleNamespace(size=lambda: ranks)
        self.is_expert_param = expert
        self.main_grad_buffer = types.SimpleNamespace(data_parallel_group=group) if grads \
            else None


class _Model:
    """The attributes of a built ``MegatronFSDP`` the audit reads."""

    def __init__(self, groups: list[_Group], strategy: str = "optim_grads_params",
                 hybrid: bool = False) -> None:
        self.ddp_config = types.SimpleNamespace(data_parallel_sharding_strategy=strategy)
        self.param_and_grad_buffer = types.SimpleNamespace(
            parameter_groups=groups, dist_index=types.SimpleNamespace(use_hybrid_fsdp=hybrid))


@pytest.mark.parametrize(("model", "counts"), [
    (_Model([_Group(1), _Group(1), _Group(1, expert=True)]), (2, 1, 0)),  # data-parallel 1
    (_Model([_Group(2), _Group(1, expert=True)]), (0, 1, 0)),  # EP = DP: the experts' only
    (_Model([_Group(1)], strategy="optim_grads"), (1, 0, 0)),  # ZeRO-2
    (_Model([_Group(1), _Group(1, grads=False)], hybrid=True), (1, 0, 1)),  # HSDP, DP-Shard 1
    (_Model([_Group(2), _Group(2, expert=True)]), (0, 0, 0)),  # no group of one rank
    (_Model([_Group(1)], strategy="optim"), (0, 0, 0)),  # ZeRO-1: zero1-accumulate's
    (_Model([_Group(1)], strategy="no_shard"), (0, 0, 0))])
def test_a_models_one_rank_gradient_buffers_are_counted_at_its_first_forward(
        model: _Model, counts: tuple[int, int, int]) -> None:
    found = OneRankGrads()
    for _ in range(3):
        found.forwarded(model)
    assert (found.dense, found.expert, found.hybrid) == counts  # counted once per model
    assert found.microbatches == (3 if sum(counts) else 0)
    written = found.as_dict("yes", False)
    assert (written is None) == (not sum(counts))


def test_microbatches_are_the_forwards_with_gradients_between_two_zero_grad_buffer() -> None:
    class MegatronFSDP(_Model):
        def forward(self, x: int) -> int:
            return x + 1

        def zero_grad_buffer(self) -> None:
            pass

        def finish_grad_sync(self) -> str:
            return "synced"

    originals = dict(MegatronFSDP.__dict__)
    module = types.ModuleType("megatron_fsdp.megatron_fsdp")
    module.MegatronFSDP = MegatronFSDP  # type: ignore[attr-defined]
    record = CopyAudit("megatron_fsdp", "0.6.1", "C")
    steps: list[int] = []
    undo = watch_model_module(module, lambda: steps.append(1), lambda: record, _raise)
    assert undo is not None
    model = MegatronFSDP([_Group(1), _Group(1)])
    for microbatches in (2, 4, 1):
        model.zero_grad_buffer()
        assert [model.forward(i) for i in range(microbatches)] == list(range(1, microbatches + 1))
        with torch.no_grad():
            model.forward(0)  # an evaluation forward is no microbatch
        assert model.finish_grad_sync() == "synced"
    assert record.one_rank.microbatches == 4 and steps == [1, 1, 1]
    assert (record.one_rank.dense, record.one_rank.expert) == (2, 0)  # counted once
    # a model whose forward bypasses MegatronFSDP.forward: counted at its finish_grad_sync
    other = MegatronFSDP([_Group(1, expert=True)])
    other.finish_grad_sync()
    assert (record.one_rank.dense, record.one_rank.expert) == (2, 1)
    assert record.as_dict([])["one_rank_grads"] == {
        "dense": 2, "expert": 1, "hsdp": 0, "microbatches": 4, "defect": "unknown",
        "may_self_add": True}
    assert undo() and all(MegatronFSDP.__dict__[name] is originals[name]
                          for name in ("forward", "zero_grad_buffer", "finish_grad_sync"))


def _copy_of(release: Path, distribution: str) -> tuple[registry.Copy, Path]:
    copy = next(c for c in registry.COPIES if c.distribution == distribution)
    return copy, release.joinpath(*copy.buffer_module.split(".")).with_suffix(".py")


@pytest.mark.parametrize(("distribution", "version", "want"), [
    ("megatron-fsdp", "0.6.1", ("yes", False)),
    ("megatron-fsdp", "0.4.0", ("yes", False)),
    ("megatron-fsdp", "0.3.1", ("yes", True)),  # adds the buffer onto itself
    ("megatron-core", "0.19.2", ("yes", False)),
    ("megatron-core", "0.16.1", ("yes", True))])
def test_the_copys_code_decides_the_defect_and_its_label_the_self_add(
        distribution: str, version: str, want: tuple[str, bool]) -> None:
    copy, buffer_file = _copy_of(releases.unpacked(distribution, version), distribution)
    found = detection.detect_file(copy, buffer_file)
    assert found.version == version
    assert single_rank_defect(copy, found) == want


def test_hooks_of_a_shape_the_hotfix_does_not_know_may_have_the_defect() -> None:
    copy, buffer_file = _copy_of(releases.unpacked("megatron-fsdp", "0.6.1"), "megatron-fsdp")
    found = detection.detect_file(copy, buffer_file)
    unknown = dataclasses.replace(found, shapes={**found.shapes, registry.HOOKS: None})
    assert single_rank_defect(copy, unknown) == ("unknown", True)
    # a label that names no release: judged by its code, which may add the buffer onto itself
    assert single_rank_defect(copy, dataclasses.replace(found, version="0.6.1+abc")) == (
        "yes", True)


def _raise(where: str, exc: Exception) -> Any:
    raise exc
