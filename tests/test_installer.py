"""Install permutations, each in a fresh interpreter against real Megatron-FSDP releases:
import order, both copies in one process, idempotence, uninstall, the switch, strict mode, a
failing fix, wrapt 1.x and 2.x."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import releases
from conftest import REFUSES_HSDP, REFUSES_TE_GRAPHS, FixStates, run_python

REPORT = """
import json, sys
from megatron_fsdp import param_and_grad_buffer as pgb, megatron_fsdp as mf
def kind(obj):
    return getattr(obj, "_mfsdp_hotfix_fix", None) or type(obj).__name__
out = {"drain": kind(pgb.GradReducePipeline.__dict__["_enforce_double_buffer_limit"]),
       "init": kind(mf.MegatronFSDP.__dict__["_init_fsdp_param_and_grad_buffer"]),
       "hotfix_loaded": "mfsdp_hotfix" in sys.modules}
if "mfsdp_hotfix" in sys.modules:
    import mfsdp_hotfix
    out["status"] = mfsdp_hotfix.status()
print("REPORT" + json.dumps(out))
"""


def report(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT"))
    return json.loads(line[len("REPORT"):])


def fixes(data: dict, package: str = "megatron_fsdp") -> dict[str, str]:
    copy = next(c for c in data["status"]["copies"] if c["package"] == package)
    return FixStates({fix: state["state"] for fix, state in copy["fixes"].items()})


@pytest.fixture(scope="module")
def fsdp051() -> Path:
    return releases.unpacked("megatron-fsdp", "0.5.1")


@pytest.mark.parametrize("order", ["hotfix first", "megatron first"])
def test_import_order(fsdp051: Path, order: str) -> None:
    imports = ("import mfsdp_hotfix\nimport megatron_fsdp\n" if order == "hotfix first" else
               "import megatron_fsdp\nimport mfsdp_hotfix\n")
    data = report(run_python(imports + REPORT, fsdp051))
    assert data["drain"] == "ordered-drain" and data["init"] == "getter-guard"
    assert fixes(data) == {"getter-guard": "applied", "ordered-drain": "applied",
                           "missed-post-backward": "applied",
                           "zero1-accumulate": "applied",
                           "reduce-once": "applied",
        "single-rank-reduce": "applied", "core-linear-accumulate": "not needed",
        "inert-warm-up": "applied", "root-forward-hooks": "applied",
        "replicated-grad-stats": "not needed", "auto-sync-stop": "applied"}
    assert data["status"]["loaded_via"] == "import" and data["status"]["hotfix"] == "active"


def test_armed_before_megatron_is_imported(fsdp051: Path) -> None:
    """Right after ``import mfsdp_hotfix`` the API already says what would apply, in the same
    words as the CLI: armed, and each fix 'would apply' to the installed copy."""
    code = """
import json, sys, mfsdp_hotfix
before = mfsdp_hotfix.status()
assert "megatron_fsdp" not in sys.modules
import megatron_fsdp.megatron_fsdp
print("REPORT" + json.dumps({"before": before, "status": mfsdp_hotfix.status()}))
"""
    data = report(run_python(code, fsdp051))
    before = data["before"]
    assert (before["hotfix"], before["loaded_via"]) == ("armed", "import")
    (copy,) = before["copies"]
    assert copy["imported"] is False
    assert FixStates({fix: state["state"] for fix, state in copy["fixes"].items()}) == {
        "getter-guard": "would apply", "ordered-drain": "would apply",
        "missed-post-backward": "would apply",
        "zero1-accumulate": "would apply",
        "reduce-once": "would apply",
        "single-rank-reduce": "would apply", "core-linear-accumulate": "not needed",
        "inert-warm-up": "would apply", "root-forward-hooks": "would apply",
        "replicated-grad-stats": "not needed", "auto-sync-stop": "would apply"}
    assert data["status"]["hotfix"] == "active"
    assert fixes(data) == {"getter-guard": "applied", "ordered-drain": "applied",
                           "missed-post-backward": "applied",
                           "zero1-accumulate": "applied",
                           "reduce-once": "applied",
        "single-rank-reduce": "applied", "core-linear-accumulate": "not needed",
        "inert-warm-up": "applied", "root-forward-hooks": "applied",
        "replicated-grad-stats": "not needed", "auto-sync-stop": "applied"}


def test_misspelt_variable_warns_once_at_install(fsdp051: Path) -> None:
    proc = run_python("import mfsdp_hotfix\n" + REPORT, fsdp051,
                      env={"MFSDP_HOTFIX_TIMEOUT": "-3"})
    assert report(proc)["drain"] == "ordered-drain"
    assert proc.stderr.count("MFSDP_HOTFIX_TIMEOUT is not a variable") == 1, proc.stderr
    assert "did you mean MFSDP_HOTFIX_CROSS_RANK_TIMEOUT?" in proc.stderr


def test_era_c_keeps_its_own_getter(fsdp_release) -> None:
    data = report(run_python("import mfsdp_hotfix\n" + REPORT, fsdp_release("0.6.1")))
    assert data["drain"] == "ordered-drain" and data["init"] == "function"
    assert fixes(data) == {"getter-guard": "not needed", "ordered-drain": "applied",
                           "missed-post-backward": "not needed",
                           "zero1-accumulate": "applied",
                           "reduce-once": "applied",
        "single-rank-reduce": "applied", "core-linear-accumulate": "not needed",
        "inert-warm-up": "applied", "root-forward-hooks": "not needed",
        "replicated-grad-stats": "not needed", "auto-sync-stop": "applied"}


def test_both_copies_in_one_process(fsdp051: Path) -> None:
    core = releases.unpacked("megatron-core", "0.16.1")
    code = """
import mfsdp_hotfix
import megatron_fsdp.megatron_fsdp
import megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp as vendored
import megatron_fsdp.param_and_grad_buffer as standalone
assert vendored.MegatronFSDP is not megatron_fsdp.megatron_fsdp.MegatronFSDP
v = vendored.MegatronFSDP.__dict__["_init_fsdp_param_and_grad_buffer"]
s = standalone.GradReducePipeline.__dict__["_enforce_double_buffer_limit"]
print("REPORT" + __import__("json").dumps({"status": mfsdp_hotfix.status(),
      "marks": [v._mfsdp_hotfix_fix, s._mfsdp_hotfix_fix]}))
"""
    data = report(run_python(code, fsdp051, core))
    assert data["marks"] == ["getter-guard", "ordered-drain"]
    eras = {c["package"]: (c["version"], c["era"]) for c in data["status"]["copies"]}
    assert eras == {"megatron_fsdp": ("0.5.1", "B"),
                    registry_vendored(): ("0.16.1", "A")}
    assert fixes(data, registry_vendored()) == {"getter-guard": "applied",
                                                 "ordered-drain": "applied",
                                                 "missed-post-backward": "applied",
                                                 "zero1-accumulate": "applied",
                                                 "reduce-once": "applied",
        "single-rank-reduce": "applied", "core-linear-accumulate": "applied",
        "inert-warm-up": "not needed", "root-forward-hooks": "applied",
        "replicated-grad-stats": "applied", "auto-sync-stop": "applied"}


def registry_vendored() -> str:
    from mfsdp_hotfix.registry import COPIES

    return COPIES[1].package


def test_install_twice_changes_nothing_and_uninstall_restores(fsdp051: Path) -> None:
    code = """
import mfsdp_hotfix, megatron_fsdp.megatron_fsdp as mf, megatron_fsdp.param_and_grad_buffer as pgb
first = pgb.GradReducePipeline.__dict__["_enforce_double_buffer_limit"]
assert mfsdp_hotfix.install() is True
assert pgb.GradReducePipeline.__dict__["_enforce_double_buffer_limit"] is first
assert mfsdp_hotfix.uninstall() is True
restored = pgb.GradReducePipeline.__dict__["_enforce_double_buffer_limit"]
assert restored is first.__wrapped__ and type(restored).__name__ == "function"
assert type(mf.MegatronFSDP.__dict__["_init_fsdp_param_and_grad_buffer"]).__name__ == "function"
assert mfsdp_hotfix.status()["hotfix"] == "uninstalled"
assert mfsdp_hotfix.install() is True
again = pgb.GradReducePipeline.__dict__["_enforce_double_buffer_limit"]
assert again is not first and again.__wrapped__ is restored
print("REPORT{}")
"""
    report(run_python(code, fsdp051))


def test_uninstall_leaves_a_foreign_wrapper_in_place(fsdp051: Path) -> None:
    code = """
import mfsdp_hotfix, megatron_fsdp.param_and_grad_buffer as pgb
ours = pgb.GradReducePipeline.__dict__["_enforce_double_buffer_limit"]
def theirs(self, add_buckets):
    return ours(self, add_buckets)
pgb.GradReducePipeline._enforce_double_buffer_limit = theirs
assert mfsdp_hotfix.uninstall() is False
assert pgb.GradReducePipeline.__dict__["_enforce_double_buffer_limit"] is theirs
print("REPORT{}")
"""
    proc = run_python(code, fsdp051)
    report(proc)
    assert "replaced again by someone else" in proc.stderr


@pytest.mark.parametrize("value, patched", [("0", False), ("off", False), ("1", True),
                                            ("on", True), ("", True), ("strict", True)])
def test_switch(fsdp051: Path, value: str, patched: bool) -> None:
    data = report(run_python("import mfsdp_hotfix\n" + REPORT, fsdp051,
                             env={"MFSDP_HOTFIX": value}))
    assert (data["drain"] == "ordered-drain") is patched


def test_garbage_switch_warns_and_applies(fsdp051: Path) -> None:
    proc = run_python("import mfsdp_hotfix\n" + REPORT, fsdp051, env={"MFSDP_HOTFIX": "maybe"})
    assert report(proc)["drain"] == "ordered-drain"
    assert "MFSDP_HOTFIX='maybe' is not understood" in proc.stderr
    assert "strict" in proc.stderr and "using the default" in proc.stderr


def test_disabled_fix_is_reported(fsdp051: Path) -> None:
    data = report(run_python("import mfsdp_hotfix\n" + REPORT, fsdp051,
                             env={"MFSDP_HOTFIX_DISABLED_FIXES": "getter-guard"}))
    assert data["init"] == "function"
    assert fixes(data) == {"getter-guard": "disabled", "ordered-drain": "applied",
                           "missed-post-backward": "applied",
                           "zero1-accumulate": "applied",
                           "reduce-once": "applied",
        "single-rank-reduce": "applied", "core-linear-accumulate": "not needed",
        "inert-warm-up": "applied", "root-forward-hooks": "applied",
        "replicated-grad-stats": "not needed", "auto-sync-stop": "applied"}


@pytest.fixture
def modified_release(tmp_path: Path, fsdp051: Path) -> Path:
    import shutil

    root = tmp_path / "site"
    shutil.copytree(fsdp051, root)
    path = root / "megatron_fsdp" / "param_and_grad_buffer.py"
    path.write_text(path.read_text().replace("if len(double_buf_units) > 1:",
                                             "if len(double_buf_units) > 3:", 1))
    return root


def test_refused_copy_warns_once_and_keeps_only_the_fixes_that_rest_on_none_of_it(
        modified_release: Path) -> None:
    """Refused for an unknown drain: the double-buffer fixes are not applied, the fixes outside
    the double buffer (which rest on none of its functions) are, and status lists the release
    defects of the copy."""
    proc = run_python("import mfsdp_hotfix\n" + REPORT, modified_release)
    data = report(proc)
    assert data["drain"] == "function" and data["init"] == "function"
    assert fixes(data) == {"getter-guard": "refused", "ordered-drain": "refused",
                           "missed-post-backward": "applied",
                           "zero1-accumulate": "applied", "reduce-once": "applied",
        "single-rank-reduce": "applied", "core-linear-accumulate": "not needed",
        "inert-warm-up": "applied", "root-forward-hooks": "applied",
        "replicated-grad-stats": "not needed", "auto-sync-stop": "applied"}
    (copy,) = data["status"]["copies"]
    assert copy["refused"] is True
    assert [(d["name"], d["repaired"]) for d in copy["release_defects"]] == [
        ("zero1-fused-wgrad-overwrite", True), ("unsharded-grads-reduced-twice", True),
        ("single-rank-grads-reduced-every-microbatch", True), ("optimizer-warm-up-step", True),
        ("root-hooks-skipped", True), ("te-partial-cuda-graphs", False)]
    assert proc.stderr.count("NOT patching megatron-fsdp") == 1
    assert "run with fsdp_double_buffer=False to avoid the double-buffer gradient bugs (ZeRO-2/3)" \
        in proc.stderr
    assert ("Still applied: missed-post-backward, zero1-accumulate, reduce-once, "
            "single-rank-reduce") in proc.stderr


def test_a_refusal_names_the_workaround_of_each_defect_left(modified_release: Path) -> None:
    proc = run_python("import mfsdp_hotfix\n" + REPORT, modified_release,
                      env={"MFSDP_HOTFIX_DISABLED_FIXES": "zero1-accumulate"})
    report(proc)
    assert ("zero1-fused-wgrad-overwrite (ZeRO-1 (data_parallel_sharding_strategy='optim') "
            in proc.stderr), proc.stderr
    assert ("is not repaired either: ZeRO-2 or ZeRO-3 (optim_grads, optim_grads_params) or "
            "fused wgrad accumulation off") in proc.stderr
    assert "Still applied: missed-post-backward, reduce-once" in proc.stderr


def test_strict_mode_turns_a_refusal_into_an_error(modified_release: Path) -> None:
    proc = run_python("import mfsdp_hotfix\nimport megatron_fsdp", modified_release,
                      env={"MFSDP_HOTFIX": "strict"})
    assert proc.returncode != 0
    assert "HotfixRefused" in proc.stderr and "MFSDP_HOTFIX=strict" in proc.stderr
    caught = run_python("import mfsdp_hotfix\ntry:\n    import megatron_fsdp\n"
                        "except mfsdp_hotfix.HotfixRefused:\n    print('CAUGHT')",
                        modified_release, env={"MFSDP_HOTFIX": "strict"})
    assert caught.stdout.strip() == "CAUGHT", caught.stderr[-2000:]


def test_a_failing_fix_never_breaks_the_import(fsdp051: Path) -> None:
    code = """
import mfsdp_hotfix.fixes.ordered_drain as od
def broken(module):
    raise RuntimeError("simulated bug in the hotfix")
od.apply = broken
""" + REPORT
    proc = run_python(code, fsdp051)
    data = report(proc)
    assert data["drain"] == "function"
    assert fixes(data)["ordered-drain"] == "failed"
    assert "simulated bug" in data["status"]["failures"]["ordered-drain"]
    assert proc.stderr.count("ordered-drain failed in") == 1


@pytest.fixture(scope="session")
def wrapt1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = releases.CACHE / "wrapt1"
    if not (target / "wrapt").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--target", str(target), "wrapt>=1.14,<2"], check=True)
    return target


def test_wrapt_1(fsdp051: Path, wrapt1: Path) -> None:
    code = "import wrapt\nprint('WRAPT', wrapt.__version__)\nimport mfsdp_hotfix\n" + REPORT
    proc = run_python(code, wrapt1, fsdp051)
    data = report(proc)
    assert "WRAPT 1." in proc.stdout
    assert data["drain"] == "ordered-drain" and data["init"] == "getter-guard"


def test_import_mfsdp_hotfix_imports_neither_torch_nor_megatron() -> None:
    proc = run_python("import sys, mfsdp_hotfix\nprint('REPORT' + __import__('json').dumps("
                      "sorted(m for m in sys.modules if m.split('.')[0] in "
                      "('torch', 'megatron', 'megatron_fsdp', 'wrapt'))))")
    assert report(proc) == []



def test_bytecode_only_install_is_refused(tmp_path: Path, fsdp051: Path) -> None:
    import compileall
    import shutil

    root = tmp_path / "site"
    shutil.copytree(fsdp051, root)
    assert compileall.compile_dir(root / "megatron_fsdp", legacy=True, quiet=1)
    for source in (root / "megatron_fsdp").glob("*.py"):
        source.unlink()
    proc = run_python("import mfsdp_hotfix\n" + REPORT, root)
    data = report(proc)
    assert data["drain"] == "function"
    assert "cannot read the code to verify its shape" in proc.stderr
    assert "NOT patching megatron-fsdp (megatron-fsdp 0.5.1)" in proc.stderr


def test_garbage_in_every_variable_at_once(fsdp051: Path) -> None:
    env = {"MFSDP_HOTFIX": "yes please", "MFSDP_HOTFIX_DISABLED_FIXES": ",,nonsense,",
           "MFSDP_HOTFIX_CROSS_RANK_CHECK": "sometimes", "MFSDP_HOTFIX_CROSS_RANK_TIMEOUT": "1e99",
           "MFSDP_HOTFIX_BOOTSTRAP": "\u00e9"}
    proc = run_python("import mfsdp_hotfix\n" + REPORT, fsdp051, env=env)
    data = report(proc)
    assert data["drain"] == "ordered-drain" and data["init"] == "getter-guard"
    for name in ("MFSDP_HOTFIX=", "MFSDP_HOTFIX_DISABLED_FIXES", "MFSDP_HOTFIX_CROSS_RANK_CHECK",
                 "MFSDP_HOTFIX_CROSS_RANK_TIMEOUT"):
        assert proc.stderr.count(name) == 1, name
    settings = data["status"]["settings"]
    assert settings["mode"] == "on" and settings["cross_rank_check"] == "error"
    assert settings["disabled_fixes"] == []


def test_a_fix_that_fails_at_runtime_leaves_the_process_not_protected(fsdp051: Path) -> None:
    """A fix that raises while training switches itself off (incidents.report): from then on
    the process's verdict says NOT protected, names the failure and the workaround, and the
    fix is ``failed`` in the copy's row."""
    code = """
from mfsdp_hotfix import incidents
incidents.report("ordered-drain", "_enforce_double_buffer_limit", RuntimeError("boom"))
""" + REPORT
    data = report(run_python("import mfsdp_hotfix\nimport megatron_fsdp.megatron_fsdp\n" + code,
                             fsdp051))
    verdict = data["status"]["verdict"]
    assert verdict == {"affected": True, "protected": False, "line": (
        "affected: megatron-fsdp 0.5.1 (era B) — NOT protected: ordered-drain failed; use "
        "fsdp_double_buffer=False"), "details": [
        "why: ordered-drain failed (_enforce_double_buffer_limit: RuntimeError: boom)",
        "instead: use fsdp_double_buffer=False",
        "refused at model construction, if you build: ZeRO-2/3 (optim_grads, optim_grads_params) "
        "with fsdp_double_buffer=True (no fix makes it right): set fsdp_double_buffer=False",
        REFUSES_HSDP, REFUSES_TE_GRAPHS]}
    assert fixes(data)["ordered-drain"] == "failed"
    (copy,) = data["status"]["copies"]
    assert copy["fixes"]["ordered-drain"]["reason"] == (
        "_enforce_double_buffer_limit: RuntimeError: boom")


def test_a_refused_copy_keeps_and_names_the_fixes_that_rest_on_none_of_it(
        tmp_path: Path) -> None:
    """megatron-fsdp 0.2.3 refused for its drain: missed-post-backward and zero1-accumulate are
    applied in the process, and its verdict and warning name them, what is left as shipped
    and the workaround of each defect left (sharded-grads-summed-unscaled: no fix repairs it)."""
    import shutil

    root = tmp_path / "site"
    shutil.copytree(releases.unpacked("megatron-fsdp", "0.2.3"), root)
    path = root / "megatron_fsdp" / "param_and_grad_buffer.py"
    old = "            if len(double_buf_units) > 2:\n                keep_n -= 1"
    path.write_text(path.read_text().replace(old, old.replace("> 2", "> 3"), 1))
    proc = run_python("import mfsdp_hotfix\nimport megatron_fsdp.megatron_fsdp\n" + REPORT, root)
    data = report(proc)
    assert fixes(data) == {"getter-guard": "refused", "ordered-drain": "refused",
                           "missed-post-backward": "applied", "zero1-accumulate": "applied",
                           "reduce-once": "not needed", "single-rank-reduce": "applied",
                           "core-linear-accumulate": "not needed",
                           "expert-accumulate": "not needed", "inert-warm-up": "not needed",
                           "root-forward-hooks": "applied", "replicated-grad-stats": "not needed",
                           "auto-sync-stop": "applied"}
    line = "\n".join(data["status"]["verdict"]["details"])
    assert line.startswith("why: getter-guard, ordered-drain left as shipped (unrecognised code "
                           "shape in _enforce_double_buffer_limit"), line
    assert ("; the hotfix still applies missed-post-backward, zero1-accumulate, "
            "single-rank-reduce, root-forward-hooks, auto-sync-stop; ") in line
    assert ("\ninstead: use fsdp_double_buffer=False\ninstead: for sharded-grads-summed-unscaled "
            "use calculate_per_token_loss=True (the release scales nothing; the loss carries the "
            "normalisation)\n") in line, line
    assert ("Still applied: missed-post-backward, zero1-accumulate, single-rank-reduce, "
            "root-forward-hooks, auto-sync-stop" in proc.stderr)
    assert ("sharded-grads-summed-unscaled (ZeRO-2/3 (optim_grads, optim_grads_params) over 2 or "
            "more data-parallel ranks") in proc.stderr
    assert "is not repaired either: calculate_per_token_loss=True" in proc.stderr
