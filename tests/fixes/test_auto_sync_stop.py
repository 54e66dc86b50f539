"""``auto-sync-stop``: model auto-sync (``sync_model_each_microbatch=True``) reduces the gradient
buffer at every microbatch. Which buffers that breaks (``limits.reduced_in_place``), and on the
real release against plain PyTorch: what is stopped (a SUM over no_shard, ZeRO-1's
reduce-scatter) and what runs untouched (no_shard's average, right as shipped)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import releases
from real_library.accumulation import RE_AVERAGED

from mfsdp_hotfix.limits import reduced_in_place
from mfsdp_hotfix.selftest.runner import run_case
from mfsdp_hotfix.selftest.spec import CaseSpec


def built(strategy: str, ranks: int, factor: float | None) -> Any:
    """What ``reduced_in_place`` reads of a built ``MegatronFSDP``: one buffer, no HSDP."""
    grads = SimpleNamespace(gradient_scaling_factor=factor,
                            data_parallel_group=SimpleNamespace(size=lambda: ranks))
    return SimpleNamespace(
        dist_index=SimpleNamespace(use_hybrid_fsdp=False),
        ddp_config=SimpleNamespace(data_parallel_sharding_strategy=strategy),
        param_and_grad_buffer=SimpleNamespace(
            parameter_groups=[SimpleNamespace(main_grad_buffer=grads)]))


@pytest.mark.parametrize(("strategy", "ranks", "factor", "stopped"), [
    ("no_shard", 2, 0.5, False),  # the mean: 1/world, the release's default
    ("no_shard", 4, 0.25, False),
    ("no_shard", 2, None, True),  # calculate_per_token_loss: a SUM
    ("no_shard", 2, 1.0, True),  # average_in_collective's AVG: not measured, stopped
    ("no_shard", 4, 0.5, True),  # an expert buffer: 1/world over a smaller group
    ("optim", 2, 0.5, True),  # ZeRO-1: the reduce-scatter leaves the rank's own terms
    ("no_shard", 1, 0.5, True),  # one rank, scaled at every reduction
    ("no_shard", 1, None, False),  # one rank, unscaled: a reduction changes nothing
    ("optim", 1, 1.0, False),
    ("optim_grads_params", 2, 0.5, False)])  # sharded: each microbatch in a fresh bucket
def test_which_buffers_a_second_reduction_breaks(strategy: str, ranks: int,
                                                 factor: float | None, stopped: bool) -> None:
    assert (reduced_in_place(built(strategy, ranks, factor)) is not None) == stopped


def case(hotfix: str, **fields: Any) -> CaseSpec:
    spec: dict[str, Any] = {"world": 2, "microbatches": 2, "units": 4, "double_buffer": False,
                            "protocol": "auto-sync", "strategy": "no_shard"}
    return CaseSpec(flavour="standalone", path=str(releases.unpacked("megatron-fsdp", "0.6.1")),
                    hotfix=hotfix, **{**spec, **fields})


@pytest.mark.slow
@pytest.mark.parametrize("grad_reduce", ["premul-sum", "scale-then-sum"])
def test_an_average_over_no_shard_runs_as_shipped(grad_reduce: str) -> None:
    """Right as shipped but for rounding, and the hotfix leaves it bit for bit as it was."""
    shipped = run_case(case("off", grad_reduce=grad_reduce))
    fixed = run_case(case("on", grad_reduce=grad_reduce))
    assert not shipped.crashed and not fixed.crashed, (shipped.exception, fixed.exception)
    assert 0 < (shipped.max_abs_grad_error or 0) <= RE_AVERAGED  # rounded again
    assert fixed.grad_digest == shipped.grad_digest and fixed.grad_digest


@pytest.mark.slow
@pytest.mark.parametrize("fields", [{"grad_reduce": "per-token"},
                                    {"strategy": "optim", "linear": "unfused"}],
                         ids=["no_shard-sum", "zero1-average"])
def test_a_second_reduction_of_reduced_terms_is_stopped(fields: dict[str, Any]) -> None:
    """Wrong as shipped; with the hotfix the second microbatch stops the step, naming the way,
    and one microbatch per step runs and is exact."""
    shipped = run_case(case("off", **fields))
    assert not shipped.crashed and (shipped.max_abs_grad_error or 0) > 0.1, shipped.exception
    stopped = run_case(case("on", **fields))
    assert (stopped.exception or "").startswith("UnsupportedConfiguration: "), stopped.exception
    assert "auto-sync-stop" in (stopped.exception or "")
    assert "sync_model_each_microbatch=False" in (stopped.exception or "")
    one = run_case(case("on", **{**fields, "microbatches": 1}))
    assert not one.crashed and one.max_abs_grad_error == 0.0, one.exception
