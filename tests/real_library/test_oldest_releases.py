"""megatron-fsdp 0.1.0-0.2.3 and megatron-core 0.14.0-0.15.3: every case ends equal to the
reference or refused by the hotfix, never in 'No buffer found' (see docs/OLDEST_RELEASES.md).

Three code groups (their megatron_fsdp package files are byte-identical, which
``test_same_code`` checks): fsdp 0.1.0 = core 0.14.0; fsdp 0.2.0/0.2.1 = core 0.15.0/0.15.1;
fsdp 0.2.2/0.2.3 = core 0.15.2/0.15.3. One release per group runs the full matrix (ZeRO-1/2/3,
with and without the double buffer, 1 and 2 microbatches, hotfix on); every release runs the
hardest case (ZeRO-3, double buffer, 2 microbatches) and the shipped crash.

Harness settings these releases need, each for a defect of theirs that is not the hotfix's
(both explained in docs/OLDEST_RELEASES.md): ``grad_reduce="per-token"`` (their
scale-then-SUM path scales the wrong tensor) and, for the 0.1.0 group, the overwriting fused
linear (0.1.0 does not set ``overwrite_main_grad``). The 0.1.0 and 0.2.0 groups need a torch
that still has ``_mesh_resources.child_to_root_mapping`` (< 2.11; 2.8.0 is used):
``$MFSDP_TEST_OLD_TORCH_PYTHON`` names the interpreter of such a virtual environment.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import releases
from realcases import (
    assert_matches_reference,
    assert_no_buffer_crash,
    describe,
    release_path,
    repaired,
    run_cached,
)

from mfsdp_hotfix.selftest.spec import CaseResult, CaseSpec

pytestmark = pytest.mark.slow

OLD_TORCH = os.environ.get("MFSDP_TEST_OLD_TORCH_PYTHON")
GROUPS = {  # representative -> the releases with byte-identical megatron_fsdp files
    ("megatron-fsdp", "0.1.0"): [("megatron-core", "0.14.0")],
    ("megatron-fsdp", "0.2.0"): [("megatron-fsdp", "0.2.1"), ("megatron-core", "0.15.0"),
                                 ("megatron-core", "0.15.1")],
    ("megatron-fsdp", "0.2.3"): [("megatron-fsdp", "0.2.2"), ("megatron-core", "0.15.2"),
                                 ("megatron-core", "0.15.3")],
}
# Their utils.py reads _mesh_resources.child_to_root_mapping unguarded (0.2.2 guards it).
OLD_TORCH_GROUPS = {("megatron-fsdp", "0.1.0"), ("megatron-fsdp", "0.2.0")}
REPRESENTATIVE = {member: rep for rep, members in GROUPS.items() for member in [rep, *members]}
ALL = sorted(REPRESENTATIVE)
STRATEGIES = ("optim", "optim_grads", "optim_grads_params")


@pytest.fixture(autouse=True)
def _no_cuda_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron-core 0.15.0/0.15.1 JIT-build a CUDA allocator at import when torch has MemPool
    (the PyPI CUDA build of 2.8); without a GPU torch's arch detection raises IndexError, which
    the release does not catch. With an arch list the build fails the way it catches."""
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")


def _ids(release: tuple[str, str]) -> str:
    return f"{'fsdp' if release[0] == 'megatron-fsdp' else 'core'}-{release[1]}"


def run(release: tuple[str, str], **fields: object) -> CaseResult:
    """One case on ``release`` with the settings its group needs (module docstring)."""
    dist, version = release
    old_group = REPRESENTATIVE[release] == ("megatron-fsdp", "0.1.0")
    python = None
    if REPRESENTATIVE[release] in OLD_TORCH_GROUPS:
        if not OLD_TORCH:
            if os.environ.get("CI"):
                pytest.fail("CI must set MFSDP_TEST_OLD_TORCH_PYTHON (a venv with torch 2.8)")
            pytest.skip("needs torch < 2.11: set MFSDP_TEST_OLD_TORCH_PYTHON")
        python = OLD_TORCH
    spec = {"flavour": "core" if dist == "megatron-core" else "standalone",
            "path": release_path(dist, version), "units": 6, "grad_reduce": "per-token",
            "linear": "overwrite" if old_group else "emulated", "python": python, **fields}
    return run_cached(CaseSpec(**spec))  # type: ignore[arg-type]


def _package_files(dist: str, version: str) -> dict[str, str]:
    root = releases.unpacked(dist, version)
    package = root / ("megatron_fsdp" if dist == "megatron-fsdp"
                      else "megatron/core/distributed/fsdp/src/megatron_fsdp")
    # package_info.py holds only the version string (and the vendored one is often wrong).
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(package.glob("*.py")) if p.name != "package_info.py"}


@pytest.mark.parametrize("member", [m for ms in GROUPS.values() for m in ms], ids=_ids)
def test_same_code(member: tuple[str, str]) -> None:
    """Why a group may share one full matrix: the package is byte-identical (but for the
    version string)."""
    files = _package_files(*member)
    assert "param_and_grad_buffer.py" in files and "megatron_fsdp.py" in files
    assert files == _package_files(*REPRESENTATIVE[member])


# Every release; a group's members beyond its representative (byte-identical: test_same_code)
# run in the long set only.
EVERY_RELEASE = [pytest.param(release, id=_ids(release),
                              marks=() if REPRESENTATIVE[release] == release else pytest.mark.long)
                 for release in ALL]


@pytest.mark.parametrize("release", EVERY_RELEASE)
def test_shipped_crashes(release: tuple[str, str]) -> None:
    assert_no_buffer_crash(run(release, hotfix="off"))


@pytest.mark.parametrize("release", EVERY_RELEASE)
def test_zero3_double_buffer_equals_reference(release: tuple[str, str]) -> None:
    result = run(release, hotfix="on")
    assert repaired(result, "getter-guard") and repaired(result, "missed-post-backward"), \
        describe(result)
    assert_matches_reference(result)
    assert result.ordering_checks and result.ordering_violations == 0, describe(result)


# one microbatch without the double buffer asks least of the fixes: the long set runs it
@pytest.mark.parametrize(("double_buffer", "microbatches"), [
    pytest.param(True, 1, id="db-1"), pytest.param(True, 2, id="db-2"),
    pytest.param(False, 1, id="no-db-1", marks=pytest.mark.long),
    pytest.param(False, 2, id="no-db-2")])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("release", sorted(GROUPS), ids=_ids)
def test_full_matrix(release: tuple[str, str], strategy: str, double_buffer: bool,
                     microbatches: int) -> None:
    result = run(release, hotfix="on", strategy=strategy, double_buffer=double_buffer,
                 microbatches=microbatches)
    accumulates_zero1 = strategy == "optim" and microbatches > 1
    if accumulates_zero1 and REPRESENTATIVE[release] == ("megatron-fsdp", "0.1.0"):
        # 0.1.0 sets no overwrite_main_grad and needs the harness's overwriting fused linear,
        # so its ZeRO-1 accumulation differs from plain PyTorch; the hotfix does not repair it
        # (docs/RELEASES.md, "Not repaired"). ZeRO-1 takes nothing from either pool, so the
        # hotfixed run must equal the shipped one without the double buffer, bit for bit.
        shipped = run(release, hotfix="off", strategy=strategy, double_buffer=False,
                      microbatches=microbatches)
        assert not result.crashed and not shipped.crashed, describe(result) + describe(shipped)
        assert result.grad_digest == shipped.grad_digest, describe(result)
        return
    if accumulates_zero1:  # zero1-fused-wgrad-overwrite, repaired (docs/RELEASE_DEFECTS.md)
        assert repaired(result, "zero1-accumulate"), describe(result)
    assert_matches_reference(result)
    assert result.ordering_violations == 0, describe(result)


def test_zero1_microbatches_differ_on_the_newest_release_as_shipped() -> None:
    """The ZeRO-1 defect the rows above repair is not these old releases' alone: 0.6.1 as
    shipped has it too (zero1-fused-wgrad-overwrite)."""
    result = run_cached(CaseSpec(flavour="standalone", hotfix="off",
                                 path=release_path("megatron-fsdp", "0.6.1"),
                                 strategy="optim", microbatches=2, iterations=1))
    assert not result.crashed, describe(result)
    assert result.max_abs_grad_error and result.max_abs_grad_error > 1e-3, describe(result)


FSDP_023 = ("megatron-fsdp", "0.2.3")


def test_parameter_pool_crash_is_the_releases_own() -> None:
    """No lazy getter at all (plain autograd linears, hotfix off): the first unit, whose input
    needs no gradient, never gets its post-backward hook and the next forward asserts on the
    *parameter* pool."""
    result = run(FSDP_023, hotfix="off", linear="unfused")
    assert_no_buffer_crash(result)
    assert "[fsdp_params]" in (result.exception or ""), describe(result)
    assert_matches_reference(run(FSDP_023, hotfix="on", linear="unfused"))


def test_getter_guard_alone_leaves_the_parameter_pool_crash() -> None:
    result = run(FSDP_023, hotfix="on", disabled_fixes="missed-post-backward")
    assert_no_buffer_crash(result)
    assert "[fsdp_params]" in (result.exception or ""), describe(result)
    copy = result.hotfix_status["copies"][0]
    (limit,) = [x for x in copy["limits"] if x["fix"] == "missed-post-backward"]
    assert not limit["covered"] and not limit["refused_at_model_construction"], limit


def test_scale_then_sum_gives_wrong_grads_as_shipped() -> None:
    """The release's own gradient scaling (harness default elsewhere) is wrong here, with no
    double buffer and no hotfix: why these tests use grad_reduce="per-token"."""
    result = run(FSDP_023, hotfix="off", double_buffer=False, grad_reduce="scale-then-sum")
    assert not result.crashed, describe(result)
    assert result.max_abs_grad_error and result.max_abs_grad_error > 1e-3, describe(result)


def test_scale_then_sum_set_after_building_is_stopped_with_the_hotfix() -> None:
    """``fully_shard_model`` takes no gradient_reduce_div_fusion, so the harness (like a
    ``fully_shard`` user) sets it on the built model's config: the hotfix judges the changed
    config at the first gradient synchronisation and stops the step there, before the optimizer
    uses gradients world-size times too large; per-token loss is exact with the hotfix on."""
    fields = {"hotfix": "on", "double_buffer": False, "microbatches": 1, "iterations": 1}
    stopped = run(FSDP_023, grad_reduce="scale-then-sum", **fields)
    message = stopped.exception or ""
    assert stopped.crashed and message.startswith(
        "UnsupportedConfiguration: mfsdp_hotfix: megatron-fsdp 0.2.3 at "), describe(stopped)
    for words in ("(its ddp_config was changed after the model was built)",
                  "sharded-grads-summed-unscaled, which no fix repairs",
                  "Workaround: calculate_per_token_loss=True"):
        assert words in message, message
    assert_matches_reference(run(FSDP_023, grad_reduce="per-token", **fields))


def test_a_model_on_the_scale_then_sum_path_is_refused() -> None:
    """bf16 gradient buffers (fully_shard's grad_reduce_in_fp32=False) take the release's
    scale-then-SUM branch, so the model is refused when it is built; as shipped its gradients
    are wrong. (The harness's gradient_reduce_div_fusion=False is set after the model is
    built: the test above.)"""
    fields = {"dtype": "bfloat16", "grad_reduce": "scale-then-sum", "double_buffer": False}
    refused = run(FSDP_023, hotfix="on", **fields)
    assert refused.crashed, describe(refused)
    message = refused.exception or ""
    assert message.startswith("UnsupportedConfiguration: mfsdp_hotfix: megatron-fsdp 0.2.3 "
                              "at "), describe(refused)
    for words in ("sharded-grads-summed-unscaled, which no fix repairs",
                  "Workaround: calculate_per_token_loss=True"):
        assert words in message, message
    assert "changed after the model was built" not in message, message  # refused when built
    shipped = run(FSDP_023, hotfix="off", **fields)
    assert not shipped.crashed and shipped.max_rel_grad_error, describe(shipped)
    assert shipped.max_rel_grad_error > 0.5, describe(shipped)


@pytest.fixture(scope="module")
def unknown_hooks_shape(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """megatron-fsdp 0.2.3 with one statement added to ``_register_fsdp_hooks``: a fork."""
    root = tmp_path_factory.mktemp("fork") / "site"
    shutil.copytree(releases.unpacked(*FSDP_023), root)
    path = root / "megatron_fsdp" / "megatron_fsdp.py"
    text = path.read_text()
    anchor = "\n        self._params_require_handle_grad = set()\n"
    assert text.count(anchor) == 1
    path.write_text(text.replace(anchor, anchor + "        self._fork_was_here = True\n"))
    return root


def test_unverified_shape_refuses_zero3_double_buffer(unknown_hooks_shape: Path) -> None:
    spec = {"flavour": "standalone", "path": str(unknown_hooks_shape), "units": 6,
            "grad_reduce": "per-token"}
    refused = run_cached(CaseSpec(**spec))  # type: ignore[arg-type]
    assert refused.crashed, describe(refused)
    message = refused.exception or ""
    assert message.startswith("UnsupportedConfiguration: mfsdp_hotfix: megatron-fsdp 0.2.3 "
                              "at "), describe(refused)
    for words in ("ZeRO-3 (optim_grads_params) with fsdp_double_buffer=True",
                  "missed-post-backward is unverified", "fsdp_double_buffer=False",
                  "megatron-fsdp >= 0.6.0"):
        assert words in message, message
    (copy,) = refused.hotfix_status["copies"]
    assert copy["fixes"]["missed-post-backward"]["state"] == "unverified"
    assert copy["fixes"]["getter-guard"]["state"] == "applied"
    covered = run_cached(CaseSpec(**{**spec, "strategy": "optim_grads"}))  # type: ignore[arg-type]
    assert_matches_reference(covered)
