"""``unsharded-shard-added-to-itself`` (megatron-fsdp 0.3.0-0.3.1 / megatron-core 0.16): no fix
repairs it, so the hotfix refuses the configurations it hits before training; its workaround is
exact, and the release before and after it is right (plain PyTorch is the reference)."""

from __future__ import annotations

from typing import Any

import pytest
import releases

from mfsdp_hotfix import detection, registry, release_defects
from mfsdp_hotfix.selftest.runner import run_case
from mfsdp_hotfix.selftest.spec import CaseSpec

DEFECT = release_defects.UNSHARDED_SHARD_ADDED_TO_ITSELF.name


def case(version: str, hotfix: str, **fields: Any) -> CaseSpec:
    spec: dict[str, Any] = {"world": 2, "strategy": "optim", "microbatches": 1, "units": 4,
                            "double_buffer": False}
    return CaseSpec(flavour="standalone", path=str(releases.unpacked("megatron-fsdp", version)),
                    hotfix=hotfix, **{**spec, **fields})


@pytest.mark.parametrize(("dist", "version", "has"), [
    ("megatron-fsdp", "0.2.3", False), ("megatron-fsdp", "0.3.0", True),
    ("megatron-fsdp", "0.3.1", True), ("megatron-fsdp", "0.4.0", False),
    ("megatron-core", "0.16.1", True), ("megatron-core", "0.19.2", False)])
def test_the_carrier_shape_says_which_releases_have_it(dist: str, version: str,
                                                        has: bool) -> None:
    copy = registry.COPIES[0] if dist == "megatron-fsdp" else registry.COPIES[1]
    found = detection.find_installed(copy, [str(releases.unpacked(dist, version))])
    assert found is not None
    shapes = detection.detect_file(copy, found).shapes
    assert release_defects.carried(release_defects.UNSHARDED_SHARD_ADDED_TO_ITSELF, shapes) is has


@pytest.mark.slow
def test_zero1_is_wrong_as_shipped_refused_with_the_hotfix_and_its_workaround_exact() -> None:
    shipped = run_case(case("0.3.1", "off"))
    assert not shipped.crashed and (shipped.max_rel_grad_error or 0) > 0.5, shipped.exception
    refused = run_case(case("0.3.1", "on"))
    assert refused.crashed and "UnsupportedConfiguration" in (refused.exception or "")
    assert DEFECT in (refused.exception or "") and "overlap_grad_reduce=False" in (
        refused.exception or "")
    workaround = run_case(case("0.3.1", "on", overlap_grad_reduce=False, microbatches=2))
    assert not workaround.crashed and workaround.max_abs_grad_error == 0.0, workaround.exception
    for neighbour in ("0.2.3", "0.4.0"):
        right = run_case(case(neighbour, "on"))
        assert not right.crashed and right.max_abs_grad_error == 0.0, (neighbour, right.exception)
