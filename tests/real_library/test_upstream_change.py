"""The change proposed upstream (``upstream/``): it applies to the trees CI has, its upstream-style
regression test fails without it and passes with it, the patched trees reuse gradient slots only
in order with gradients equal to plain PyTorch (``MFSDP_HOTFIX=0``), and the hotfix, finding the
change, stands down while its audit keeps watching.

CI runs a few rows of the configuration grid on the patched trees; ``MFSDP_TEST_UPSTREAM_GRID=1``
runs all of them (ZeRO-2/3 x FixedPool/MaxPool x N = 2, 3, 4). With a Megatron-LM clone
(``MFSDP_TEST_MEGATRON_LM``) the real NVIDIA main and PR #6316 trees are patched and run too.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import releases
import snapshots
import upstream_change
from configurations import MAXPOOL, grads_equal
from conftest import run_python
from upstream_change import TREES, DoesNotApply

from mfsdp_hotfix import eras, fix_catalogue, registry
from mfsdp_hotfix.selftest.protocol import MEGATRON_LM
from mfsdp_hotfix.selftest.runner import run_case
from mfsdp_hotfix.selftest.spec import CaseSpec

NO_CLONE = ("needs a Megatron-LM clone with that ref: set MFSDP_TEST_MEGATRON_LM to its git dir "
            "(CI without one runs the same patch on the trees it rebuilds)")
GRID = os.environ.get("MFSDP_TEST_UPSTREAM_GRID", "") not in ("", "0")


def _patched(name: str) -> Path:
    tree = upstream_change.patched(name)
    if tree is None:
        pytest.skip(f"{TREES[name].source}: {NO_CLONE}")
    return tree


def _base(name: str) -> Path:
    base = TREES[name].base()
    if base is None:
        pytest.skip(f"{TREES[name].source}: {NO_CLONE}")
    return base


@pytest.mark.parametrize("name", sorted(TREES))
def test_the_patch_applies_and_changes_only_the_drain(name: str) -> None:
    """Applied to its tree, the patch leaves the getter and the wait as they were and makes the
    drain wait on the caller's stream (era "none"); applied again, it no longer applies."""
    base, tree = _base(name), _patched(name)
    before = _read(base / "megatron_fsdp" / "param_and_grad_buffer.py")
    after = _read(tree / "megatron_fsdp" / "param_and_grad_buffer.py")
    assert before[registry.GETTER] == after[registry.GETTER]
    assert before[registry.WAIT] == after[registry.WAIT]
    assert "with torch.cuda.stream(self.rs_stream):" in before[registry.DRAIN]
    assert "rs_stream" not in after[registry.DRAIN].split("#")[0]
    with pytest.raises(DoesNotApply):
        upstream_change.apply(TREES[name].patch, tree / "megatron_fsdp")


def test_main_patch_does_not_apply_to_pr6316_hence_its_own_patch(tmp_path: Path) -> None:
    shutil.copytree(_base("pr6316-rebuilt") / "megatron_fsdp", tmp_path / "megatron_fsdp")
    with pytest.raises(DoesNotApply, match="hunk 1"):
        upstream_change.apply(upstream_change.MAIN_PATCH, tmp_path / "megatron_fsdp")


def _read(path: Path) -> dict[str, str]:
    from mfsdp_hotfix import fingerprints

    parsed = fingerprints.parse_file(path)
    return {name: parsed.source(name) for name in registry.FUNCTIONS}


def _run_upstream_test(tree: Path, tmp_path: Path) -> tuple[int, str]:
    """Run upstream's regression test, as Megatron-LM lays it out, against ``tree``'s
    ``megatron_fsdp`` placed where Megatron-LM keeps it; on CPU, CUDA streams and events come
    from the happens-before stand-in (which records who waited on what, as CUDA orders it), and
    the test's "needs CUDA" skip is answered yes."""
    root = upstream_change.vendored_layout(tree, tmp_path / "root")
    test = tmp_path / upstream_change.UPSTREAM_TEST.name
    shutil.copy(upstream_change.UPSTREAM_TEST, test)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    code = ("import sys, torch; from mfsdp_hotfix.selftest import cuda_standin; "
            "cuda_standin.install(); torch.cuda.is_available = lambda: True; "
            "import pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', "
            f"'--rootdir', {str(tmp_path)!r}, {str(test)!r}]))")
    proc = run_python(code, root, env={"MFSDP_HOTFIX": "0"})
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", sorted(TREES))
def test_the_upstream_test_fails_as_shipped_and_passes_patched(name: str,
                                                               tmp_path: Path) -> None:
    code, out = _run_upstream_test(_base(name), tmp_path / "shipped")
    assert code == 1 and "1 failed" in out, out[-3000:]
    assert "assert unit2.waited_on == [writer]" in out, out[-3000:]  # waited on rs_stream
    code, out = _run_upstream_test(_patched(name), tmp_path / "patched")
    assert code == 0 and "1 passed" in out, out[-3000:]


# (tree, strategy, pool options, N): N = 2 on main's code; 3 and 4 on PR #6316's.
ROWS = [(tree, strategy, pool, n)
        for strategy in ("optim_grads_params", "optim_grads")
        for pool in ("fixedpool", "maxpool")
        for tree, n in (("main-on-0.6.1", 2), ("pr6316-rebuilt", 3), ("pr6316-rebuilt", 4))]
IN_CI = {("main-on-0.6.1", "optim_grads_params", "fixedpool", 2),
         ("pr6316-rebuilt", "optim_grads", "maxpool", 3),
         ("pr6316-rebuilt", "optim_grads_params", "fixedpool", 4)}
CLONE_ROWS = [("main", "optim_grads_params", "fixedpool", 2),
              ("pr6316", "optim_grads_params", "fixedpool", 3)]


def _spec(tree: Path, strategy: str, pool: str, n: int, hotfix: str) -> CaseSpec:
    options: dict[str, object] = dict(MAXPOOL) if pool == "maxpool" else {}
    if n != 2:
        options["fsdp_buffer_count"] = n
    return CaseSpec(flavour="standalone", path=str(tree), hotfix=hotfix, audit=True, units=6,
                    microbatches=2, protocol=MEGATRON_LM, strategy=strategy, options=options)


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS + CLONE_ROWS, ids=["-".join(map(str, r))
                                                        for r in ROWS + CLONE_ROWS])
def test_the_patched_tree_reuses_slots_in_order_without_the_hotfix(row: tuple) -> None:
    name, strategy, pool, n = row
    if row in ROWS and row not in IN_CI and not GRID:
        pytest.skip("the whole grid runs with MFSDP_TEST_UPSTREAM_GRID=1")
    result = run_case(_spec(_patched(name), strategy, pool, n, "off"))
    where = f"{row}: {result.exception} {result.log_tail[-2000:]}"
    assert not result.crashed, where
    assert result.ordering_checks > 0 and result.ordering_violations == 0, where
    assert (result.audit_reuses, result.audit_unordered) == (result.ordering_checks, 0), where
    assert grads_equal(result), where


def _status(root: Path) -> dict[str, object]:
    code = ("import sys; sys.modules['torch'] = None; from mfsdp_hotfix.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    proc = run_python("", root, args=("-c", code, "status", "--json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (copy,) = json.loads(proc.stdout)["copies"]
    return dict(copy)


def _stands_down(copy: dict[str, object]) -> None:
    assert copy["era"] == "none" and not copy["refused"], copy
    fixes = copy["fixes"]
    assert isinstance(fixes, dict)
    for fix in fix_catalogue.DOUBLE_BUFFER_FIXES:
        assert fixes[fix.id]["state"] == "not needed", fixes
    assert eras.ORDERED_DRAIN_UPSTREAM in fixes["ordered-drain"]["reason"], fixes


@pytest.mark.parametrize("name", sorted(TREES))
def test_status_says_the_standalone_copy_needs_no_double_buffer_fix(name: str) -> None:
    _stands_down(_status(_patched(name)))


@pytest.mark.parametrize("source", ["snapshot:main-d98e8a64", "git:main"])
def test_status_says_megatron_cores_vendored_copy_needs_no_double_buffer_fix(
        source: str, tmp_path: Path) -> None:
    """megatron-core's copy, where Megatron-LM keeps it: main rebuilt (0.19.2's code, labelled
    0.20.0+d98e8a6) or the real main, with ``main.patch`` applied."""
    if source.startswith("git:"):
        tree = releases.git_tree("main")
        if tree is None:
            pytest.skip(f"{source}: {NO_CLONE}")
        root = upstream_change.vendored_layout(tree, tmp_path)
    else:
        root = snapshots.build(snapshots.SNAPSHOTS["main-d98e8a64"], tmp_path)
    package = root / upstream_change.VENDORED
    assert _status(root)["era"] == "C"
    upstream_change.apply(upstream_change.MAIN_PATCH, package)
    copy = _status(root)
    assert copy["copy"] == "megatron-core (vendored)", copy
    _stands_down(copy)


@pytest.mark.slow
def test_with_the_hotfix_loaded_nothing_is_patched_and_the_audit_still_watches() -> None:
    result = run_case(_spec(_patched("pr6316-rebuilt"), "optim_grads_params", "fixedpool", 3,
                            "on"))
    where = f"{result.exception} {result.log_tail[-2000:]}"
    assert not result.crashed and grads_equal(result), where
    copy = (result.audit_report or {})["copies"][0]
    assert copy["era"] == "none", copy
    assert not set(copy["fixes"]) & {fix.id for fix in fix_catalogue.DOUBLE_BUFFER_FIXES}, copy
    assert result.audit_verdict == "ordered" and result.audit_reuses > 0, where
    assert result.audit_unordered == 0, where


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
