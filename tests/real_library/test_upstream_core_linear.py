"""The change proposed upstream to megatron-core's fused linear (``upstream/core_linear.patch``)
and its upstream-style test, on the CPU.

The test (``upstream/tests/unit_tests/tensor_parallel/test_mfsdp_fused_wgrad_accumulation.py``)
runs a megatron-core tree's real ``linear_with_grad_accumulation_and_async_allreduce`` with
fusion on, for a weight that carries what Megatron-FSDP gives a parameter (``__fsdp_param__``,
``get_main_grad``, ``overwrite_main_grad``), over two microbatches. That path needs no CUDA
kernel: without TransformerEngine the Megatron-FSDP branch computes the gradient with torch's
matmul, and APEX's ``fused_weight_gradient_mlp_cuda`` is checked only by
``ColumnParallelLinear.__init__``, which the test does not build. So on the CPU it shows the
rule (add, or overwrite where the parameter says so), not TransformerEngine's GEMM.

* On the releases (0.19.2 here; 0.15.3 and 0.18.2 with ``MFSDP_TEST_ALL_RELEASES=1``) it fails as
  shipped (``MFSDP_HOTFIX=0``) and passes with the hotfix (``core-linear-accumulate``).
* With a Megatron-LM clone (``MFSDP_TEST_MEGATRON_LM``): the patch applies strictly to main's
  ``megatron/core`` and changes only the Megatron-FSDP branch; the test fails on main and passes
  patched; ``mfsdp-hotfix status`` calls the fix needed on main and not needed patched.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import releases
import upstream_change
from conftest import run_python
from realcases import extended, release_path
from upstream_change import CORE_LINEAR_PATCH, CORE_LINEAR_TEST, DoesNotApply

from mfsdp_hotfix import fingerprints, fix_catalogue, registry
from mfsdp_hotfix.structure import core_linear

LAYERS = "megatron/core/tensor_parallel/layers.py"
NO_CLONE = ("needs a Megatron-LM clone with main: set MFSDP_TEST_MEGATRON_LM to its git dir "
            "(no release has main's fused linear)")


def run_upstream_test(root: Path | str, tmp_path: Path, hotfix: bool) -> tuple[int, str]:
    """The upstream test against the megatron-core tree ``root``, in a fresh interpreter that
    imports ``mfsdp_hotfix`` first (``hotfix`` False: with ``MFSDP_HOTFIX=0``, as shipped)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    test = tmp_path / CORE_LINEAR_TEST.name
    shutil.copy(CORE_LINEAR_TEST, test)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    code = ("import sys, mfsdp_hotfix, pytest; sys.exit(pytest.main(['-q', '-p', "
            f"'no:cacheprovider', '--rootdir', {str(tmp_path)!r}, {str(test)!r}]))")
    proc = run_python(code, root, env={} if hotfix else {"MFSDP_HOTFIX": "0"}, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def assert_fails_only_where_it_must_add(code: int, out: str) -> None:
    assert code == 1 and "1 failed, 1 passed" in out, out[-3000:]
    assert "accumulates_unless_told_to_overwrite[False]" in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("version", [
    extended("0.15.3", id="0.15.3"), extended("0.18.2", id="0.18.2"),
    pytest.param("0.19.2", id="0.19.2")])
def test_the_upstream_test_fails_as_shipped_and_passes_with_the_hotfix(version: str,
                                                                       tmp_path: Path) -> None:
    root = release_path("megatron-core", version)
    assert_fails_only_where_it_must_add(*run_upstream_test(root, tmp_path / "off", False))
    code, out = run_upstream_test(root, tmp_path / "on", True)
    assert code == 0 and "2 passed" in out, out[-3000:]


def _main() -> Path:
    tree = releases.git_core_tree("main")
    if tree is None:
        pytest.skip(NO_CLONE)
    return tree


@pytest.fixture(scope="module")
def patched_main(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("core-linear") / "main"
    shutil.copytree(_main() / "megatron", root / "megatron")
    assert upstream_change.apply_at(CORE_LINEAR_PATCH, root) == [LAYERS]
    return root


def _backward(root: Path) -> str:
    return fingerprints.parse_file(root / LAYERS).source(registry.CORE_LINEAR_BACKWARD)


def test_the_patch_applies_to_main_and_changes_only_the_megatron_fsdp_branch(
        patched_main: Path) -> None:
    before, after = _backward(_main()), _backward(patched_main)
    assert core_linear.fsdp_wgrad_overwrites(before)
    assert core_linear.fsdp_wgrad_follows_overwrite_main_grad(after)
    assert not core_linear.fsdp_wgrad_overwrites(after)
    shipped = (_main() / LAYERS).read_text()
    changed = (patched_main / LAYERS).read_text()
    assert shipped.replace(before, "") == changed.replace(after, "")  # nothing else changed
    with pytest.raises(DoesNotApply):
        upstream_change.apply_at(CORE_LINEAR_PATCH, patched_main)


@pytest.mark.slow
def test_the_upstream_test_fails_on_main_and_passes_patched(patched_main: Path,
                                                            tmp_path: Path) -> None:
    assert_fails_only_where_it_must_add(*run_upstream_test(_main(), tmp_path / "main", False))
    code, out = run_upstream_test(patched_main, tmp_path / "patched", False)
    assert code == 0 and "2 passed" in out, out[-3000:]


def _fix_state(root: Path) -> str:
    code = ("import sys; sys.modules['torch'] = None; from mfsdp_hotfix.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    proc = run_python("", root, args=("-c", code, "status", "--json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (copy,) = json.loads(proc.stdout)["copies"]
    assert copy["copy"] == "megatron-core (vendored)", copy
    return str(copy["fixes"][fix_catalogue.CORE_LINEAR_ACCUMULATE.id]["state"])


def test_status_needs_the_fix_on_main_and_not_once_patched(patched_main: Path) -> None:
    assert _fix_state(_main()) == "would apply"
    assert _fix_state(patched_main) == "not needed"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
