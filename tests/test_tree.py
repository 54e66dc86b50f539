"""``mfsdp-hotfix status --path DIR``: real releases unpacked, a Megatron-LM checkout laid out from
a release and from the clone, the same verdict as importing the release, and bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import releases
from conftest import FixStates, run_python

from mfsdp_hotfix import cli, registry, tree
from mfsdp_hotfix.commands import exits

VENDORED = "megatron/core/distributed/fsdp/src/megatron_fsdp"


def states(copy: dict[str, Any]) -> dict[str, str]:
    return FixStates({fix: state["state"] for fix, state in copy["fixes"].items()})


def test_an_unpacked_megatron_core_release() -> None:
    data = tree.judge(str(releases.unpacked("megatron-core", "0.19.2")))
    (copy,) = data["copies"]
    assert copy["copy"] == "megatron-core (vendored)" and copy["version"] == "0.19.2"
    assert copy["verified_release"] and copy["era"] == "C" and not copy["imported"]
    assert states(copy) == {"getter-guard": "not needed", "ordered-drain": "would apply",
                            "missed-post-backward": "not needed",
                            "zero1-accumulate": "would apply",
                            "reduce-once": "would apply",
        "single-rank-reduce": "would apply", "core-linear-accumulate": "would apply",
        "expert-accumulate": "would apply", "inert-warm-up": "would apply",
        "root-forward-hooks": "not needed", "replicated-grad-stats": "not needed",
        "auto-sync-stop": "would apply"}
    assert copy["package_info"] == {f"{VENDORED}/package_info.py": "0.6.1",
                                    "megatron/core/package_info.py": "0.19.2"}
    (v2,) = data["v2_copies"]
    assert v2["package"] == f"{registry.COPIES[1].package}.experimental"
    assert v2["hotfix"] == "nothing" and "no get_main_grad" in v2["reason"]


def test_an_unpacked_standalone_release_that_crashes_as_shipped() -> None:
    (copy,) = tree.judge(str(releases.unpacked("megatron-fsdp", "0.4.0")))["copies"]
    assert (copy["copy"], copy["version"], copy["era"]) == ("megatron-fsdp", "0.4.0", "A")
    assert states(copy)["getter-guard"] == "would apply"


def checkout_from_release(tmp_path: Path, version: str) -> Path:
    """A Megatron-LM checkout as git lays it out: the ``megatron`` tree at the top, no dist-info."""
    checkout = tmp_path / "Megatron-LM"
    shutil.copytree(releases.unpacked("megatron-core", version) / "megatron",
                    checkout / "megatron")
    (checkout / ".git").mkdir()
    (checkout / "pyproject.toml").write_text("[project]\nname = 'megatron-core'\n")
    return checkout


def test_a_checkout_is_judged_by_code_shape_not_by_this_environments_label(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkout = checkout_from_release(tmp_path, "0.18.2")
    # This environment has a megatron-core 0.19.2 installed: the checkout must not borrow it.
    site = tmp_path / "site"
    shutil.copytree(releases.unpacked("megatron-core", "0.19.2") / "megatron_core-0.19.2.dist-info",
                    site / "megatron_core-0.19.2.dist-info")
    monkeypatch.syspath_prepend(str(site))
    (copy,) = tree.judge(str(checkout))["copies"]
    assert copy["path"] == str(checkout.resolve() / VENDORED)
    assert copy["version"] is None and copy["label_kind"] == "none"
    assert copy["era"] == "B" and not copy["verified_release"]
    assert copy["notes"] == ["no megatron-core version metadata: judged by code shape alone"]
    assert copy["package_info"]["megatron/core/package_info.py"] == "0.18.2"
    # megatron/core/distributed/param_and_grad_buffer.py (DDP's own buffer) is not a copy
    assert (checkout / "megatron/core/distributed/param_and_grad_buffer.py").is_file()


def test_the_clone_as_checked_out(tmp_path: Path) -> None:
    if releases.MEGATRON_LM_GIT is None or releases.git_tree("main") is None:
        pytest.skip(f"no clone of NVIDIA/Megatron-LM with refs/heads/main at "
                    f"{releases.MEGATRON_LM_GIT} (set MFSDP_TEST_MEGATRON_LM)")
    archive = subprocess.run(["git", "--git-dir", str(releases.MEGATRON_LM_GIT), "archive",
                              "refs/heads/main", "megatron/core/distributed/fsdp",
                              "megatron/core/package_info.py"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive.stdout, check=True)
    data = tree.judge(str(tmp_path))
    (copy,) = data["copies"]
    assert copy["copy"] == "megatron-core (vendored)" and copy["era"] == "C"
    assert copy["version"] is None and states(copy)["ordered-drain"] == "would apply"
    assert copy["package_info"][f"{VENDORED}/package_info.py"] == "0.7.0rc0"
    assert [v2["package"] for v2 in data["v2_copies"]] == [
        f"{registry.COPIES[1].package}.experimental"]
    # the standalone layout of the same commit gets the same verdict on Megatron-FSDP's own
    # functions (megatron-core's optimizer, a gate outside it, is not in that layout)
    (standalone,) = tree.judge(str(releases.git_tree("main")))["copies"]
    assert (standalone["copy"], standalone["era"]) == ("megatron-fsdp", "C")
    assert set(copy["shapes"]) - set(standalone["shapes"]) == {"get_megatron_optimizer"}
    assert standalone["shapes"] == {name: copy["shapes"][name] for name in standalone["shapes"]}


def test_megatron_core_0_13_custom_fsdp_is_refused_as_on_import(tmp_path: Path) -> None:
    package = tmp_path / "megatron/core/distributed/custom_fsdp"
    package.mkdir(parents=True)
    (package / "param_and_grad_buffer.py").write_text("class ParamAndGradBuffer: ...\n")
    (copy,) = tree.judge(str(tmp_path))["copies"]
    label, why = registry.REFUSED_MODULES[
        "megatron.core.distributed.custom_fsdp.param_and_grad_buffer"]
    assert (copy["copy"], copy["refused"], copy["reason"]) == (label, True, why)


STATUS_OF_IMPORTED = """
import json
import mfsdp_hotfix
import megatron_fsdp.megatron_fsdp
print("STATUS" + json.dumps(mfsdp_hotfix.status()["copies"]))
"""


@pytest.mark.parametrize("version", ["0.4.0"])
def test_the_same_verdict_as_importing_the_release(fsdp_release: Any, version: str) -> None:
    folder = fsdp_release(version)
    out = run_python(STATUS_OF_IMPORTED, folder)
    (imported,) = json.loads(out.stdout.split("STATUS", 1)[1])
    (read,) = tree.judge(str(folder))["copies"]
    assert imported["imported"] and not read["imported"]
    verdict = ("copy", "path", "version", "label_kind", "verified_release", "era", "refused",
               "reason", "notes", "shapes", "functions", "fingerprints", "limits")
    assert {k: read[k] for k in verdict} == {k: imported[k] for k in verdict}
    applied = {fix: "would apply" if state == "applied" else state
               for fix, state in states(imported).items()}
    assert states(read) == applied


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["status", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_text_json_and_check(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    release = str(releases.unpacked("megatron-fsdp", "0.5.1"))
    code, out, _ = run_cli(capsys, "--path", release)
    assert code == 0 and out.startswith("affected: megatron-fsdp 0.5.1 (era B) — repaired where "
                                        "the hotfix is loaded\n  applies getter-guard")
    assert "\n- megatron-fsdp 0.5.1 (era B): getter-guard, ordered-drain" in out
    code, out, _ = run_cli(capsys, "--path", release, "--verbose")
    assert code == 0 and "- megatron-fsdp 0.5.1: era B" in out
    assert "megatron_fsdp/package_info.py states 0.5.1 (not used as the label)" in out
    code, out, _ = run_cli(capsys, "--path", str(releases.unpacked("megatron-fsdp", "0.6.1")),
                           "--verbose")
    assert code == 0 and "- megatron-fsdp v2 (experimental) 0.6.1: the hotfix does nothing " \
        "here: Megatron-FSDP v2 has no get_main_grad" in out
    code, out, _ = run_cli(capsys, "--path", release, "--json", "--check")
    data = json.loads(out)
    assert code == 0 and data["unfixed"] == [] and data["copies"][0]["era"] == "B"
    refused = tmp_path / "megatron/core/distributed/custom_fsdp"
    refused.mkdir(parents=True)
    (refused / "param_and_grad_buffer.py").write_text("")
    code, out, _ = run_cli(capsys, "--path", str(tmp_path), "--check")
    assert code == exits.CHECK_UNFIXED and out.startswith(
        "affected: megatron-core 0.13 custom_fsdp (not recognised) — NOT "
        "protected (why: below); use fsdp_double_buffer=False\n  why: getter-guard, ordered-drain "
        "left as shipped (its main_grad getter is a class-level property"), out
    code, out, _ = run_cli(capsys, "--path", str(tmp_path), "--check", "--verbose")
    assert code == exits.CHECK_UNFIXED and "Left unfixed:" in out


@pytest.mark.parametrize("make, status, words", [
    (lambda tmp: tmp / "missing", tree.NOT_A_FOLDER, "no such folder"),
    (lambda tmp: tmp / "file.whl", tree.NOT_A_FOLDER, "is a file, not a folder"),
    (lambda tmp: tmp, tree.NOTHING_FOUND, "no Megatron-FSDP copy found"),
])
def test_bad_input_gets_a_message_and_its_exit_status(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, make: Any, status: int,
        words: str) -> None:
    (tmp_path / "file.whl").write_text("")
    folder = str(make(tmp_path))
    code, out, err = run_cli(capsys, "--path", folder)
    assert code == status and out == "" and words in err and folder in err
    code, out, _ = run_cli(capsys, "--path", folder, "--json")
    assert code == status and words in json.loads(out)["error"]


def test_a_release_with_a_defect_no_fix_repairs_fails_the_check(
        capsys: pytest.CaptureFixture[str]) -> None:
    """megatron-fsdp 0.2.3 read from disk: repaired where the hotfix is loaded, but for its
    sharded-gradient scaling, which no fix repairs: NOT protected, and --check exits 1."""
    release = str(releases.unpacked("megatron-fsdp", "0.2.3"))
    code, out, _ = run_cli(capsys, "--path", release, "--check", "--verbose")
    assert code == exits.CHECK_UNFIXED and out.startswith(
        "affected: megatron-fsdp 0.2.3 (era A) — NOT protected: 1 defect not repaired; use "
        "calculate_per_token_loss=True\n  why: sharded-grads-summed-unscaled is not repaired by "
        "the hotfix (it hits ZeRO-2/3"), out
    assert ("    release defect sharded-grads-summed-unscaled: NOT repaired (no fix repairs it; "
            "_bucket_group_gradient_reduce: the code of megatron-core 0.14)") in out
    assert ("    _bucket_group_gradient_reduce: the code of megatron-core 0.14, recognised by "
            "fingerprint (has sharded-grads-summed-unscaled, which no fix repairs)") in out
    code, out, _ = run_cli(capsys, "--path", release, "--json", "--check")
    assert code == exits.CHECK_UNFIXED and json.loads(out)["verdict"]["protected"] is False
