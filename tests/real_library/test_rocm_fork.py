"""The ROCm/Megatron-LM fork before and after its PR #146, on the real library (CPU, gloo, the
happens-before checker; see ``mfsdp_hotfix/selftest``).

The copies are rebuilt as ``snapshots.py`` describes: megatron-core 0.16.1, whose three functions
have exactly the fingerprints of ROCm's (``test_snapshots.py`` checks it), with ROCm's
``megatron_fsdp.py`` link to the pipeline and, for #146, the PR's two edits. No ROCm-only module
is involved: the rebuilt copy has no mori SDMA all-gather (the real fork imports it only for type
checking in ``param_and_grad_buffer.py``), so nothing is stubbed; what the run cannot show is
anything that code changes. Six units: the configuration measured first (32 of 44 reuses
unordered with #146 alone).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import snapshots
from conftest import FixStates
from realcases import (
    assert_matches_reference,
    assert_no_buffer_crash,
    describe,
    repaired,
    run_cached,
)

from mfsdp_hotfix import registry
from mfsdp_hotfix.selftest.spec import CaseResult, CaseSpec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("rocm")
    return {name: str(snapshots.build(snapshots.SNAPSHOTS[name], root / name, whole=True))
            for name in ("rocm-before-146", "rocm-146")}


def rocm(path: str, hotfix: str) -> CaseResult:
    return run_cached(CaseSpec(flavour="core", path=path, hotfix=hotfix, units=6))


def fix_states(result: CaseResult) -> dict[str, str]:
    (copy,) = result.hotfix_status["copies"]
    return FixStates({fix: state["state"] for fix, state in copy["fixes"].items()})


def test_pr146_alone_leaves_slot_reuse_unordered(rebuilt: dict[str, str]) -> None:
    shipped = rocm(rebuilt["rocm-146"], "off")
    assert_matches_reference(shipped)  # the guard removed the crash ...
    # ... but the drain on rs_stream orders only rs_stream: 32 of 44 reuses unordered.
    assert (shipped.ordering_violations, shipped.ordering_checks) == (32, 44), describe(shipped)


def test_pr146_gets_ordered_drain_and_every_reuse_is_ordered(rebuilt: dict[str, str]) -> None:
    patched = rocm(rebuilt["rocm-146"], "on")
    assert fix_states(patched) == {"getter-guard": "not needed", "ordered-drain": "applied",
                                   "missed-post-backward": "applied",
                                   "zero1-accumulate": "applied",
                                   "reduce-once": "applied", "single-rank-reduce": "applied",
                                   "core-linear-accumulate": "applied",
                                   "root-forward-hooks": "applied", "auto-sync-stop": "applied",
                                   "replicated-grad-stats": "applied"}
    (copy,) = patched.hotfix_status["copies"]  # detected at import, from the loaded code
    assert copy["functions"][registry.GETTER]["matched_by"] == "structure", describe(patched)
    assert patched.hotfix_status["failures"] == {}, describe(patched)
    assert_matches_reference(patched)
    assert (patched.ordering_violations, patched.ordering_checks) == (0, 44), describe(patched)
    shipped = rocm(rebuilt["rocm-146"], "off")
    assert patched.grad_digest == shipped.grad_digest, describe(patched)


def test_before_pr146_crashes_and_both_fixes_repair_it(rebuilt: dict[str, str]) -> None:
    assert_no_buffer_crash(rocm(rebuilt["rocm-before-146"], "off"))
    patched = rocm(rebuilt["rocm-before-146"], "on")
    assert repaired(patched, "getter-guard") and repaired(patched, "ordered-drain")
    assert_matches_reference(patched)
    assert patched.ordering_checks and patched.ordering_violations == 0, describe(patched)


def test_rebuilt_path_is_the_copy_that_ran(rebuilt: dict[str, str]) -> None:
    result = rocm(rebuilt["rocm-146"], "on")
    assert Path(result.release["path"]).is_relative_to(rebuilt["rocm-146"]), describe(result)
