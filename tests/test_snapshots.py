"""Copies that are not PyPI releases (the ROCm fork before and after PR #146, git snapshots of
NVIDIA main labelled as pre-releases or local builds, NVIDIA PR #6316's N-slot pools): each
rebuilt copy first reproduces the
fingerprints recorded from its real code, then gets the era of its code and the fixes its shapes
need, and says why. Offline, no torch (see ``snapshots.py`` for how the copies are rebuilt)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import releases
import snapshots
from conftest import FixStates, run_python

from mfsdp_hotfix import detection, fingerprints, fix_catalogue, registry
from mfsdp_hotfix.structure import double_buffer

VENDORED = registry.COPIES[1]


def _built(name: str, tmp_path: Path) -> Path:
    return snapshots.build(snapshots.SNAPSHOTS[name], tmp_path / "site")


def _detect(root: Path, copy: registry.Copy = VENDORED) -> detection.Detection:
    found = detection.find_installed(copy, [str(root)])
    assert found is not None
    return detection.detect_file(copy, found)


@pytest.mark.parametrize("name", sorted(snapshots.SNAPSHOTS))
def test_rebuilt_copy_has_the_real_codes_fingerprints(name: str, tmp_path: Path) -> None:
    root = _built(name, tmp_path)
    snapshot = snapshots.SNAPSHOTS[name]
    tree = fingerprints.parse_file(root / snapshot.package / "param_and_grad_buffer.py")
    rebuilt = tuple(fingerprints.fp_code(tree.source(f)) for f in registry.FUNCTIONS)
    assert rebuilt == snapshot.fingerprints


@pytest.mark.parametrize("name", sorted(snapshots.SNAPSHOTS))
def test_each_snapshot_gets_the_era_of_its_code(name: str, tmp_path: Path) -> None:
    snapshot = snapshots.SNAPSHOTS[name]
    found = _detect(_built(name, tmp_path), snapshot.copy)
    assert not found.refused, found.reason
    assert found.era is not None and found.era.name == snapshot.era
    needed = tuple(fix.id for fix in fix_catalogue.DOUBLE_BUFFER_FIXES if found.needs(fix))
    assert needed == snapshot.fixes
    assert found.version == snapshot.label and not found.verified_release
    assert found.reason == f"era {snapshot.era} by code shape"
    kind = found.label_kind
    assert kind == ("none" if snapshot.label is None else
                    "local" if "+" in snapshot.label else "pre-release")
    expected = (f"{snapshot.distribution} {snapshot.label} is a {kind} label, not a release"
                if snapshot.label else f"no {snapshot.distribution} version metadata")
    assert found.notes == (f"{expected}: judged by code shape alone",)


def test_rocm_146_getter_is_recognised_by_its_structure(tmp_path: Path) -> None:
    found = _detect(_built("rocm-146", tmp_path))
    assert {f: found.matched_by[f] for f in registry.FUNCTIONS} == {
        registry.GETTER: "structure", registry.DRAIN: "fingerprint", registry.WAIT: "fingerprint"}
    getter, drain, wait = (found.shapes[f] for f in registry.FUNCTIONS)
    assert getter is not None and getter.guarded and getter.fingerprint is None
    assert drain is not None and (drain.name, drain.drain_stream) == ("0.19", "rs_stream")
    assert wait is not None and wait.name == "0.14"


def test_rocm_146_labelled_as_a_release_is_a_fork_fixed_by_its_shapes(tmp_path: Path) -> None:
    root = _built("rocm-146", tmp_path)
    snapshots.write_label(root, "megatron-core", "0.16.1")
    found = _detect(root)
    assert found.era is not None and found.era.name == "C" and not found.verified_release
    assert "code that release did not ship: a backport or a fork" in found.reason
    assert found.notes == (
        "megatron-core 0.16.1 shipped main_grad_getter as in 0.14, this copy's as in drains "
        "before fetching, _enforce_double_buffer_limit as in 0.14, this copy's as in 0.19: the "
        "code is not what that release shipped, so the fixes follow the code's own shapes",)


def _edit(root: Path, qualname: str, old: str, new: str, *, count: int = 1,
          package: Path = snapshots.VENDORED) -> str:
    """Replace ``old`` (found ``count`` times) in one function; its new source."""
    path = root / package / "param_and_grad_buffer.py"
    text = path.read_text()
    source = fingerprints.ParsedFile(text).source(qualname)
    assert source.count(old) == count
    path.write_text(text.replace(source, source.replace(old, new), 1))
    return source.replace(old, new)


_DRAIN_CALL = "self.grad_reduce_pipeline._enforce_double_buffer_limit([gbuf.bucket_id])"
_GETTER_INDENT = "\n" + " " * 20


@pytest.mark.parametrize("qualname, old, new", [
    (registry.DRAIN, "if len(double_buf_units) > 2:", "if len(double_buf_units) > 3:"),
    (registry.WAIT, "grad_reduce_event.wait()\n                free_up_grad_bucket()\n\n",
     "free_up_grad_bucket()\n                grad_reduce_event.wait()\n\n"),
    (registry.GETTER, _DRAIN_CALL + _GETTER_INDENT + "bucket = gbuf.fetch_bucket()",
     "bucket = gbuf.fetch_bucket()" + _GETTER_INDENT + _DRAIN_CALL),
], ids=["changed-drain", "changed-wait", "fetch-before-drain"])
def test_an_unknown_shape_in_a_function_the_fixes_rely_on_is_refused(
        tmp_path: Path, qualname: str, old: str, new: str) -> None:
    root = _built("rocm-146", tmp_path)
    _edit(root, qualname, old, new)
    found = _detect(root)
    assert found.refused and found.shapes[qualname] is None
    name = registry.short_name(qualname)
    assert found.reason.startswith(f"unrecognised code shape in {name} (fingerprint ")
    assert [n for n in registry.FUNCTIONS if found.shapes[n] is None] == [qualname]


def _status(root: Path, *args: str) -> str:
    code = ("import sys; sys.modules['torch'] = None; from mfsdp_hotfix.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    proc = run_python("", root, args=("-c", code, "status", *args))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_status_says_which_function_matched_which_shape_and_how(tmp_path: Path) -> None:
    root = _built("rocm-146", tmp_path)
    (copy,) = json.loads(_status(root, "--json"))["copies"]
    assert (copy["era"], copy["label_kind"], copy["verified_release"]) == ("C", "none", False)
    assert copy["functions"][registry.GETTER] == {
        "shape": "drains before fetching", "matched_by": "structure", "as_shipped_in": None,
        "implies": "guarded"}
    assert copy["functions"][registry.DRAIN] == {
        "shape": "0.19", "matched_by": "fingerprint",
        "as_shipped_in": "megatron-core 0.19.0-0.19.2, megatron-fsdp 0.6.0-0.6.1",
        "implies": "waits on rs_stream, keeps 2 units live"}
    assert FixStates({fix: state["state"] for fix, state in copy["fixes"].items()}) == {
        "getter-guard": "not needed", "ordered-drain": "would apply",
        "missed-post-backward": "would apply",
        "zero1-accumulate": "would apply",
        "reduce-once": "would apply",
        "single-rank-reduce": "would apply", "core-linear-accumulate": "not needed",
        "expert-accumulate": "not needed", "inert-warm-up": "not needed",
        "root-forward-hooks": "would apply", "replicated-grad-stats": "unverified",
        "auto-sync-stop": "would apply"}
    text = _status(root, "--verbose")
    assert ("main_grad_getter: drains before fetching, recognised by structure (guarded)"
            in text)
    assert ("_enforce_double_buffer_limit: as shipped in megatron-core 0.19.0-0.19.2 (and "
            "megatron-fsdp 0.6.0-0.6.1; waits on rs_stream, keeps 2 units live)" in text)
    assert "note: no megatron-core version metadata: judged by code shape alone" in text


def test_status_of_a_git_snapshot_says_it_is_judged_by_its_code(tmp_path: Path) -> None:
    root = _built("main-d199bb9e", tmp_path)
    (copy,) = json.loads(_status(root, "--json"))["copies"]
    assert (copy["version"], copy["label_kind"], copy["era"]) == ("0.19.0+d199bb9", "local", "B")
    assert copy["reason"] == "era B by code shape"
    assert FixStates({fix: state["state"] for fix, state in copy["fixes"].items()}) == {
        "getter-guard": "would apply", "ordered-drain": "would apply",
        "missed-post-backward": "would apply",
        "zero1-accumulate": "would apply",
        "reduce-once": "would apply",
        "single-rank-reduce": "would apply", "core-linear-accumulate": "not needed",
        "expert-accumulate": "not needed", "inert-warm-up": "would apply",
        "root-forward-hooks": "would apply", "replicated-grad-stats": "unverified",
        "auto-sync-stop": "would apply"}


def test_pr6316_drain_is_recognised_by_its_structure_with_the_pool_size_from_the_config(
        tmp_path: Path) -> None:
    snapshot = snapshots.SNAPSHOTS["pr6316"]
    found = _detect(_built("pr6316", tmp_path), snapshot.copy)
    assert {f: found.matched_by[f] for f in registry.FUNCTIONS} == {
        registry.GETTER: "fingerprint", registry.DRAIN: "structure",
        registry.WAIT: "fingerprint"}
    drain = found.shapes[registry.DRAIN]
    assert drain is not None and drain.fingerprint is None
    assert (drain.drain_stream, drain.live_units) == ("rs_stream", registry.POOL_SIZE)
    assert found.pool_size == "self.ddp_config.fsdp_buffer_count"


def test_status_of_pr6316_shows_the_pool_size_and_the_fix(tmp_path: Path) -> None:
    root = _built("pr6316", tmp_path)
    (copy,) = json.loads(_status(root, "--json"))["copies"]
    assert (copy["copy"], copy["era"], copy["pool_size"]) == (
        "megatron-fsdp", "C", "self.ddp_config.fsdp_buffer_count")
    assert copy["functions"][registry.DRAIN] == {
        "shape": "pool size from the config", "matched_by": "structure", "as_shipped_in": None,
        "implies": "waits on rs_stream, keeps N units live, N the configured pool size"}
    assert FixStates({fix: state["state"] for fix, state in copy["fixes"].items()}) == {
        "getter-guard": "not needed", "ordered-drain": "would apply",
        "missed-post-backward": "not needed",
        "zero1-accumulate": "would apply",
        "reduce-once": "would apply",
        "single-rank-reduce": "would apply", "core-linear-accumulate": "not needed",
        "expert-accumulate": "not needed", "inert-warm-up": "would apply",
        "root-forward-hooks": "not needed", "replicated-grad-stats": "not needed",
        "auto-sync-stop": "would apply"}
    assert ("gradient pool slots (N): from the config (self.ddp_config.fsdp_buffer_count), "
            "read when the model is built") in _status(root, "--verbose")


def test_status_of_a_release_shows_its_fixed_pool_size(tmp_path: Path) -> None:
    (copy,) = json.loads(_status(_built("main-d98e8a64", tmp_path), "--json"))["copies"]
    assert (copy["pool_size"], copy["pool_size_text"]) == (2, "2")


_COUNT = "buffer_count = self.buffer.ddp_config.fsdp_buffer_count"


@pytest.mark.parametrize("old, new, count, path", [
    (_COUNT, _COUNT, 1, "self.buffer.ddp_config.fsdp_buffer_count"),
    (_COUNT, "buffer_count = self.ddp_config.fsdp_buffer_count", 1,
     "self.ddp_config.fsdp_buffer_count"),
    (_COUNT, "buffer_count = self.buffer.ddp_config.megatron_fsdp_max_pool_buffer_count", 1,
     "self.buffer.ddp_config.megatron_fsdp_max_pool_buffer_count"),
    (_COUNT, "buffer_count = self.buffer.config.pool_slots", 1, "self.buffer.config.pool_slots"),
    (" buffer_count", " slots", 3, "self.buffer.ddp_config.fsdp_buffer_count"),
], ids=["as-in-the-pr", "config-on-the-pipeline", "maxpool-option", "other-names",
        "other-local-name"])
def test_a_drain_sized_by_the_config_is_recognised_whatever_the_attribute_path(
        tmp_path: Path, old: str, new: str, count: int, path: str) -> None:
    snapshot = snapshots.SNAPSHOTS["pr6316"]
    root = _built("pr6316", tmp_path)
    source = _edit(root, registry.DRAIN, old, new, count=count, package=snapshot.package)
    assert double_buffer.configured_pool_size(source) == path
    found = _detect(root, snapshot.copy)
    assert not found.refused and found.era is not None and found.era.name == "C"
    drain = found.shapes[registry.DRAIN]
    assert drain is not None and drain.live_units == registry.POOL_SIZE
    assert [fix.id for fix in fix_catalogue.DOUBLE_BUFFER_FIXES
            if found.needs(fix)] == ["ordered-drain"]


_ON_RS_STREAM = ("with torch.cuda.stream(self.rs_stream):\n            "
                 "self.wait_for_previous_grad_reduce")


def test_the_drain_on_the_callers_stream_is_the_change_proposed_upstream(
        tmp_path: Path) -> None:
    """#6316's drain with its wait on the caller's stream (upstream/pr6316.patch's shape): era
    "none", no double-buffer fix needed."""
    snapshot = snapshots.SNAPSHOTS["pr6316"]
    root = _built("pr6316", tmp_path)
    source = _edit(root, registry.DRAIN, _ON_RS_STREAM, "self.wait_for_previous_grad_reduce",
                   package=snapshot.package)
    assert double_buffer.configured_pool_size(source) is None
    assert (double_buffer.configured_pool_size(source, on_rs_stream=False)
            == "self.buffer.ddp_config.fsdp_buffer_count")
    found = _detect(root, snapshot.copy)
    drain = found.shapes[registry.DRAIN]
    assert found.era is not None and found.era.name == "none"
    assert drain is not None and (drain.drain_stream, drain.live_units) == (
        "caller", registry.POOL_SIZE)
    assert not [fix.id for fix in fix_catalogue.DOUBLE_BUFFER_FIXES if found.needs(fix)]


@pytest.mark.parametrize("callers_stream", [False, True], ids=["rs-stream", "callers-stream"])
@pytest.mark.parametrize("old, new, count", [
    ("if len(double_buf_units) > buffer_count:", "if len(double_buf_units) > buffer_count - 1:",
     1),
    ("assert len(double_buf_units) <= buffer_count,", "assert len(double_buf_units) <= 3,", 1),
    (_COUNT, "buffer_count = self.buffer.fsdp_buffer_count", 1),
    ("self.wait_for_previous_grad_reduce(keep_n)", "self.wait_for_previous_grad_reduce(0)", 1),
    ("keep_n -= 1", "keep_n -= 2", 1),
    ("            double_buf_units.add(fsdp_unit_id)\n            if len(double_buf_units)",
     "            if len(double_buf_units)", 1),
    ("            double_buf_units.add(fsdp_unit_id)\n            if len(double_buf_units)",
     "            queued_units = {fsdp_unit_id}\n            if len(queued_units)", 1),
    ("for bucket_id in add_buckets:", "for bucket_id in []:", 1),
    ("keep_n = len(self.grad_reduce_queue)\n",
     "keep_n = len(self.grad_reduce_queue)\n        keep_n = min(keep_n, 1)\n", 1),
    ("            if len(double_buf_units) > buffer_count:",
     "            buffer_count = 1\n            if len(double_buf_units) > buffer_count:", 1),
], ids=["retires-one-more", "constant-assert", "not-from-a-config", "retires-all",
        "retires-two-at-once", "queued-units-not-counted", "counts-another-set",
        "assert-not-on-the-incoming-units", "keep-n-set-again", "pool-size-set-again"])
def test_another_drain_with_a_configured_pool_size_is_still_refused(
        tmp_path: Path, old: str, new: str, count: int, callers_stream: bool) -> None:
    snapshot = snapshots.SNAPSHOTS["pr6316"]
    root = _built("pr6316", tmp_path)
    if callers_stream:
        _edit(root, registry.DRAIN, _ON_RS_STREAM, "self.wait_for_previous_grad_reduce",
              package=snapshot.package)
    source = _edit(root, registry.DRAIN, old, new, count=count, package=snapshot.package)
    assert double_buffer.configured_pool_size(source, on_rs_stream=not callers_stream) is None
    found = _detect(root, snapshot.copy)
    assert found.refused and found.shapes[registry.DRAIN] is None
    assert found.reason.startswith("unrecognised code shape in _enforce_double_buffer_limit")


@pytest.mark.parametrize("ref", sorted(snapshots.PULL_REQUESTS))
def test_n_slot_pull_requests_get_ordered_drain_with_their_pool_size(ref: str) -> None:
    """The real files of NVIDIA's N-slot pull requests (a local clone only; CI runs the rebuilt
    #6316, whose three functions have the same fingerprints as #6316, #6317, #6318, #6665)."""
    root = releases.git_tree(ref)
    if root is None:
        pytest.skip(f"no Megatron-LM clone with {ref} (set MFSDP_TEST_MEGATRON_LM)")
    fingerprints_, pool_size = snapshots.PULL_REQUESTS[ref]
    found = _detect(root, registry.COPIES[0])
    assert tuple(found.fingerprints[f] for f in registry.FUNCTIONS) == fingerprints_
    assert not found.refused and found.era is not None and found.era.name == "C"
    assert [fix.id for fix in fix_catalogue.DOUBLE_BUFFER_FIXES
            if found.needs(fix)] == ["ordered-drain"]
    assert found.pool_size == pool_size


def test_build_command_writes_an_importable_copy_with_its_label(tmp_path: Path) -> None:
    dest = tmp_path / "pr6316"
    script = str(Path(snapshots.__file__))
    proc = run_python("", args=(script, "build", "pr6316", str(dest), "--buffer-count", "3"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (dest / "megatron_fsdp-0.6.0rc0.dist-info" / "METADATA").is_file()
    config = (dest / "megatron_fsdp" / "distributed_data_parallel_config.py").read_text()
    assert "fsdp_buffer_count: int = 3\n" in config
    found = _detect(dest, registry.COPIES[0])
    assert found.era is not None and found.era.name == "C" and found.version == "0.6.0rc0"
    again = run_python("", args=(script, "build", "pr6316", str(dest)))
    assert again.returncode == 2 and "exists" in again.stderr
