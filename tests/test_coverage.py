"""The configuration gate: which fix states refuse a model, and what the refusal says."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mfsdp_hotfix import UnsupportedConfiguration, coverage, registry
from mfsdp_hotfix.detection import Detection

FOUND = Detection(registry.COPIES[0], "/site/megatron_fsdp", "0.2.3", {}, {}, {}, registry.ERAS[0],
                  "era A")
ZERO3_DB = SimpleNamespace(fsdp_double_buffer=True,
                           data_parallel_sharding_strategy="optim_grads_params")


def states(missed: str) -> dict[str, tuple[str, str]]:
    return {"getter-guard": ("applied", ""), "ordered-drain": ("applied", ""),
            "missed-post-backward": (missed, "why")}


@pytest.mark.parametrize("state", ["unverified", "failed"])
def test_an_unavailable_fix_refuses_its_configuration(state: str) -> None:
    with pytest.raises(UnsupportedConfiguration) as caught:
        coverage.check(FOUND, states(state), ZERO3_DB)
    message = str(caught.value)
    assert "megatron-fsdp 0.2.3" in message and "/site/megatron_fsdp" in message
    assert "ZeRO-3 (optim_grads_params) with fsdp_double_buffer=True" in message
    assert f"missed-post-backward is {state} (why)" in message
    assert "Workaround: set fsdp_double_buffer=False, or upgrade" in message
    assert isinstance(caught.value, RuntimeError)


@pytest.mark.parametrize("config", [
    SimpleNamespace(fsdp_double_buffer=False, data_parallel_sharding_strategy="optim_grads_params"),
    SimpleNamespace(fsdp_double_buffer=True, data_parallel_sharding_strategy="optim_grads"),
])
def test_other_configurations_are_built(config: SimpleNamespace) -> None:
    coverage.check(FOUND, states("unverified"), config)


@pytest.mark.parametrize("state", ["applied", "not needed", "disabled", "off", "would apply"])
def test_no_refusal_unless_unavailable(state: str) -> None:
    coverage.check(FOUND, states(state), ZERO3_DB)


def test_limits_say_what_is_and_is_not_covered() -> None:
    assert coverage.limits(FOUND, states("applied"))[-1] == {
        "configuration": "ZeRO-3 (optim_grads_params) with fsdp_double_buffer=True",
        "fix": "missed-post-backward", "covered": True}
    disabled = coverage.limits(FOUND, states("disabled"))[-1]
    assert disabled["covered"] is False and disabled["refused_at_model_construction"] is False
    assert "[fsdp_params] No buffer found" in disabled["failure"]
    assert [x["fix"] for x in coverage.limits(FOUND, states("not needed"))] == [
        "getter-guard", "ordered-drain"]


ZERO1 = SimpleNamespace(fsdp_double_buffer=False, data_parallel_sharding_strategy="optim",
                        overlap_grad_reduce=True)


@pytest.mark.parametrize("state", ["unverified", "failed"])
def test_an_unavailable_zero1_fix_refuses_a_zero1_model(state: str) -> None:
    with pytest.raises(UnsupportedConfiguration) as caught:
        coverage.check(FOUND, {"zero1-accumulate": (state, "why")}, ZERO1)
    message = str(caught.value)
    assert f"ZeRO-1 (optim): the fix zero1-accumulate is {state} (why)" in message
    assert "Workaround: ZeRO-2 or ZeRO-3" in message
    coverage.check(FOUND, {"zero1-accumulate": (state, "why")},
                   SimpleNamespace(**{**vars(ZERO1),
                                      "data_parallel_sharding_strategy": "optim_grads"}))


@pytest.mark.parametrize("strategy", ["optim", "no_shard"])
def test_an_unavailable_reduce_once_refuses_unsharded_gradients_without_overlap(
        strategy: str) -> None:
    fixes = {"reduce-once": ("unverified", "why")}
    without = SimpleNamespace(**{**vars(ZERO1), "data_parallel_sharding_strategy": strategy,
                                 "overlap_grad_reduce": False})
    with pytest.raises(UnsupportedConfiguration, match="Workaround: overlap_grad_reduce=True"):
        coverage.check(FOUND, fixes, without)
    coverage.check(FOUND, fixes, SimpleNamespace(**{**vars(without),
                                                    "overlap_grad_reduce": True}))


def test_a_refused_copys_fixes_are_reported_not_enforced() -> None:
    fixes = {"getter-guard": ("refused", "why"), "ordered-drain": ("refused", "why")}
    coverage.check(FOUND, fixes, ZERO3_DB)
    assert {x["fix"]: x["refused_at_model_construction"]
            for x in coverage.limits(FOUND, fixes)} == {"getter-guard": False,
                                                        "ordered-drain": False}
