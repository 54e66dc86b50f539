"""mfsdp_hotfix.compare: exact only when every tensor of every step has the same bits, and every
other outcome says why."""

from __future__ import annotations

import torch

from mfsdp_hotfix.compare import compare


def steps(*grads: list[float], loss: float = 0.5) -> list[dict[str, torch.Tensor]]:
    return [{"grads": torch.tensor(g), "losses": torch.tensor([loss])} for g in grads]


def test_identical_runs_are_exact_and_say_what_was_compared() -> None:
    result = compare(steps([1.0, 2.0], [3.0, -4.0]), steps([1.0, 2.0], [3.0, -4.0]))
    assert result.exact and result.outcome == "exact" and result.why == []
    assert (result.steps, result.tensors, result.elements) == (2, 4, 6)
    assert (result.max_abs, result.rel_l2, result.first_bad_step) == (0.0, 0.0, None)
    record = result.to_dict()
    assert (record["outcome"], record["steps_compared"], record["tensors_compared"]) == (
        "exact", 2, 4)


def test_a_different_value_is_wrong_with_its_size_and_step() -> None:
    result = compare(steps([1.0, 2.0], [3.0, 4.5]), steps([1.0, 2.0], [3.0, 4.0]))
    assert result.outcome == "wrong" and result.first_bad_step == 1
    assert result.max_abs == 0.5 and result.differing == ["grads"]
    assert result.rel_l2 == 0.5 / (1 + 4 + 9 + 16 + 2 * 0.5 ** 2) ** 0.5  # losses count too
    assert result.why == ["step 1: grads: 1 of 2 elements differ in their bits"]


def test_nothing_to_compare_is_not_exact() -> None:
    assert compare([], []).why == ["no step compared"]
    no_tensors = compare([{}], [{}])
    assert no_tensors.why == ["no element compared"] and no_tensors.steps == 1
    empty = compare([{"grads": torch.empty(0)}], [{"grads": torch.empty(0)}])
    assert empty.why == ["no element compared"] and empty.tensors == 1


def test_fewer_steps_than_the_truth_is_wrong() -> None:
    result = compare(steps([1.0]), steps([1.0], [2.0]))
    assert result.why == ["the run has 1 steps, its truth 2"] and result.steps == 1


def test_nan_is_never_exact_not_even_with_identical_bits() -> None:
    nan = steps([1.0, float("nan")])
    result = compare(nan, [{k: v.clone() for k, v in s.items()} for s in nan])
    assert result.why == ["step 0: grads: 1 NaN in the run", "step 0: grads: 1 NaN in the truth"]
    assert result.max_abs is None and result.rel_l2 is None
    one_side = compare(steps([1.0, float("nan")]), steps([1.0, 2.0]))
    assert one_side.why[0] == "step 0: grads: 1 NaN in the run" and one_side.max_abs is None


def test_inf_is_never_exact() -> None:
    result = compare(steps([float("inf")]), steps([float("inf")]))
    assert result.why == ["step 0: grads: 1 Inf in the run", "step 0: grads: 1 Inf in the truth"]
    assert result.max_abs is None


def test_a_changed_shape_or_dtype_is_wrong() -> None:
    shape = compare([{"g": torch.zeros(3)}], [{"g": torch.zeros(2)}])
    assert shape.why == ["step 0: g: shape (3,) vs (2,) in the truth"]
    assert shape.max_abs is None  # no elementwise difference of different shapes
    dtype = compare([{"g": torch.zeros(2, dtype=torch.bfloat16)}], [{"g": torch.zeros(2)}])
    assert dtype.why == ["step 0: g: dtype torch.bfloat16 vs torch.float32 in the truth"]
    assert dtype.max_abs == 0.0


def test_a_missing_or_extra_tensor_is_wrong() -> None:
    truth = [{"a": torch.ones(1), "b": torch.ones(1)}]
    missing = compare([{"a": torch.ones(1)}], truth)
    assert missing.why == ["step 0: b is missing from the run"] and missing.tensors == 1
    extra = compare([{"a": torch.ones(1), "b": torch.ones(1), "c": torch.ones(1)}], truth)
    assert extra.why == ["step 0: c is not in the truth"] and extra.differing == ["c"]


def test_negative_zero_differs_from_zero() -> None:
    result = compare([{"g": torch.tensor([-0.0])}], [{"g": torch.tensor([0.0])}])
    assert result.outcome == "wrong" and result.max_abs == 0.0
    assert result.why == ["step 0: g: 1 of 1 elements differ in their bits"]


def test_different_losses_are_wrong_with_the_same_gradients() -> None:
    result = compare(steps([1.0], loss=0.25), steps([1.0], loss=0.5))
    assert result.differing == ["losses"] and result.outcome == "wrong"


def test_reasons_are_capped_and_counted() -> None:
    result = compare([{"g": torch.zeros(1)}] * 12, [{"g": torch.ones(1)}] * 12)
    assert len(result.why) == 8 and result.more_reasons == 4
    assert result.to_dict()["not_exact_because"][-1] == "... and 4 more"
