"""No defect is only told: each release defect a copy may carry reaches the coverage gate as
configurations (``Limit``) that are refused at model construction where nothing repairs them,
and what its ``not_covered`` says is one of those configurations, not words alone."""

from __future__ import annotations

import pytest
import releases

from mfsdp_hotfix import coverage, detection, fix_catalogue, registry
from mfsdp_hotfix.release_defects import RELEASE_DEFECTS, UNREPAIRED_DEFECTS

_, VENDORED = registry.COPIES


def _limits_of(defect: object) -> list[object]:
    """The limits that carry ``defect``: its own, or those of the fix that repairs it."""
    return [limit for limit in coverage.LIMITS
            if limit.defect is defect or (limit.fix is not None
                                          and limit.fix == getattr(defect, "fix", None))]


# Defects that strike after the model is built, where no construction-time gate can see them:
# fully_shard_optimizer's warm-up step runs on the optimizer, after MegatronFSDP exists. Its fix
# stops the step where it fails; what it leaves (an optimizer other than Adam, AdamW and SGD keeps
# the warm-up's state) is warned at that call, not refused.
AFTER_CONSTRUCTION = {"optimizer-warm-up-step"}


@pytest.mark.parametrize("defect", [d for d in RELEASE_DEFECTS
                                    if d.name not in AFTER_CONSTRUCTION], ids=lambda d: d.name)
def test_every_defect_reaches_the_gate(defect: object) -> None:
    assert _limits_of(defect), f"{defect.name} has no configuration the gate refuses"


@pytest.mark.parametrize("defect", UNREPAIRED_DEFECTS, ids=lambda d: d.name)
def test_a_defect_no_fix_repairs_declares_what_it_hits(defect: object) -> None:
    assert defect.fix is None and defect.limits and all(
        limit.failure and limit.workaround for limit in coverage.LIMITS
        if limit.defect is defect)


@pytest.mark.parametrize("defect", [d for d in RELEASE_DEFECTS if d.fix and d.not_covered
                                    and d.name not in AFTER_CONSTRUCTION], ids=lambda d: d.name)
def test_what_a_fix_leaves_is_refused_not_only_told(defect: object) -> None:
    """A repaired defect's ``not_covered`` is a limit no state of the fix makes right
    (``repaired=False``), or the limit of a defect it names."""
    own = [limit for limit in _limits_of(defect) if not limit.repaired]
    named = [other for other in UNREPAIRED_DEFECTS if other.name in defect.not_covered]
    assert own or named, defect.name


def test_megatron_core_0_14s_zero1_through_its_own_linear_is_covered() -> None:
    """megatron-core 0.14.0's Megatron-FSDP sets no overwrite_main_grad; core-linear-accumulate
    adds there where the buffer is not distributed (ZeRO-1), so, with the fix applied, ZeRO-1
    through megatron-core's fused linear is covered on 0.14.0 as on 0.15.0: nothing refused."""
    assert all(limit.repaired for limit in coverage.LIMITS
               if limit.fix == fix_catalogue.CORE_LINEAR_ACCUMULATE.id)
    states = {fix.id: ("applied", "") for fix in fix_catalogue.FIXES}
    for version in ("0.14.0", "0.15.0"):
        found = detection.detect_file(VENDORED, detection.find_installed(
            VENDORED, [str(releases.unpacked("megatron-core", version))]), installed=False)
        entries = [entry for entry in coverage.limits(found, states)
                   if entry["fix"] == fix_catalogue.CORE_LINEAR_ACCUMULATE.id]
        assert entries and all(entry["covered"] for entry in entries), (version, entries)
