"""``single-rank-reduce`` and the release defect it repairs,
``single-rank-grads-reduced-every-microbatch``: a ZeRO-2/3 gradient buffer whose data-parallel
group has one rank, on the real releases against plain PyTorch; what the fix leaves alone (two
ranks, bit for bit); and the refusal where the need cannot be decided."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import releases

from mfsdp_hotfix import detection, fix_catalogue, registry, release_defects
from mfsdp_hotfix.fixes import single_rank_reduce
from mfsdp_hotfix.selftest.runner import run_case
from mfsdp_hotfix.selftest.spec import CaseSpec


def tree(release: str) -> Path:
    if release.startswith("git:"):
        found = releases.git_tree(release[4:])
        if found is None:
            pytest.skip("NVIDIA main needs a Megatron-LM clone: set MFSDP_TEST_MEGATRON_LM")
        return found
    return releases.unpacked("megatron-fsdp", release)


def case(release: str | Path, hotfix: str, **fields: Any) -> CaseSpec:
    path = release if isinstance(release, Path) else tree(release)
    spec: dict[str, Any] = {"world": 1, "microbatches": 3, "units": 4, "double_buffer": False}
    return CaseSpec(flavour="standalone", path=str(path), hotfix=hotfix, **{**spec, **fields})


@pytest.mark.parametrize(("grads", "config", "factor"), [
    (None, {"average_in_collective": False}, None),
    (0.25, {"average_in_collective": True}, None),
    (0.25, {"average_in_collective": False}, 0.25)],
    ids=["per-token-loss", "average-in-collective", "scaled"])
def test_a_one_rank_reduction_scales_as_the_releases_collective_would(
        grads: float | None, config: dict[str, bool], factor: float | None) -> None:
    buffer = SimpleNamespace(gradient_scaling_factor=grads)
    assert single_rank_reduce.one_rank_scale(buffer, SimpleNamespace(**config)) == factor


def test_the_defect_is_the_fixs_and_gated_by_the_hooks() -> None:
    defect = release_defects.SINGLE_RANK_GRADS
    assert (defect in release_defects.RELEASE_DEFECTS
            and defect.fix == fix_catalogue.SINGLE_RANK_REDUCE.id)
    assert fix_catalogue.SINGLE_RANK_REDUCE.gate == registry.HOOKS
    assert all("single-rank-reduce" in shape.needs for shape in registry.SHAPES[registry.HOOKS]
               if shape.fingerprint is not None)


@pytest.mark.slow
@pytest.mark.parametrize(("release", "fields"), [
    ("0.3.1", {}), ("0.4.0", {"double_buffer": True}), ("0.6.1", {}),
    ("0.6.1", {"strategy": "optim_grads"}), ("0.6.1", {"grad_reduce": "premul-sum"}),
    ("0.6.1", {"protocol": "auto-sync"}), ("git:main", {"double_buffer": True})],
    ids=["0.3.1-doubles", "0.4.0-double-buffer", "0.6.1-zero3", "0.6.1-zero2", "0.6.1-premul",
         "0.6.1-auto-sync", "main"])
def test_one_rank_is_wrong_as_shipped_and_exact_with_the_fix(release: str,
                                                             fields: dict[str, Any]) -> None:
    shipped = run_case(case(release, "off", **fields))
    assert not shipped.crashed, shipped.exception
    assert (shipped.max_rel_grad_error or 0) > 0.5, shipped.max_rel_grad_error
    fixed = run_case(case(release, "on", **fields))
    assert not fixed.crashed, fixed.exception
    assert fixed.max_abs_grad_error == 0.0 and fixed.grads_compared > 0
    assert "single-rank-reduce" in str(fixed.hotfix_status)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim"])
def test_two_ranks_are_left_bit_for_bit_as_they_were(strategy: str) -> None:
    """Where no group has one rank the fix changes nothing: the same gradients, bit for bit, as
    with the fix disabled."""
    fields = {"world": 2, "strategy": strategy, "double_buffer": True}
    with_fix = run_case(case("0.6.1", "on", **fields))
    without = run_case(case("0.6.1", "on", disabled_fixes="single-rank-reduce", **fields))
    assert not with_fix.crashed and not without.crashed, (with_fix.exception, without.exception)
    assert with_fix.grad_digest == without.grad_digest and with_fix.grad_digest
    assert with_fix.max_abs_grad_error == 0.0


RELEASE_CONDITION = "if grad_reduce_every_bprop or is_last_microbatch or self.model_auto_sync:"
UNDECIDABLE = "if grad_reduce_every_bprop or self.should_reduce():"


def unknown_hooks(tmp_path: Path) -> Path:
    """0.6.1 whose hooks reduce under a condition no recogniser can decide (a call): their
    shape is unknown. The condition still reduces every microbatch here, as the release does."""
    root = tmp_path / "site"
    shutil.copytree(releases.unpacked("megatron-fsdp", "0.6.1"), root)
    model = root / "megatron_fsdp" / "megatron_fsdp.py"
    text = model.read_text()
    assert text.count(RELEASE_CONDITION) == 2
    text = text.replace(RELEASE_CONDITION, UNDECIDABLE).replace(
        "    def finish_grad_sync(",
        "    def should_reduce(self):\n        return getattr(self, 'is_last_microbatch', False) "
        "or self.model_auto_sync\n\n    def finish_grad_sync(", 1)
    model.write_text(text)
    found = detection.detect_file(registry.COPIES[0],
                                  root / "megatron_fsdp" / "param_and_grad_buffer.py")
    assert found.shapes[registry.HOOKS] is None
    return root


@pytest.mark.slow
def test_an_undecided_copy_refuses_one_rank_and_builds_two(tmp_path: Path) -> None:
    root = unknown_hooks(tmp_path)
    refused = run_case(case(root, "on"))
    assert refused.crashed and "UnsupportedConfiguration" in (refused.exception or "")
    assert "single-rank-reduce is unverified" in (refused.exception or "")
    assert "one microbatch per step" in (refused.exception or "")  # the workaround
    built = run_case(case(root, "on", world=2))
    assert not built.crashed and built.max_abs_grad_error == 0.0, built.exception


@pytest.mark.slow
def test_auto_sync_with_expert_buffers_is_stopped_at_the_second_microbatch() -> None:
    """fully_shard's auto-sync, two ranks, ZeRO-3 experts (a one-rank buffer scaled by 1/2):
    wrong as shipped with two microbatches; with the hotfix the second microbatch stops the
    step with the workaround, and one microbatch per step runs and is right."""
    fields: dict[str, Any] = {"world": 2, "experts": 2, "protocol": "auto-sync",
                              "microbatches": 2}
    shipped = run_case(case("0.6.1", "off", **fields))
    assert not shipped.crashed and (shipped.max_abs_grad_error or 0) > 0.1, shipped.exception
    stopped = run_case(case("0.6.1", "on", **fields))
    assert (stopped.exception or "").startswith("UnsupportedConfiguration: "), stopped.exception
    assert "sync_model_each_microbatch=False" in (stopped.exception or "")
    one = run_case(case("0.6.1", "on", **{**fields, "microbatches": 1}))
    assert not one.crashed and (one.max_abs_grad_error or 1) < 1e-6, one.exception
