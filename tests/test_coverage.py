"""The configuration gate: which fix states refuse a model, and what the refusal says."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mfsdp_hotfix import UnsupportedConfiguration, coverage, eras, registry
from mfsdp_hotfix.detection import Detection
from mfsdp_hotfix.registry import ALL_REDUCE, REDUCE_SCATTER, SHAPES

FOUND = Detection(registry.COPIES[0], "/site/megatron_fsdp", "0.2.3", {}, {}, {}, eras.ERAS[0],
                  "era A")
ZERO3_DB = SimpleNamespace(fsdp_double_buffer=True,
                           data_parallel_sharding_strategy="optim_grads_params")


def model(ddp_config: SimpleNamespace, outer: int = 1) -> SimpleNamespace:
    """A built MegatronFSDP as the gate reads it: its config, and HSDP's DP-Outer group."""
    group = SimpleNamespace(size=lambda: outer)
    return SimpleNamespace(ddp_config=SimpleNamespace(outer_dp_sharding_strategy="no_shard",
                                                      **vars(ddp_config)),
                           dist_index=SimpleNamespace(use_hybrid_fsdp=outer > 1,
                                                      get_outer_fsdp_group=lambda: group))


def states(missed: str) -> dict[str, tuple[str, str]]:
    return {"getter-guard": ("applied", ""), "ordered-drain": ("applied", ""),
            "missed-post-backward": (missed, "why")}


@pytest.mark.parametrize("state", ["unverified", "failed"])
def test_an_unavailable_fix_refuses_its_configuration(state: str) -> None:
    with pytest.raises(UnsupportedConfiguration) as caught:
        coverage.check(FOUND, states(state), model(ZERO3_DB))
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
    coverage.check(FOUND, states("unverified"), model(config))


@pytest.mark.parametrize("state", ["applied", "not needed", "disabled", "off", "would apply"])
def test_no_refusal_unless_unavailable(state: str) -> None:
    coverage.check(FOUND, states(state), model(ZERO3_DB))


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
        coverage.check(FOUND, {"zero1-accumulate": (state, "why")}, model(ZERO1))
    message = str(caught.value)
    assert f"ZeRO-1 (optim): the fix zero1-accumulate is {state} (why)" in message
    assert "Workaround: ZeRO-2 or ZeRO-3" in message
    coverage.check(FOUND, {"zero1-accumulate": (state, "why")},
                   model(SimpleNamespace(**{**vars(ZERO1),
                                            "data_parallel_sharding_strategy": "optim_grads"})))


@pytest.mark.parametrize("strategy", ["optim", "no_shard"])
def test_an_unavailable_reduce_once_refuses_unsharded_gradients_without_overlap(
        strategy: str) -> None:
    fixes = {"reduce-once": ("unverified", "why")}
    without = SimpleNamespace(**{**vars(ZERO1), "data_parallel_sharding_strategy": strategy,
                                 "overlap_grad_reduce": False})
    with pytest.raises(UnsupportedConfiguration, match="Workaround: overlap_grad_reduce=True"):
        coverage.check(FOUND, fixes, model(without))
    coverage.check(FOUND, fixes, model(SimpleNamespace(**{**vars(without),
                                                          "overlap_grad_reduce": True})))


def test_a_refused_copys_fixes_are_reported_not_enforced() -> None:
    fixes = {"getter-guard": ("refused", "why"), "ordered-drain": ("refused", "why")}
    coverage.check(FOUND, fixes, model(ZERO3_DB))
    assert {x["fix"]: x["refused_at_model_construction"]
            for x in coverage.limits(FOUND, fixes)} == {"getter-guard": False,
                                                        "ordered-drain": False}


def _model(strategy: str = "optim_grads_params", div_fusion: bool = False,
           average: bool = False, scaling: float | None = 0.5, distributed: bool = True,
           dtype: str = "torch.float32") -> SimpleNamespace:
    """A built model as megatron-fsdp 0.2.3 has it: its ddp_config and gradient buffers."""
    config = SimpleNamespace(fsdp_double_buffer=False, data_parallel_sharding_strategy=strategy,
                             overlap_grad_reduce=True, gradient_reduce_div_fusion=div_fusion,
                             average_in_collective=average)
    ranks = SimpleNamespace(size=lambda: 2 if distributed else 1)
    buffer = SimpleNamespace(is_data_distributed=distributed, gradient_scaling_factor=scaling,
                             dtype=dtype, data_parallel_group=ranks)
    groups = [SimpleNamespace(main_grad_buffer=None), SimpleNamespace(main_grad_buffer=buffer)]
    return SimpleNamespace(ddp_config=config, dist_index=SimpleNamespace(use_hybrid_fsdp=False),
                           param_and_grad_buffer=SimpleNamespace(parameter_groups=groups))


def _carrying(shape_name: str | None) -> Detection:
    """FOUND with its bucket reduction in the shape of that name (None: unknown)."""
    shape = next((s for s in registry.SHAPES[registry.BUCKET_REDUCE] if s.name == shape_name),
                 None)
    return Detection(FOUND.copy, FOUND.module_path, FOUND.version,
                     {registry.BUCKET_REDUCE: shape}, {}, {}, FOUND.era, FOUND.reason)


@pytest.mark.parametrize("model", [
    _model(), _model("optim_grads"), _model(div_fusion=True, dtype="torch.bfloat16")],
    ids=["zero3-scale-then-sum", "zero2-scale-then-sum", "bf16-buffer"])
def test_a_release_defect_no_fix_repairs_refuses_the_models_it_hits(
        model: SimpleNamespace) -> None:
    """megatron-fsdp 0.1.0-0.2.3 scale the local shard, not the bucket they reduce, on the
    branch of gradient_reduce_preprocessing that scales in place and SUMs."""
    with pytest.raises(UnsupportedConfiguration) as caught:
        coverage.check(_carrying("0.14"), {}, model)
    message = str(caught.value)
    assert ("its _bucket_group_gradient_reduce has the release defect "
            "sharded-grads-summed-unscaled, which no fix repairs") in message
    assert "data-parallel size times too large" in message
    assert "Workaround: calculate_per_token_loss=True" in message
    (limit,) = [x for x in coverage.limits(_carrying("0.14"), {}) if x["fix"] is None]
    assert limit["defect"] == "sharded-grads-summed-unscaled" and not limit["covered"]
    assert limit["refused_at_model_construction"] is True
    (off,) = [x for x in coverage.limits(_carrying("0.14"), {}, enforced=False)
              if x["fix"] is None]
    assert off["refused_at_model_construction"] is False


@pytest.mark.parametrize("model", [
    _model("optim"), _model("no_shard"), _model(scaling=None), _model(average=True),
    _model(div_fusion=True), _model(distributed=False)],
    ids=["zero1", "no_shard", "per-token-loss", "average-in-collective", "fp32-div-fusion",
         "one-rank"])
def test_a_release_defect_no_fix_repairs_leaves_other_models_alone(
        model: SimpleNamespace) -> None:
    coverage.check(_carrying("0.14"), {}, model)


@pytest.mark.parametrize("shape", ["0.16", "0.17"])
def test_a_copy_without_the_defect_is_not_refused(shape: str) -> None:
    model = _model()
    coverage.check(_carrying(shape), {}, model)
    assert all(x.get("defect") != "sharded-grads-summed-unscaled"
               for x in coverage.limits(_carrying(shape), {}))


@pytest.mark.parametrize(("shape", "refused"), [("0.14", False), ("0.16", True), ("0.17", False)])
def test_zero1_with_overlap_is_refused_where_the_shard_is_added_to_itself(
        shape: str, refused: bool) -> None:
    """megatron-fsdp 0.3.x / megatron-core 0.16 add the reduced shard of an unsharded buffer
    onto it: ZeRO-1 with overlap is refused there, without overlap it is not."""
    zero1 = _model("optim")
    if refused:
        with pytest.raises(UnsupportedConfiguration, match="unsharded-shard-added-to-itself"):
            coverage.check(_carrying(shape), {}, zero1)
    else:
        coverage.check(_carrying(shape), {}, zero1)
    zero1.ddp_config.overlap_grad_reduce = False
    coverage.check(_carrying(shape), {}, zero1)


def test_an_unknown_carrier_does_not_rule_the_defect_out() -> None:
    """A fork's bucket reduction: the defect may be there; a model whose buffers cannot be read
    counts as on its code path."""
    model = _model()
    with pytest.raises(UnsupportedConfiguration, match="is not ruled out"):
        coverage.check(_carrying(None), {}, model)
    coverage.check(_carrying(None), {}, _model(div_fusion=True))
    fork = SimpleNamespace(ddp_config=model.ddp_config)
    with pytest.raises(UnsupportedConfiguration, match="could not be read"):
        coverage.check(_carrying(None), {}, fork)


REDUCES, SKIPS = SHAPES[REDUCE_SCATTER]


def found_with(reduce_scatter: registry.Shape | None, all_reduce: registry.Shape | None
               ) -> Detection:
    """FOUND with these synchronous reductions' shapes (None: not recognised)."""
    return Detection(registry.COPIES[0], "/site/megatron_fsdp", "0.3.1",
                     {REDUCE_SCATTER: reduce_scatter, ALL_REDUCE: all_reduce}, {}, {},
                     eras.ERAS[0], "era A")


def unsharded(strategy: str, overlap: bool = False) -> SimpleNamespace:
    return SimpleNamespace(fsdp_double_buffer=False, data_parallel_sharding_strategy=strategy,
                           overlap_grad_reduce=overlap)


def test_an_unverified_reduce_once_limits_only_the_strategies_that_reduce_twice() -> None:
    """The 0.3-0.4 shape: reduce_scatter_gradients reduces, all_reduce_gradients skips every
    buffer. no_shard's only reduction is the hooks', so it is not affected: not refused."""
    found, fixes = found_with(REDUCES, SKIPS), {"reduce-once": ("unverified", "why")}
    with pytest.raises(UnsupportedConfiguration, match="ZeRO-1"):
        coverage.check(found, fixes, model(unsharded("optim")))
    coverage.check(found, fixes, model(unsharded("no_shard")))
    coverage.check(found, fixes, model(unsharded("no_shard"), outer=2))
    assert [x["configuration"] for x in coverage.limits(found, fixes)] == [
        "HSDP with ZeRO-1 (optim) and overlap_grad_reduce=False",
        "ZeRO-1 (optim) with overlap_grad_reduce=False"]
    # a reduction whose shape is not known may reduce: limited
    unknown = found_with(REDUCES, None)
    with pytest.raises(UnsupportedConfiguration, match="no_shard"):
        coverage.check(unknown, fixes, model(unsharded("no_shard")))


@pytest.mark.parametrize("state", ["applied", "would apply", "not needed", "disabled",
                                   "unverified"])
@pytest.mark.parametrize("strategy", ["optim", "no_shard"])
def test_hsdp_with_unsharded_gradients_without_overlap_is_refused_whatever_the_fix(
        state: str, strategy: str) -> None:
    """Wrong as shipped (reduced twice) and with reduce-once or NVIDIA main (never reduced over
    DP-Outer): refused in every fix state but off, with overlap_grad_reduce=True as the way."""
    found, fixes = found_with(REDUCES, REDUCES), {"reduce-once": (state, "why")}
    with pytest.raises(UnsupportedConfiguration) as caught:
        coverage.check(found, fixes, model(unsharded(strategy), outer=2))
    message = str(caught.value)
    assert "HSDP with" in message and "over DP-Outer" in message
    assert "Workaround: overlap_grad_reduce=True" in message
    coverage.check(found, fixes, model(unsharded(strategy, overlap=True), outer=2))
    if state in ("applied", "would apply", "not needed", "disabled"):
        coverage.check(found, fixes, model(unsharded(strategy), outer=1))
    hsdp = [x for x in coverage.limits(found, fixes) if x["configuration"].startswith("HSDP")]
    assert [x["refused_at_model_construction"] for x in hsdp] == [True, True]
    assert not any(x["covered"] for x in hsdp)


def test_hsdp_is_refused_only_with_the_hotfix_on_and_where_finish_grad_sync_reduces() -> None:
    """Under MFSDP_HOTFIX=0 it runs as shipped (how the defect is studied); megatron-fsdp
    0.1.0-0.2.3's hooks' reduction, DP-Outer included, is their only one: no limit."""
    found = found_with(REDUCES, REDUCES)
    with pytest.raises(UnsupportedConfiguration):
        coverage.check(found, {"reduce-once": ("applied", "")}, model(unsharded("optim"), 2))
    off = {"reduce-once": ("off", "MFSDP_HOTFIX=0")}
    coverage.check(found, off, model(unsharded("optim"), outer=2))
    assert {x["refused_at_model_construction"] for x in coverage.limits(found, off)} == {False}
    oldest, fixes = found_with(SKIPS, SKIPS), {"reduce-once": ("not needed", "why")}
    coverage.check(oldest, fixes, model(unsharded("optim"), outer=2))
    assert coverage.limits(oldest, fixes) == []
