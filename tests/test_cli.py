"""``mfsdp-hotfix status``: the JSON schema and the ``--check`` exit codes on a patched, an
unpatched and a refused install, without torch."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REFUSES_HSDP, REFUSES_TE_GRAPHS, TE_GRAPHS, FixStates, run_python, verdict_line

from mfsdp_hotfix import bootstrap, reporting

# First on PYTHONPATH: a new process here loads the hotfix (the sitecustomize route), whether or
# not this test environment has the package's .pth installed.
ARMED = bootstrap.SITECUSTOMIZE_DIR
# torch made unimportable: status must not need it.
NO_TORCH = "import sys; sys.modules['torch'] = None; from mfsdp_hotfix.cli import main; " \
           "sys.exit(main(sys.argv[1:]))"


def status(*path: Path, env: dict[str, str] | None = None, check: bool = True
           ) -> tuple[int, dict]:
    args = ("-c", NO_TORCH, "status", "--json") + (("--check",) if check else ())
    proc = run_python("", *path, env=env, args=args)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout)


def test_schema_of_a_patched_install(fsdp_release) -> None:
    code, data = status(fsdp_release("0.5.1"))
    # nothing loads the hotfix in a new process here: the check fails, as the verdict says
    (unfixed,) = data["unfixed"]
    assert code == 1 and data["verdict"]["protected"] is False
    assert unfixed.startswith("megatron-fsdp 0.5.1 at ") and unfixed.endswith(
        ": getter-guard, ordered-drain, missed-post-backward, zero1-accumulate, reduce-once, "
        "single-rank-reduce, inert-warm-up, root-forward-hooks, auto-sync-stop would apply, but "
        + reporting.UNPROTECTING["not loaded"])
    armed_code, armed = status(Path(ARMED), fsdp_release("0.5.1"))
    assert armed_code == 0 and armed["unfixed"] == [] and armed["verdict"]["protected"] is True
    assert set(data) >= {"mfsdp_hotfix", "scope", "hotfix", "hotfix_meaning", "loaded_via",
                         "settings", "copies", "failures", "bootstrap", "unfixed"}
    assert data["hotfix"] == "not loaded" and data["loaded_via"] is None  # no .pth on this path
    assert set(data["bootstrap"]) == {"pth_files", "pth_active", "sitecustomize_on_pythonpath",
                                      "variables"}
    (copy,) = data["copies"]
    assert copy["package"] == "megatron_fsdp" and copy["version"] == "0.5.1"
    assert copy["era"] == "B" and copy["refused"] is False and copy["imported"] is False
    assert set(copy["fingerprints"]) == set(copy["shapes"])
    assert FixStates({k: v["state"] for k, v in copy["fixes"].items()}) == {
        "getter-guard": "would apply", "ordered-drain": "would apply",
        "missed-post-backward": "would apply",
        "zero1-accumulate": "would apply",
        "reduce-once": "would apply", "single-rank-reduce": "would apply",
        "core-linear-accumulate": "not needed", "inert-warm-up": "would apply",
        "root-forward-hooks": "would apply", "replicated-grad-stats": "not needed",
        "auto-sync-stop": "would apply"}
    assert [(x["fix"], x["covered"]) for x in copy["limits"]] == [
        ("getter-guard", True), ("ordered-drain", True), ("missed-post-backward", True),
        ("zero1-accumulate", True),
        ("reduce-once", False), ("reduce-once", False), ("reduce-once", True),
        ("reduce-once", True), ("single-rank-reduce", True), ("root-forward-hooks", True),
        ("auto-sync-stop", True), (None, False)]
    assert [x["configuration"] for x in copy["limits"] if not x["covered"]] == [
        "HSDP with ZeRO-1 (optim) and overlap_grad_reduce=False",
        "HSDP with no_shard and overlap_grad_reduce=False", TE_GRAPHS]


def test_oldest_release_names_its_zero3_coverage(fsdp_release) -> None:
    code, data = status(fsdp_release("0.2.3"), check=False)
    (copy,) = data["copies"]
    assert code == 0 and copy["era"] == "A"
    assert copy["shapes"]["MegatronFSDP._register_fsdp_hooks"] == "0.14"
    assert copy["fixes"]["missed-post-backward"]["state"] == "would apply"
    assert {x["configuration"]: x["covered"] for x in copy["limits"]} == {
        "ZeRO-2/3 (optim_grads, optim_grads_params) with fsdp_double_buffer=True and fused "
        "wgrad accumulation": True,
        "ZeRO-2/3 (optim_grads, optim_grads_params) with fsdp_double_buffer=True": True,
        "ZeRO-3 (optim_grads_params) with fsdp_double_buffer=True": True,
        "a root module that owns parameters, or whose module registered last has parameters "
        "(it may not be the last to run in forward)": True,
        "model auto-sync (sync_model_each_microbatch=True) with a gradient buffer reduced in "
        "place (ZeRO-1 over 2 or more ranks, no_shard over 2 or more without an average, "
        "HSDP)": True,
        "ZeRO-1 (optim)": True,
        "ZeRO-2/3 (optim_grads, optim_grads_params) with a gradient buffer whose data-parallel "
        "group has one rank (data-parallel size 1; experts with expert-parallel size equal to "
        "the data-parallel size)": True,
        # the release defect no fix repairs (docs/OLDEST_RELEASES.md)
        "ZeRO-2/3 (optim_grads, optim_grads_params) over 2 or more data-parallel ranks with the "
        "gradients scaled before a SUM reduction (gradient_reduce_div_fusion=False or a bf16 "
        "gradient buffer, without calculate_per_token_loss or average_in_collective)": False,
        TE_GRAPHS: False}  # every copy: refused when built


def test_a_release_defect_no_fix_repairs_fails_the_check(fsdp_release) -> None:
    """megatron-fsdp 0.2.3 scales the local shard instead of the bucket it reduces: the hotfix
    loaded in every process does not make it protected, and --check agrees with the line."""
    code, data = status(Path(ARMED), fsdp_release("0.2.3"))
    line = data["verdict"]["line"]
    assert code == 1 and data["verdict"]["protected"] is False, line
    assert line == ("affected: megatron-fsdp 0.2.3 (era A) — NOT protected: 1 defect not "
                    "repaired; use calculate_per_token_loss=True"), line
    details = data["verdict"]["details"]
    assert details[0].startswith("why: sharded-grads-summed-unscaled is not repaired by the "
                                 "hotfix (it hits ZeRO-2/3 (optim_grads, optim_grads_params) over "
                                 "2 or more data-parallel ranks"), details
    assert details[1] == ("instead: for sharded-grads-summed-unscaled use "
                          "calculate_per_token_loss=True (the release scales nothing; the loss "
                          "carries the normalisation)"), details
    defect, graphs = [d for d in data["copies"][0]["release_defects"] if d["fix"] is None]
    assert graphs["name"] == "te-partial-cuda-graphs" and graphs["refused_when_built"]
    assert defect["name"] == "sharded-grads-summed-unscaled" and not defect["repaired"]
    assert defect["carrier"] == {"function": "GradReducePipeline._bucket_group_gradient_reduce",
                                 "shape": "0.14"}
    assert any("release defect sharded-grads-summed-unscaled not repaired" in problem
               for problem in data["unfixed"])
    proc = run_python("", ARMED, fsdp_release("0.2.3"), args=("-m", "mfsdp_hotfix", "status"))
    assert next(line for line in proc.stdout.splitlines() if line.startswith("- ")) == (
        "- megatron-fsdp 0.2.3 (era A): getter-guard, ordered-drain, missed-post-backward, "
        "zero1-accumulate, single-rank-reduce, root-forward-hooks, auto-sync-stop would apply; "
        "sharded-grads-summed-unscaled NOT "
        "repaired; for "
        "sharded-grads-summed-unscaled use calculate_per_token_loss=True (the release scales "
        "nothing; the loss carries the normalisation); at "
        f"{fsdp_release('0.2.3') / 'megatron_fsdp'}"), proc.stdout


def test_switched_off_install_fails_the_check(fsdp_release) -> None:
    code, data = status(fsdp_release("0.5.1"), env={"MFSDP_HOTFIX": "0"})
    assert code == 1 and "MFSDP_HOTFIX=0" in data["unfixed"][0]


def test_switched_off_says_off_everywhere(fsdp_release) -> None:
    """Off is off: no fix "would apply" under MFSDP_HOTFIX=0, in the JSON or the text; a fix
    the copy does not need stays "not needed"."""
    _, data = status(fsdp_release("0.5.1"), env={"MFSDP_HOTFIX": "0"})
    assert data["hotfix"] == "off"
    assert FixStates({k: fix["state"] for k, fix in data["copies"][0]["fixes"].items()}) == {
        "getter-guard": "off", "ordered-drain": "off", "missed-post-backward": "off",
        "zero1-accumulate": "off",
        "reduce-once": "off", "single-rank-reduce": "off", "core-linear-accumulate": "not needed",
        "inert-warm-up": "off", "root-forward-hooks": "off", "replicated-grad-stats": "not needed",
        "auto-sync-stop": "off"}
    for verbose in ((), ("--verbose",)):
        proc = run_python("", fsdp_release("0.5.1"), env={"MFSDP_HOTFIX": "0"},
                          args=("-m", "mfsdp_hotfix", "status", *verbose))
        assert "the hotfix is off: " in proc.stdout and "would apply" not in proc.stdout
    assert "getter-guard: off (MFSDP_HOTFIX=0)" in proc.stdout


@pytest.mark.parametrize(("version", "needed"), [
    ("0.6.1", ["ordered-drain"]),  # era C: the getter is guarded, stale units released lazily
    # its hooks release stale units lazily, into a pool that does not keep a bucket's slot
    ("0.4.0", ["getter-guard", "ordered-drain", "missed-post-backward"]),
    ("0.1.0", ["getter-guard", "ordered-drain", "missed-post-backward"]),
])
def test_switched_off_leaves_unfixed_only_what_the_copy_needs(fsdp_release, version: str,
                                                              needed: list[str]) -> None:
    """Under MFSDP_HOTFIX=0, "Left unfixed" and the limits' advice name only the fixes this
    copy needs (no "upgrade to megatron-fsdp >= 0.6.0" for 0.6.1)."""
    code, data = status(fsdp_release(version), env={"MFSDP_HOTFIX": "0"})
    (copy,) = data["copies"]
    # and the fixes of the release defects this copy has (zero1-accumulate from megatron-fsdp
    # 0.2.0, reduce-once from 0.3.0, single-rank-reduce in all: docs/RELEASE_DEFECTS.md)
    outside = (["zero1-accumulate", "reduce-once"] if version != "0.1.0" else []) + [
        "single-rank-reduce"]
    # and the fixes of fully_shard_optimizer's warm-up step (from 0.4.0) and of the root module's
    # own parameters (before 0.6.0); only the latter limits a model's configuration
    warm_up = ["inert-warm-up"] if version != "0.1.0" else []
    root = ["root-forward-hooks"] if version != "0.6.1" else []
    # and auto-sync-stop, which every release needs (its limit: model auto-sync with a buffer
    # reduced in place)
    auto_sync = ["auto-sync-stop"]
    # and 0.1.0's defect that no fix repairs (docs/OLDEST_RELEASES.md), and every copy's
    # te-partial-cuda-graphs, which nothing refuses with the hotfix off
    unrepaired = (["sharded-grads-summed-unscaled"] if version == "0.1.0" else []) + [
        "te-partial-cuda-graphs"]
    assert code == 1 and list(dict.fromkeys(x["fix"] or x["defect"] for x in copy["limits"])) == (
        needed + outside + root + auto_sync + unrepaired)
    fixes = [line for line in data["unfixed"] if ": release defect " not in line]
    assert [line.rsplit(": ", 1)[1].split()[0] for line in fixes] == (
        needed + outside + warm_up + root + auto_sync)
    assert len(data["unfixed"]) == len(fixes) + len(unrepaired)
    if version == "0.6.1":
        assert ">=" not in json.dumps(copy["limits"]), copy["limits"]


def test_an_imported_copy_is_reported_imported_with_the_hotfix_off(fsdp_release) -> None:
    """MFSDP_HOTFIX=0 (diagnosing a release as shipped): summary() and status() still say
    which copy this process imported, and that nothing was applied to it."""
    proc = run_python("import megatron_fsdp, mfsdp_hotfix\nprint(mfsdp_hotfix.summary())\n"
                      "print(mfsdp_hotfix.status()['copies'][0]['imported'])",
                      fsdp_release("0.6.1"), env={"MFSDP_HOTFIX": "0"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [
        "mfsdp_hotfix: megatron-fsdp 0.6.1 era C: nothing applied (MFSDP_HOTFIX=0)", "True"]


def test_misspelt_variable_is_named_with_the_closest_known_one(fsdp_release) -> None:
    _, data = status(fsdp_release("0.5.1"), env={"MFSDP_HOTFIX_TIMEOUT": "-3"})
    (problem,) = data["settings"]["problems"]
    assert "MFSDP_HOTFIX_TIMEOUT" in problem and "MFSDP_HOTFIX_CROSS_RANK_TIMEOUT" in problem


@pytest.mark.parametrize("route", ["bootstrap", "none"])
def test_a_misspelt_switch_is_told_once_on_stderr(fsdp_release, route: str) -> None:
    """``MFSDP_HOTFX=0`` leaves the hotfix armed: said once on stderr (by the bootstrap at
    interpreter start where it runs, else by status), never mixed into the answer on stdout;
    other MFSDP_ names that users and launchers set are none of ours and stay quiet."""
    path = [ARMED] if route == "bootstrap" else []
    proc = run_python("", *path, fsdp_release("0.5.1"),
                      env={"MFSDP_HOTFX": "0", "MFSDP_DEBUG": "1", "MFSDP_HOTFIX_DEBUG": "1"},
                      args=("-m", "mfsdp_hotfix", "status", "--check"))
    warning = ("MFSDP_HOTFX is not a variable mfsdp_hotfix reads (did you mean MFSDP_HOTFIX?); "
               "it is ignored")
    # one prefix, whichever route tells it (in a job: the bootstrap or install(); here: status)
    assert proc.stderr == f"mfsdp_hotfix: warning: {warning}\n", proc.stderr
    assert "MFSDP_HOTFX" not in proc.stdout
    if route == "bootstrap":
        assert proc.returncode == 0 and proc.stdout.startswith(
            "affected: megatron-fsdp 0.5.1 (era B) — protected: the hotfix is armed"), proc.stdout


def test_a_misspelt_switch_is_told_with_the_same_prefix_by_install(fsdp_release) -> None:
    """Where no bootstrap ran (``import mfsdp_hotfix`` in a script), ``install()`` tells it
    through the logger, with the prefix the bootstrap and ``status`` use."""
    proc = run_python("import logging; logging.basicConfig(format='%(message)s')\n"
                      "import mfsdp_hotfix; mfsdp_hotfix.install()", fsdp_release("0.5.1"),
                      env={"MFSDP_HOTFX": "0"})
    assert proc.stderr == ("mfsdp_hotfix: warning: MFSDP_HOTFX is not a variable mfsdp_hotfix "
                           "reads (did you mean MFSDP_HOTFIX?); it is ignored\n"), proc.stderr


def test_the_verdict_of_a_switched_off_install(fsdp_release) -> None:
    _, data = status(fsdp_release("0.5.1"), env={"MFSDP_HOTFIX": "0"})
    assert data["verdict"] == {
        "affected": True, "protected": False,
        "line": "affected: megatron-fsdp 0.5.1 (era B) — NOT protected: MFSDP_HOTFIX=0; use "
                "fsdp_double_buffer=False",
        "details": ["why: MFSDP_HOTFIX=0",
                    # with the hotfix off nothing refuses it
                    "why: te-partial-cuda-graphs is not repaired by the hotfix (it hits "
                    f"{TE_GRAPHS})", "instead: use fsdp_double_buffer=False",
                    "instead: for zero1-fused-wgrad-overwrite use ZeRO-2 or ZeRO-3 (optim_grads, "
                    "optim_grads_params)", "instead: for unsharded-grads-reduced-twice use "
                    "overlap_grad_reduce=True (the default)", "instead: for "
                    "single-rank-grads-reduced-every-microbatch use one microbatch per step, on "
                    "megatron-fsdp 0.4.0 and later / megatron-core 0.17 and later",
                    "instead: for optimizer-warm-up-step use optimizer.state.clear() right after "
                    "fully_shard_optimizer, where no checkpoint is loaded",
                    "instead: for root-hooks-skipped use register a parameter-free module last, "
                    "run last (e.g. an nn.Identity head applied to the output), and keep no "
                    "parameter on the root module itself (move it into a child module)",
                    "instead: for te-partial-cuda-graphs use cuda_graph_impl='none' (no CUDA "
                    "graphs)"]}


def test_the_api_answers_for_this_process(fsdp_release) -> None:
    """``mfsdp_hotfix.status()["verdict"]``: the same line, for the process that asks."""
    proc = run_python("import json, megatron_fsdp.megatron_fsdp, mfsdp_hotfix\n"
                      "print(json.dumps(mfsdp_hotfix.status()['verdict']))", fsdp_release("0.6.1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {
        "affected": True, "protected": True,
        "line": "affected: megatron-fsdp 0.6.1 (era C) — protected: the hotfix is active",
        "details": ["applies ordered-drain, zero1-accumulate, reduce-once, single-rank-reduce, "
                    "inert-warm-up, auto-sync-stop",
                    REFUSES_HSDP, REFUSES_TE_GRAPHS]}


def test_disabled_fix_fails_the_check(fsdp_release) -> None:
    code, data = status(fsdp_release("0.4.0"),
                        env={"MFSDP_HOTFIX_DISABLED_FIXES": "getter-guard"})
    assert code == 1 and "getter-guard disabled" in data["unfixed"][0]


def test_refused_install_fails_the_check(fsdp_release, tmp_path: Path) -> None:
    root = tmp_path / "site"
    shutil.copytree(fsdp_release("0.5.1"), root)
    path = root / "megatron_fsdp" / "param_and_grad_buffer.py"
    path.write_text(path.read_text().replace("if len(double_buf_units) > 1:",
                                             "if len(double_buf_units) > 3:", 1))
    code, data = status(root)
    assert code == 1 and data["copies"][0]["refused"] is True
    assert "refused" in data["unfixed"][0]
    # the fixes that rest on none of the refused code would still apply, and the copy's
    # release defects are listed
    fixes = FixStates({fix: state["state"] for fix, state in data["copies"][0]["fixes"].items()})
    assert fixes == {"getter-guard": "refused", "ordered-drain": "refused",
                     "missed-post-backward": "would apply", "zero1-accumulate": "would apply",
                     "reduce-once": "would apply", "single-rank-reduce": "would apply",
        "core-linear-accumulate": "not needed", "inert-warm-up": "would apply",
        "root-forward-hooks": "would apply", "replicated-grad-stats": "not needed",
        "auto-sync-stop": "would apply"}
    assert [d["name"] for d in data["copies"][0]["release_defects"]] == [
        "zero1-fused-wgrad-overwrite", "unsharded-grads-reduced-twice",
        "single-rank-grads-reduced-every-microbatch", "optimizer-warm-up-step",
        "root-hooks-skipped", "te-partial-cuda-graphs"]
    assert status(root, check=False)[0] == 0


def test_era_c_needs_no_getter_guard(fsdp_release) -> None:
    code, data = status(fsdp_release("0.6.1"), check=False)
    assert code == 0
    assert data["copies"][0]["fixes"]["getter-guard"]["state"] == "not needed"


@pytest.mark.parametrize("path_kind", ["none", "release"])
def test_text_output(fsdp_release, path_kind: str) -> None:
    """The answer first, one short line per copy; the shapes and defects behind --verbose."""
    path = [fsdp_release("0.4.0")] if path_kind == "release" else []
    proc = run_python("", ARMED, *path, args=("-m", "mfsdp_hotfix", "status"))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    lines = proc.stdout.splitlines()
    if path_kind == "none":
        assert lines[0] == "not affected: no Megatron-FSDP copy found"
        return
    assert lines[:5] == [
        "affected: megatron-fsdp 0.4.0 (era A) — protected: the hotfix is armed",
        "  applies getter-guard, ordered-drain, missed-post-backward, zero1-accumulate, "
        "reduce-once, single-rank-reduce, inert-warm-up, root-forward-hooks, auto-sync-stop",
        "  refused at model construction, if you build: HSDP with ZeRO-1 (optim) and "
        "overlap_grad_reduce=False (no fix makes it right): use overlap_grad_reduce=True (the "
        "default)",
        f"  {REFUSES_TE_GRAPHS}",
        "- megatron-fsdp 0.4.0 (era A): getter-guard, ordered-drain, missed-post-backward, "
        "zero1-accumulate, reduce-once, single-rank-reduce, inert-warm-up, root-forward-hooks, "
        "auto-sync-stop would apply; at "
        f"{fsdp_release('0.4.0') / 'megatron_fsdp'}"], lines
    assert lines[5].endswith(": the hotfix is armed at interpreter start by the sitecustomize "
                             "on PYTHONPATH") and len(lines) == 7, lines
    assert "main_grad_getter" not in proc.stdout and "release defect " not in proc.stdout
    verbose = run_python("", ARMED, *path, args=("-m", "mfsdp_hotfix", "status",
                                                 "--verbose")).stdout
    assert verbose.splitlines()[0] == lines[0]
    # A standalone copy is told in its own release numbers, not megatron-core's.
    assert ("    main_grad_getter: as shipped in megatron-fsdp 0.4.0-0.5.1 (and megatron-core "
            "0.17.0-0.18.2; unguarded)") in verbose
    assert "as shipped in 0.17" not in verbose
    assert ("    _register_fsdp_hooks: the code of megatron-core 0.17, recognised by "
            "fingerprint") in verbose
    assert ("    release defect zero1-fused-wgrad-overwrite: repaired (zero1-accumulate: would "
            "apply)") in verbose
    assert "getter-guard: would apply (" in verbose


def test_selftest_help_explains_every_option() -> None:
    proc = run_python("", args=("-m", "mfsdp_hotfix", "selftest", "--help"))
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "vendored in megatron-core" in text and "installs nothing" in text
    assert "selftest: PASS" in text


def test_selftest_without_torch_says_cannot_run_and_installs_nothing() -> None:
    proc = run_python("", args=("-c", NO_TORCH, "selftest"))
    assert proc.returncode == 2
    assert proc.stderr.startswith("selftest: CANNOT RUN: no torch")
    assert "pip install" not in proc.stderr


@pytest.mark.parametrize(("version", "era", "protects_fusion_off"),
                         [("0.4.0", "A", True), ("0.5.1", "B", False), ("0.6.1", "C", False)])
def test_status_says_what_protects_without_the_hotfix(fsdp_release, version: str, era: str,
                                                      protects_fusion_off: bool) -> None:
    """Users who turned fused wgrad off to dodge the bug learn from status whether that works."""
    _, data = status(fsdp_release(version))
    (copy,) = data["copies"]
    assert copy["era"] == era
    assert "fsdp_double_buffer=False" in copy["without_hotfix"]
    assert ("does NOT protect" not in copy["without_hotfix"]) == protects_fusion_off
    proc = run_python("", fsdp_release(version),
                      args=("-m", "mfsdp_hotfix", "status", "--verbose"))
    assert f"    without the hotfix: {copy['without_hotfix']}" in proc.stdout


def test_selftest_without_numpy_says_it_cannot_run() -> None:
    """torch.distributed's all_gather_object (Megatron-FSDP calls it) needs numpy on CPU."""
    proc = run_python("", args=("-c", "import sys; sys.modules['numpy'] = None; "
                                "from mfsdp_hotfix.cli import main; sys.exit(main(['selftest']))"))
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
    assert verdict_line(proc.stderr).startswith(
        "selftest: CANNOT RUN: no numpy in this environment; `pip install numpy`"), proc.stderr


@pytest.mark.parametrize("gpu", [False, True])
def test_selftest_refuses_a_path_that_is_not_a_folder(tmp_path: Path, gpu: bool) -> None:
    """A mistyped --path must not test the installed copy instead (and print PASS)."""
    (tmp_path / "file").write_text("")
    for path, why in ((tmp_path / "missing", "no such folder"),
                      (tmp_path / "file", "is a file, not a folder")):
        proc = run_python("", args=("-m", "mfsdp_hotfix", "selftest", "--path", str(path),
                                    "--json", *(["--gpu"] if gpu else [])))
        assert proc.returncode == 2, proc.stdout + proc.stderr[-2000:]
        assert verdict_line(proc.stderr).startswith("selftest: CANNOT RUN: --path "), proc.stderr
        assert f"--path {path}" in proc.stderr and why in proc.stderr, proc.stderr
        data = json.loads(proc.stdout)
        assert data["verdict"] == "CANNOT RUN" and why in data["cannot_run"]


def test_selftest_of_a_copy_that_is_not_installed_cannot_run() -> None:
    """``--flavour core`` without megatron-core: nothing was tested, which is no FAIL of a fix;
    the line names the package to install, and it is known before any worker starts (as
    ``status`` knows it)."""
    if importlib.util.find_spec("megatron") is not None:
        pytest.skip("megatron-core is installed in this environment")
    proc = run_python("", args=("-m", "mfsdp_hotfix", "selftest", "--flavour", "core"),
                      timeout=60)
    # no progress line: no worker was started
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout[-2000:]
    assert proc.stderr == (
        "selftest: CANNOT RUN: megatron-core is not installed here; install megatron-core, or "
        "give --path a folder that holds it\n  nothing was started or tested\n"), proc.stderr


def test_gpu_selftest_of_a_copy_that_is_not_installed_cannot_run(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``--gpu --flavour core`` without megatron-core, on a machine with a GPU (its probe
    stands in here): CANNOT RUN with what to install, exit 2, before any run starts."""
    if importlib.util.find_spec("megatron") is not None:
        pytest.skip("megatron-core is installed in this environment")
    from mfsdp_hotfix import cli
    from mfsdp_hotfix.selftest import gpu

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("a GPU run was started")

    monkeypatch.setattr(gpu, "probe_cuda", lambda: 1)  # one GPU, as torch would count it
    monkeypatch.setattr(gpu, "run_gpu_selftest", started)
    assert cli.main(["selftest", "--gpu", "--flavour", "core"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("selftest: CANNOT RUN: megatron-core is not installed here; install "
                          "megatron-core"), err


def test_selftest_of_a_folder_without_a_copy_tests_nothing(fsdp_release, tmp_path: Path) -> None:
    """``--path DIR`` tests the copy in DIR: a folder that holds none is refused before anything
    runs, even where another copy is installed (here megatron-fsdp 0.4.0 on PYTHONPATH)."""
    for extra in ([], ["--json"]):
        proc = run_python("", fsdp_release("0.4.0"), timeout=60,
                          args=("-m", "mfsdp_hotfix", "selftest", "--path", str(tmp_path), *extra))
        if extra:
            assert json.loads(proc.stdout)["verdict"] == "CANNOT RUN"
            continue
        assert proc.returncode == 2 and proc.stdout == "", proc.stdout[-2000:]
        assert proc.stderr.startswith("selftest: CANNOT RUN: no Megatron-FSDP copy in --path"), \
            proc.stderr
        assert f"--path DIR tests the copy in DIR alone; {tmp_path} holds none" in proc.stderr


def test_version() -> None:
    from mfsdp_hotfix import __version__

    proc = run_python("", args=("-m", "mfsdp_hotfix", "--version"))
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"mfsdp-hotfix {__version__}\n", "")


def test_no_command_lists_the_commands_one_line_each() -> None:
    """Bare ``mfsdp-hotfix`` is a usage error (exit 2) that shows the usage, every command on a
    line of its own and the error: not the whole help (docs/CLI.md)."""
    proc = run_python("", args=("-c", NO_TORCH), env={"COLUMNS": "100"})
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    usage, title, *listed, error = proc.stderr.splitlines()
    assert (usage, title) == ("usage: mfsdp-hotfix COMMAND [OPTIONS]", "commands:"), proc.stderr
    assert [re.match(r"  (\S+)  +\S", line).group(1) for line in listed] == [
        "status", "selftest", "run", "audit", "parity", "bootstrap-path", "help"], proc.stderr
    assert error == ("mfsdp-hotfix: error: name a COMMAND (above; 'mfsdp-hotfix help COMMAND' "
                     "shows its options)"), proc.stderr


@pytest.mark.parametrize("command", ["", "status", "selftest", "run", "audit", "parity",
                                     "bootstrap-path", "help"])
def test_help_wraps_between_words_and_names_what_it_points_to(command: str) -> None:
    """argparse's own wrapping breaks after a hyphen (``mfsdp-`` / ``hotfix``); ``help
    --help`` names the commands it takes instead of pointing 'above' at nothing."""
    proc = run_python("", args=("-c", NO_TORCH, *command.split(), "--help"),
                      env={"COLUMNS": "60"})
    assert proc.returncode == 0, proc.stderr
    broken = [line for line in proc.stdout.splitlines() if re.search(r"[A-Za-z]-$", line)]
    assert not broken, proc.stdout
    assert "above" not in proc.stdout, proc.stdout
    if command == "help":
        assert "one of: status, selftest, run, audit, parity, bootstrap-path" in " ".join(
            proc.stdout.split())


@pytest.mark.parametrize("command", ["", "status", "audit"])
def test_help_command_prints_what_help_prints(command: str) -> None:
    """``mfsdp-hotfix help [COMMAND]`` is ``mfsdp-hotfix [COMMAND] --help``."""
    want = run_python("", args=("-c", NO_TORCH, *command.split(), "--help"))
    got = run_python("", args=("-c", NO_TORCH, "help", *command.split()))
    assert (got.returncode, got.stdout, got.stderr) == (0, want.stdout, ""), got.stderr
    assert want.returncode == 0 and want.stdout.startswith(f"usage: mfsdp-hotfix {command}")


@pytest.mark.parametrize("args", [("selftest", "--release", "9.9.9"), ("status", "--bogus"),
                                  ("run",), ("bootstrap-path", "x")])
def test_a_usage_error_shows_its_own_commands_usage(args: tuple[str, ...]) -> None:
    proc = run_python("", args=("-c", NO_TORCH, *args))
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    usage, error = proc.stderr.split("\nmfsdp-hotfix ")
    assert usage.startswith(f"usage: mfsdp-hotfix {args[0]} "), proc.stderr
    assert error.startswith(f"{args[0]}: error: "), proc.stderr


def test_help_of_an_unknown_command_is_a_usage_error() -> None:
    proc = run_python("", args=("-c", NO_TORCH, "help", "frobnicate"))
    assert proc.returncode == 2 and "invalid choice: 'frobnicate'" in proc.stderr


def test_selftest_says_it_does_not_pass_the_audit_on() -> None:
    """``mfsdp-hotfix audit -- mfsdp-hotfix selftest`` ends NO DATA; the selftest says why."""
    proc = run_python("", args=("-c", NO_TORCH, "selftest"), env={"MFSDP_HOTFIX_AUDIT": "a"})
    assert proc.returncode == 2 and proc.stdout.startswith(
        "selftest: note: MFSDP_HOTFIX_AUDIT is set (as 'mfsdp-hotfix audit' sets it), but the "
        "selftest does not pass it to its workers"), proc.stdout
    assert "'mfsdp-hotfix selftest --audit' audits each run" in proc.stdout


def test_one_table_lists_every_exit_status_of_every_command() -> None:
    """docs/CLI.md's table of exit statuses names each status the code can return."""
    from conftest import REPO

    from mfsdp_hotfix import tree
    from mfsdp_hotfix.audit.verdicts import VERDICTS
    from mfsdp_hotfix.commands import exits

    text = (REPO / "docs" / "CLI.md").read_text()
    table = text.split("## Exit statuses", 1)[1].split("\n\n")[1]
    documented = {}
    for row in table.splitlines()[2:]:
        command, *cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]]
        statuses = {status for status, cell in enumerate(cells[:3]) if cell}
        statuses |= {int(n) for n in re.findall(r"\b(\d{1,3})\b(?= for| when|:)", cells[3])}
        documented[command.strip("`").split("`")[0]] = statuses
    code = {
        "status": {exits.CHECK_OK, exits.CHECK_UNFIXED, tree.NOT_A_FOLDER, tree.NOTHING_FOUND},
        "selftest": {exits.SELFTEST_PASS, exits.SELFTEST_FAIL, exits.SELFTEST_CANNOT_RUN},
        "run": {exits.CANNOT_START},
        "audit": {0, exits.CANNOT_START, *(status for _, _, status in VERDICTS.values())},
        "parity": {exits.PARITY_MATCH, exits.PARITY_MISMATCH, exits.PARITY_CANNOT_COMPARE,
                   exits.CANNOT_START},
    }
    assert documented["any"] >= {exits.USAGE_ERROR, exits.BROKEN_PIPE, exits.INTERRUPTED,
                                 exits.TERMINATED, exits.HUNG_UP}
    for command, statuses in code.items():
        assert documented[command] >= statuses | {exits.USAGE_ERROR}, command


@pytest.fixture
def refused_023(fsdp_release, tmp_path: Path) -> Path:
    """megatron-fsdp 0.2.3 whose drain keeps 3 units live: refused for that, while the fixes
    of its model module (missed-post-backward, zero1-accumulate) rest on none of it and still
    apply, and its bucket reduction still scales the local shard."""
    root = tmp_path / "site"
    shutil.copytree(fsdp_release("0.2.3"), root)
    path = root / "megatron_fsdp" / "param_and_grad_buffer.py"
    text = path.read_text()
    old = "            if len(double_buf_units) > 2:\n                keep_n -= 1"
    assert text.count(old) == 1
    path.write_text(text.replace(old, old.replace("> 2", "> 3")))
    return root


def test_a_refused_copy_is_told_what_still_applies_what_is_left_and_each_workaround(
        refused_023: Path) -> None:
    code, data = status(Path(ARMED), refused_023)
    (copy,) = data["copies"]
    assert copy["refused"] and FixStates({k: v["state"] for k, v in copy["fixes"].items()}) == {
        "getter-guard": "refused", "ordered-drain": "refused",
        "missed-post-backward": "would apply", "zero1-accumulate": "would apply",
        "reduce-once": "not needed", "single-rank-reduce": "would apply",
        "core-linear-accumulate": "not needed", "expert-accumulate": "not needed",
        "inert-warm-up": "not needed", "root-forward-hooks": "would apply",
        "replicated-grad-stats": "not needed", "auto-sync-stop": "would apply"}
    line, details = data["verdict"]["line"], data["verdict"]["details"]
    assert code == 1 and line == (
        "affected: megatron-fsdp (not recognised) — NOT protected: left as shipped and more "
        "(below); use fsdp_double_buffer=False"), line
    assert details[0].startswith(
        "why: getter-guard, ordered-drain left as shipped (unrecognised code shape in "
        "_enforce_double_buffer_limit (fingerprint "), details
    assert ("; the hotfix still applies missed-post-backward, zero1-accumulate, "
            "single-rank-reduce, root-forward-hooks, auto-sync-stop; "
            "sharded-grads-summed-unscaled is not repaired by the hotfix (it hits ZeRO-2/3"
            ) in details[0]
    assert details[1:3] == ["instead: use fsdp_double_buffer=False", (
        "instead: for sharded-grads-summed-unscaled use calculate_per_token_loss=True (the "
        "release scales nothing; the loss carries the normalisation)")], details
    proc = run_python("", ARMED, refused_023, args=("-m", "mfsdp_hotfix", "status"))
    lines = proc.stdout.splitlines()
    assert lines[0] == line and lines[1:len(details) + 1] == [f"  {d}" for d in details]
    assert lines[len(details) + 1] == (
        "- megatron-fsdp 0.2.3 (not recognised): REFUSED: getter-guard, ordered-drain left as "
        "shipped; missed-post-backward, zero1-accumulate, single-rank-reduce, root-forward-hooks, "
        "auto-sync-stop would apply; "
        "sharded-grads-summed-unscaled NOT repaired; use fsdp_double_buffer=False; for "
        "sharded-grads-summed-unscaled use calculate_per_token_loss=True (the release scales "
        "nothing; the loss carries the normalisation); --verbose: why; at "
        f"{refused_023 / 'megatron_fsdp'}"), proc.stdout


@pytest.mark.parametrize("path", [False, True])
def test_json_starts_with_the_verdict(fsdp_release, path: bool) -> None:
    """``status --json | head`` shows the answer: the verdict is the first key, the rest sorted."""
    folder = fsdp_release("0.5.1")
    args = ("--path", str(folder)) if path else ()
    proc = run_python("", folder, args=("-c", NO_TORCH, "status", "--json", *args))
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert next(iter(data)) == "verdict" and proc.stdout.splitlines()[1] == '  "verdict": {'
    rest = list(data)[1:]
    assert rest == sorted(rest) and "verdict" not in rest


@pytest.mark.parametrize(("armed", "code"), [(True, 0), (False, 1)])
def test_a_reader_that_goes_away_leaves_the_check_status(fsdp_release, armed: bool,
                                                         code: int) -> None:
    """``status --check --verbose | head -1``: the reader closes the pipe before the output is
    written; the command stays quiet and exits as --check decided, never 141."""
    path = [str(ARMED)] if armed else []
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSDP_HOTFIX")}
    env["PYTHONPATH"] = os.pathsep.join([*path, str(fsdp_release("0.5.1")),
                                         str(Path(__file__).resolve().parent.parent)])
    for extra in (("--verbose",), ("--json",)):
        proc = subprocess.Popen([sys.executable, "-m", "mfsdp_hotfix", "status", "--check",
                                 *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env)
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # no reader: every write gets EPIPE
        stderr = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == code and stderr == "", stderr


SIZE_ONE_WHEN = (
    "      when: ZeRO-2/3 (optim_grads, optim_grads_params) where a gradient buffer's "
    "data-parallel group has one rank: every run with data-parallel size 1 (one GPU, or all of "
    "them given to tensor/pipeline/context parallelism), and the expert gradients of MoE runs "
    "whose expert-parallel size equals their data-parallel size;")


@pytest.mark.parametrize(("armed", "env", "state", "unfixed"), [
    (True, {}, "repaired (single-rank-reduce: would apply)", None),
    (False, {"MFSDP_HOTFIX": "0"}, "NOT repaired (single-rank-reduce: off)",
     "single-rank-reduce off (MFSDP_HOTFIX=0)"),
    (True, {"MFSDP_HOTFIX_DISABLED_FIXES": "single-rank-reduce"},
     "NOT repaired (single-rank-reduce: disabled)",
     "single-rank-reduce disabled (listed in MFSDP_HOTFIX_DISABLED_FIXES)")],
    ids=["armed", "off", "disabled"])
def test_status_tells_a_one_rank_user_whether_the_size_one_defect_is_repaired(
        fsdp_release, armed: bool, env: dict[str, str], state: str, unfixed: str | None
) -> None:
    """An installed 0.6.1: --verbose names the defect, the configurations it strikes (data-
    parallel size 1; experts with expert-parallel size equal to the data-parallel size) and
    whether it is repaired; --check fails exactly where it is not, as the first line says."""
    path = [ARMED] if armed else []
    proc = run_python("", *path, fsdp_release("0.6.1"), env=env,
                      args=("-m", "mfsdp_hotfix", "status", "--verbose", "--check"))
    lines = proc.stdout.splitlines()
    assert proc.returncode == (0 if unfixed is None else 1), proc.stdout + proc.stderr
    assert f"    release defect single-rank-grads-reduced-every-microbatch: {state}" in lines
    assert any(line.startswith(SIZE_ONE_WHEN) for line in lines), proc.stdout
    if unfixed is None:
        assert lines[0].endswith(" — protected: the hotfix is armed") and lines[1] == (
            "  applies ordered-drain, zero1-accumulate, reduce-once, single-rank-reduce, "
            "inert-warm-up, auto-sync-stop"), lines
        return
    assert " — NOT protected: " in lines[0] and (
        "  instead: for single-rank-grads-reduced-every-microbatch use one microbatch per step, "
        "on megatron-fsdp 0.4.0 and later / megatron-core 0.17 and later") in lines, lines
    left = lines[lines.index("Left unfixed:") + 1:]
    assert any(line.endswith(f": {unfixed}") for line in left), left
