"""Detection of every released Megatron-FSDP copy, offline from the real wheels, and refusal of
shapes the registry does not know."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import releases

from mfsdp_hotfix import detection, registry

STANDALONE, VENDORED = registry.COPIES

EXPECTED_FSDP = {"0.1.0": "A", "0.2.0": "A", "0.2.1": "A", "0.2.2": "A", "0.2.3": "A",
                 "0.3.0": "A", "0.3.1": "A", "0.4.0": "A", "0.5.0": "B", "0.5.1": "B",
                 "0.6.0": "C", "0.6.1": "C"}
EXPECTED_CORE = {"0.14.0": "A", "0.15.0": "A", "0.15.1": "A", "0.15.2": "A", "0.15.3": "A",
                 "0.16.0": "A", "0.16.1": "A", "0.17.0": "A", "0.17.1": "A", "0.18.0": "B",
                 "0.18.1": "B", "0.18.2": "B", "0.19.0": "C", "0.19.1": "C", "0.19.2": "C"}


def _detect(copy: registry.Copy, root: Path) -> detection.Detection:
    found = detection.find_installed(copy, [str(root)])
    assert found is not None, f"{copy.buffer_module} not in {root}"
    return detection.detect_file(copy, found)


@pytest.mark.parametrize("version", sorted(EXPECTED_FSDP))
def test_every_megatron_fsdp_release(version: str) -> None:
    found = _detect(STANDALONE, releases.unpacked("megatron-fsdp", version))
    assert found.version == version
    assert not found.refused, found.reason
    assert found.era is not None and found.era.name == EXPECTED_FSDP[version]
    assert found.reason.startswith(f"era {found.era.name}: verified release")


@pytest.mark.parametrize("version", sorted(EXPECTED_CORE))
def test_every_megatron_core_release(version: str) -> None:
    found = _detect(VENDORED, releases.unpacked("megatron-core", version))
    assert found.version == version
    assert found.era is not None and found.era.name == EXPECTED_CORE[version], found.reason


@pytest.mark.parametrize("version", ["0.13.0", "0.13.1"])
def test_megatron_core_013_has_no_vendored_copy_and_custom_fsdp_is_refused(version: str) -> None:
    root = releases.unpacked("megatron-core", version)
    assert detection.find_installed(VENDORED, [str(root)]) is None
    custom = next(iter(registry.REFUSED_MODULES))
    assert (root / Path(*custom.split("."))).with_suffix(".py").is_file()
    # Even read as if it were a Megatron-FSDP copy, its shape is not one the registry knows.
    fake_copy = registry.Copy("custom_fsdp", custom.rsplit(".", 1)[0], "megatron-core")
    assert _detect(fake_copy, root).refused


@pytest.fixture
def modified_copy(tmp_path: Path) -> Path:
    """megatron-fsdp 0.5.1 with its dist-info, copied so a test may edit the code."""
    root = tmp_path / "site"
    shutil.copytree(releases.unpacked("megatron-fsdp", "0.5.1"), root)
    return root


def _edit(root: Path, old: str, new: str) -> None:
    path = root / "megatron_fsdp" / "param_and_grad_buffer.py"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_comment_and_blank_line_edits_keep_the_shape(modified_copy: Path) -> None:
    _edit(modified_copy, "            if len(double_buf_units) > 1:",
          "\n            # a comment added by a fork\n            if len(double_buf_units) > 1:")
    found = _detect(STANDALONE, modified_copy)
    assert found.era is not None and found.era.name == "B"


def test_backported_fix_on_an_old_release_is_refused(modified_copy: Path) -> None:
    _edit(modified_copy, "            if len(double_buf_units) > 1:",
          "            if len(double_buf_units) > 2:")
    found = _detect(STANDALONE, modified_copy)
    assert found.refused
    assert "unrecognised code shape" in found.reason


def test_era_shape_on_the_wrong_release_is_refused(modified_copy: Path) -> None:
    dist_info = modified_copy / "megatron_fsdp-0.5.1.dist-info"
    metadata = dist_info / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 0.5.1", "Version: 0.6.1"))
    dist_info.rename(modified_copy / "megatron_fsdp-0.6.1.dist-info")
    found = _detect(STANDALONE, modified_copy)
    assert found.refused
    assert "shipped the era-C shape" in found.reason


def test_missing_function_is_refused(modified_copy: Path) -> None:
    _edit(modified_copy, "def _enforce_double_buffer_limit(", "def _renamed_limit(")
    found = _detect(STANDALONE, modified_copy)
    assert found.refused and "_enforce_double_buffer_limit" in found.reason


def test_missing_metadata_falls_back_to_shape(modified_copy: Path) -> None:
    shutil.rmtree(modified_copy / "megatron_fsdp-0.5.1.dist-info")
    found = detection.detect_file(STANDALONE, modified_copy / "megatron_fsdp" /
                                  "param_and_grad_buffer.py")
    if found.version is not None:
        pytest.skip(f"another megatron-fsdp {found.version} is installed in this environment")
    assert found.era is not None and found.era.name == "B"
    assert "recognised by code shape alone" in found.notes[0]


@pytest.mark.parametrize("version, era", [("0.5.0rc1", "B"), ("0.5.1+git1234", "B"),
                                          ("0.5.2", "B"), ("0.5.0.dev3", "B")])
def test_prerelease_and_local_versions(modified_copy: Path, version: str, era: str) -> None:
    metadata = modified_copy / "megatron_fsdp-0.5.1.dist-info" / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 0.5.1", f"Version: {version}"))
    found = _detect(STANDALONE, modified_copy)
    assert found.version == version
    assert found.era is not None and found.era.name == era


def test_unparseable_file_is_refused(tmp_path: Path) -> None:
    package = tmp_path / "megatron_fsdp"
    package.mkdir()
    (package / "param_and_grad_buffer.py").write_text("def broken(:\n")
    found = _detect(STANDALONE, tmp_path)
    assert found.refused and "cannot read" in found.reason


HOOKS_SHAPE = {**{("megatron-fsdp", v): "0.14" for v in ("0.1.0", "0.2.0", "0.2.1", "0.2.2",
                                                           "0.2.3")},
               **{("megatron-core", v): "0.14" for v in ("0.14.0", "0.15.0", "0.15.1", "0.15.2",
                                                          "0.15.3")},
               ("megatron-fsdp", "0.3.1"): "0.16", ("megatron-core", "0.16.0"): "0.16",
               ("megatron-fsdp", "0.4.0"): "0.17", ("megatron-core", "0.17.1"): "0.17",
               ("megatron-fsdp", "0.5.1"): "0.18", ("megatron-core", "0.18.2"): "0.18",
               ("megatron-fsdp", "0.6.1"): "0.19", ("megatron-core", "0.19.2"): "0.19"}


@pytest.mark.parametrize(("dist", "version"), sorted(HOOKS_SHAPE))
def test_model_module_shape_read_beside_the_buffer(dist: str, version: str) -> None:
    """``_register_fsdp_hooks`` (the missed-post-backward gate) is read from megatron_fsdp.py."""
    copy = STANDALONE if dist == "megatron-fsdp" else VENDORED
    found = _detect(copy, releases.unpacked(dist, version))
    assert found.shapes[registry.HOOKS] == HOOKS_SHAPE[(dist, version)]


def test_unknown_model_module_shape_does_not_refuse_the_copy(tmp_path: Path) -> None:
    root = tmp_path / "site"
    shutil.copytree(releases.unpacked("megatron-fsdp", "0.2.3"), root)
    (root / "megatron_fsdp" / "megatron_fsdp.py").write_text("class MegatronFSDP:\n    pass\n")
    found = _detect(STANDALONE, root)
    assert not found.refused and found.shapes[registry.HOOKS] is None
