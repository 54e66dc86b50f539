"""Detection of every released Megatron-FSDP copy, offline from the real wheels, and refusal of
shapes the registry does not know."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import releases

from mfsdp_hotfix import (
    detection,
    eras,
    fix_catalogue,
    registry,
    release_defects,
    structure,
    verified_releases,
)
from mfsdp_hotfix.structure import double_buffer

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
    assert found.reason == f"era {found.era.name}: verified release megatron-fsdp {version}"
    assert found.verified_release and found.label_kind == "release" and found.notes == ()
    # the synchronous reductions are recognised by their loop's guard only (registry.py)
    synchronous = set(registry.SYNCHRONOUS_REDUCTIONS.values())
    assert {how for name, how in found.matched_by.items() if name not in synchronous} == {
        "fingerprint"}
    assert {found.matched_by[name] for name in synchronous} == {"structure"}


@pytest.mark.parametrize("version", sorted(EXPECTED_CORE))
def test_every_megatron_core_release(version: str) -> None:
    found = _detect(VENDORED, releases.unpacked("megatron-core", version))
    assert found.version == version
    assert found.era is not None and found.era.name == EXPECTED_CORE[version], found.reason
    assert found.verified_release, found.reason


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


def test_backport_with_known_shapes_is_fixed_by_its_shapes(modified_copy: Path) -> None:
    """0.18's drain with 0.19's threshold is, text for text, 0.19's drain: era A (unguarded
    getter, two units live), both fixes, and a note that 0.5.1 did not ship this code."""
    _edit(modified_copy, "            if len(double_buf_units) > 1:",
          "            if len(double_buf_units) > 2:")
    found = _detect(STANDALONE, modified_copy)
    assert found.era is not None and found.era.name == "A" and not found.verified_release
    assert [fix.id for fix in fix_catalogue.DOUBLE_BUFFER_FIXES
            if found.needs(fix)] == ["getter-guard", "ordered-drain", "missed-post-backward"]
    assert "megatron-fsdp 0.5.1 with code that release did not ship" in found.reason
    assert found.notes == ("megatron-fsdp 0.5.1 shipped _enforce_double_buffer_limit as in 0.18, "
                           "this copy's as in 0.19: the code is not what that release shipped, "
                           "so the fixes follow the code's own shapes",)


def test_changed_drain_is_refused(modified_copy: Path) -> None:
    _edit(modified_copy, "            if len(double_buf_units) > 1:",
          "            if len(double_buf_units) > 3:")
    found = _detect(STANDALONE, modified_copy)
    assert found.refused
    assert found.reason.startswith("unrecognised code shape in _enforce_double_buffer_limit "
                                   "(fingerprint ")
    assert "main_grad_getter" not in found.reason


def test_release_label_on_other_known_code_is_a_fork(modified_copy: Path) -> None:
    dist_info = modified_copy / "megatron_fsdp-0.5.1.dist-info"
    metadata = dist_info / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 0.5.1", "Version: 0.6.1"))
    dist_info.rename(modified_copy / "megatron_fsdp-0.6.1.dist-info")
    found = _detect(STANDALONE, modified_copy)
    assert found.era is not None and found.era.name == "B" and not found.verified_release
    assert "backport or a fork" in found.reason
    assert "megatron-fsdp 0.6.1 shipped main_grad_getter as in 0.19, this copy's as in 0.17" \
        in found.notes[0]


def test_missing_function_is_refused(modified_copy: Path) -> None:
    _edit(modified_copy, "def _enforce_double_buffer_limit(", "def _renamed_limit(")
    found = _detect(STANDALONE, modified_copy)
    assert found.refused
    assert found.reason.startswith("unrecognised code shape in _enforce_double_buffer_limit "
                                   "(not found)")


def test_missing_metadata_falls_back_to_shape(modified_copy: Path) -> None:
    shutil.rmtree(modified_copy / "megatron_fsdp-0.5.1.dist-info")
    found = detection.detect_file(STANDALONE, modified_copy / "megatron_fsdp" /
                                  "param_and_grad_buffer.py")
    if found.version is not None:
        pytest.skip(f"another megatron-fsdp {found.version} is installed in this environment")
    assert found.era is not None and found.era.name == "B" and found.label_kind == "none"
    assert found.notes == ("no megatron-fsdp version metadata: judged by code shape alone",)


@pytest.mark.parametrize("version, kind", [("0.5.0rc1", "pre-release"), ("0.5.1+git1234", "local"),
                                           ("0.5.0.dev3", "dev"), ("0.5.1.post1", "post-release"),
                                           ("0.6.0rc0+d199bb9", "local")])
def test_prerelease_dev_and_local_labels_are_judged_by_code_alone(
        modified_copy: Path, version: str, kind: str) -> None:
    metadata = modified_copy / "megatron_fsdp-0.5.1.dist-info" / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 0.5.1", f"Version: {version}"))
    found = _detect(STANDALONE, modified_copy)
    assert found.version == version and found.label_kind == kind
    assert found.era is not None and found.era.name == "B" and not found.verified_release
    assert found.reason == "era B by code shape"
    assert found.notes == (f"megatron-fsdp {version} is a {kind} label, not a release: judged "
                           "by code shape alone",)


def test_unknown_final_release_is_judged_by_code_alone(modified_copy: Path) -> None:
    metadata = modified_copy / "megatron_fsdp-0.5.1.dist-info" / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 0.5.1", "Version: 0.5.2"))
    found = _detect(STANDALONE, modified_copy)
    assert found.era is not None and found.era.name == "B" and not found.verified_release
    assert found.notes == ("megatron-fsdp 0.5.2 is not among the releases this hotfix was "
                           "verified on: judged by code shape alone",)


def test_every_pair_of_known_getter_and_drain_shapes_has_an_era() -> None:
    for getter in registry.SHAPES[registry.GETTER]:
        for drain in registry.SHAPES[registry.DRAIN]:
            era = eras.era_of(getter, drain)
            expected = ("B" if drain.live_units == 1 else "A" if not getter.guarded else
                        "C" if drain.drain_stream == "rs_stream" else "none")
            assert era.name == expected, (getter, drain)


def test_releases_table_lists_every_release_the_tests_download() -> None:
    listed = {(d, v) for d, v in verified_releases.RELEASES}
    downloaded = ({("megatron-fsdp", v) for v in releases.MEGATRON_FSDP}
                  | {("megatron-core", v) for v in releases.MEGATRON_CORE
                     if not v.startswith("0.13")})
    assert listed == downloaded


def test_unparseable_file_is_refused(tmp_path: Path) -> None:
    package = tmp_path / "megatron_fsdp"
    package.mkdir()
    (package / "param_and_grad_buffer.py").write_text("def broken(:\n")
    found = _detect(STANDALONE, tmp_path)
    assert found.refused and "cannot read" in found.reason


@pytest.mark.parametrize("body, drains", [
    ("gbuf = p._gbuf\nself.grad_reduce_pipeline._enforce_double_buffer_limit([gbuf.bucket_id])\n"
     "bucket = gbuf.fetch_bucket()\nreturn bucket", True),
    ("p._megatron_fsdp_model.grad_reduce_pipeline._enforce_double_buffer_limit([1])\n"
     "return p._gbuf.fetch_bucket(dtype=None)", True),
    ("bucket = p._gbuf.fetch_bucket()\nself.pipe._enforce_double_buffer_limit([1])\n"
     "return bucket", False),
    ("if self.pipe is not None:\n    self.pipe._enforce_double_buffer_limit([1])\n"
     "return p._gbuf.fetch_bucket()", False),
    ("return p._gbuf.get(self.pipe._enforce_double_buffer_limit([1]), p._gbuf.fetch_bucket())",
     False),
    ("self.pipe._enforce_double_buffer_limit([1])\nreturn None", False),
    ("fetch = p._gbuf.fetch_bucket\nbucket = fetch()\nself.pipe._enforce_double_buffer_limit([1])"
     "\nreturn p._gbuf.fetch_bucket()", False),
], ids=["rocm-146", "upstream-0.19", "after-fetch", "conditional", "same-statement", "no-fetch",
        "fetched-through-a-name"])
def test_drains_before_fetching(body: str, drains: bool) -> None:
    source = "    def main_grad_getter(p):\n" + "".join(
        f"        {line}\n" for line in body.splitlines())
    assert double_buffer.drains_before_fetching(source) is drains
HOOKS_SHAPE = {**{("megatron-fsdp", v): "0.14" for v in ("0.1.0", "0.2.0", "0.2.1", "0.2.2",
                                                           "0.2.3")},
               **{("megatron-core", v): "0.14" for v in ("0.14.0", "0.15.0", "0.15.1", "0.15.2",
                                                          "0.15.3")},
               ("megatron-fsdp", "0.3.1"): "0.16", ("megatron-core", "0.16.0"): "0.16",
               ("megatron-fsdp", "0.4.0"): "0.17", ("megatron-core", "0.17.1"): "0.17",
               ("megatron-fsdp", "0.5.1"): "0.18", ("megatron-core", "0.18.2"): "0.18",
               ("megatron-fsdp", "0.6.1"): "0.19", ("megatron-core", "0.19.2"): "0.19"}


def test_every_structural_shape_names_a_recogniser() -> None:
    """The registry, and a fix for a gate only it reads, name each structural shape's test by
    name; each name is a recogniser, and each recogniser is named by a shape."""
    named = {shape.structure for shapes in fix_catalogue.SHAPES.values() for shape in shapes
             if shape.structure}
    assert named == set(structure.RECOGNISERS)


@pytest.mark.parametrize(("dist", "version"), sorted(HOOKS_SHAPE))
def test_model_module_shape_read_beside_the_buffer(dist: str, version: str) -> None:
    """``_register_fsdp_hooks`` (the missed-post-backward gate) is read from megatron_fsdp.py."""
    copy = STANDALONE if dist == "megatron-fsdp" else VENDORED
    found = _detect(copy, releases.unpacked(dist, version))
    shape = found.shapes[registry.HOOKS]
    assert shape is not None and shape.name == HOOKS_SHAPE[(dist, version)]


def test_unknown_model_module_shape_does_not_refuse_the_copy(tmp_path: Path) -> None:
    root = tmp_path / "site"
    shutil.copytree(releases.unpacked("megatron-fsdp", "0.2.3"), root)
    (root / "megatron_fsdp" / "megatron_fsdp.py").write_text("class MegatronFSDP:\n    pass\n")
    found = _detect(STANDALONE, root)
    assert not found.refused and found.shapes[registry.HOOKS] is None


def test_a_fork_of_the_lazy_release_design_needs_no_missed_post_backward(tmp_path: Path) -> None:
    """A 0.16-or-later ``_register_fsdp_hooks`` in other words (a fork) is recognised by its
    structure, not refused nor left unverified."""
    root = tmp_path / "site"
    shutil.copytree(releases.unpacked("megatron-fsdp", "0.3.1"), root)
    model = root / "megatron_fsdp" / "megatron_fsdp.py"
    model.write_text(model.read_text().replace(
        "def release_module_parameters(module, bwd, lazy=False, *unused):",
        "def release_module_parameters(module, bwd, lazy=False, *unused):  # fork\n"
        "            _ = 'a fork'", 1))
    found = _detect(STANDALONE, root)
    shape = found.shapes[registry.HOOKS]
    assert shape is not None and shape.name == ("releases stale units lazily, reduces unsharded "
                                                "gradients in the hooks always")
    assert not found.needs(fix_catalogue.MISSED_POST_BACKWARD)
    assert found.needs(fix_catalogue.REDUCE_ONCE)


def _in_range(version: str, span: str) -> bool:
    first, _, last = span.partition("-")
    key = [tuple(int(n) for n in v.split(".")) for v in (version, first, last or first)]
    return key[1] <= key[0] <= key[2]


RELEASED = ([("megatron-fsdp", v) for v in releases.MEGATRON_FSDP]
            + [("megatron-core", v) for v in releases.MEGATRON_CORE if not v.startswith("0.13")])


@pytest.mark.parametrize(("dist", "version"), RELEASED)
def test_every_release_defect_no_fix_repairs_is_found_where_it_shipped(dist: str,
                                                                      version: str) -> None:
    """Each defect no fix repairs is found by its carrier's code shape in exactly the releases
    it names (the carrier's fingerprints are every release's text, recomputed here)."""
    copy = STANDALONE if dist == "megatron-fsdp" else VENDORED
    found = _detect(copy, releases.unpacked(dist, version))
    for qualname in registry.DEFECT_CARRIERS:
        assert found.matched_by[qualname] == "fingerprint", (qualname, found.fingerprints)
    unrepaired = [d for d in release_defects.RELEASE_DEFECTS if d.fix is None]
    assert unrepaired, "the registry names a release defect no fix repairs"
    for defect in unrepaired:
        expected = _in_range(version, defect.releases[dist])
        assert release_defects.carried(defect, found.shapes) is expected, (defect.name,
                                                                             found.shapes)
        assert (defect in release_defects.defects_of({}, found.shapes)) is expected


def test_a_defect_carrier_is_named_after_its_defects() -> None:
    """A shape's ``carries`` names defects that no fix repairs and that this function carries."""
    for qualname in registry.DEFECT_CARRIERS:
        for shape in registry.SHAPES[qualname]:
            for name in shape.carries:
                (defect,) = [d for d in release_defects.RELEASE_DEFECTS if d.name == name]
                assert defect.fix is None and defect.carrier == qualname
    for defect in release_defects.RELEASE_DEFECTS:
        assert (defect.fix is None) == (defect.carrier is not None), defect.name


def test_nvidia_main_scales_the_bucket_it_reduces() -> None:
    tree = releases.git_tree("main")
    if tree is None:
        pytest.skip("no NVIDIA/Megatron-LM clone ($MFSDP_TEST_MEGATRON_LM)")
    found = _detect(STANDALONE, tree)
    shape = found.shapes[registry.BUCKET_REDUCE]
    assert shape is not None and not shape.carries
    assert "sharded-grads-summed-unscaled" not in [
        d.name for d in release_defects.defects_of({}, found.shapes)]


def test_an_unknown_bucket_reduction_does_not_rule_the_defect_out(tmp_path: Path) -> None:
    """A fork's ``_bucket_group_gradient_reduce``: the copy is not refused for it, but the
    defect no fix repairs is not ruled out either."""
    root = tmp_path / "site"
    shutil.copytree(releases.unpacked("megatron-fsdp", "0.4.0"), root)
    _edit(root, "        reduce_scatter_stream.wait_stream(current_stream)\n",
          "        reduce_scatter_stream.wait_stream(current_stream)\n        _ = 'a fork'\n")
    found = _detect(STANDALONE, root)
    assert not found.refused and found.shapes[registry.BUCKET_REDUCE] is None
    assert release_defects.carried(release_defects.SHARDED_GRADS_SUMMED_UNSCALED,
                                   found.shapes) is None
    assert release_defects.SHARDED_GRADS_SUMMED_UNSCALED in release_defects.defects_of(
        {}, found.shapes)
