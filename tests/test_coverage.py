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
