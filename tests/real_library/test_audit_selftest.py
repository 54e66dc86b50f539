"""The audit on real releases, through the selftest harness (CPU stand-in, two gloo ranks):
its counts equal the stand-in's own, it finds the unordered reuses of shipped era-B/C code and
none with the hotfix, records era A's crash, survives a path it cannot write, and
``mfsdp-hotfix audit`` summarises a torchrun job."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import configurations
import pytest
from conftest import REPO, launch_ranks, run_python, verdict_line
from realcases import describe, release_path, run_cached

from mfsdp_hotfix.selftest import run_selftest
from mfsdp_hotfix.selftest.selftest import audit_agrees
from mfsdp_hotfix.selftest.spec import CaseSpec

pytestmark = pytest.mark.slow


def test_selftest_audit_agrees_with_the_stand_in_on_0_5_1() -> None:
    runs = dict(run_selftest(path=release_path("megatron-fsdp", "0.5.1"), flavour="standalone",
                             progress=False, runner=run_cached, audit=True, out=io.StringIO()))
    without, with_ = runs["without hotfix"], runs["with hotfix"]
    for result in (without, with_):
        assert audit_agrees(result), describe(result)
        assert result.audit_files == 2 and result.audit_reuses, describe(result)
    assert without.audit_unordered and with_.audit_unordered == 0, describe(without)
    written = with_.audit_report or {}
    (copy,) = written["copies"]
    assert {k: copy[k] for k in ("package", "version", "era", "fixes", "audited", "unordered",
                                 "first_unordered", "crashed")} == {
        "package": "megatron_fsdp", "version": "0.5.1", "era": "B",
        "fixes": ["auto-sync-stop", "getter-guard", "inert-warm-up", "missed-post-backward",
                  "ordered-drain", "reduce-once", "root-forward-hooks", "single-rank-reduce",
                  "zero1-accumulate"],
        "audited": True,
        "unordered": 0,
        "first_unordered": None, "crashed": False}
    assert written["final"] is True and written["world_size"] == 2
    assert written["finish_grad_sync_calls"] > 0 and written["audit"] == "on"
    first = (without.audit_report or {})["copies"][0]["first_unordered"]
    assert first["pool"] == "fsdp_grads" and first["writer"] == "default stream"


def test_selftest_audit_json_on_0_6_1() -> None:
    out = run_python("", args=("-m", "mfsdp_hotfix", "selftest", "--audit", "--json",
                               "--flavour", "standalone", "--path",
                               release_path("megatron-fsdp", "0.6.1")))
    assert out.returncode == 0, out.stderr[-3000:]
    phases = json.loads(out.stdout)["phases"]
    assert [(p["hotfix"], p["ranks"]) for p in phases] == [(False, 2), (True, 2), (False, 1),
                                                           (True, 1)]
    for phase in phases:  # one rank: no gradient-slot reuse to count, the counts still agree
        assert phase["agree"] and phase["audit_reuses"] == phase["standin_reuses"], phase
        assert phase["audit_reuses"] > 0 or phase["ranks"] == 1, phase
        assert phase["audit_unordered"] == phase["standin_unordered"], phase
    assert phases[0]["audit_unordered"] > 0 and phases[1]["audit_unordered"] == 0


def test_era_a_crash_is_reported_as_a_crash() -> None:
    result = run_cached(CaseSpec(flavour="standalone", hotfix="off", audit=True,
                                 path=release_path("megatron-fsdp", "0.4.0")))
    assert result.crashed and "No buffer found" in (result.exception or ""), describe(result)
    assert result.audit_crashed and audit_agrees(result), describe(result)
    crash = (result.audit_report or {})["copies"][0]["crash"]
    assert crash["pool"] == "fsdp_grads" and "No buffer found" in crash["error"]


def test_an_unwritable_path_leaves_training_alone(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    reports = launch_ranks(
        {"flavour": "standalone", "hotfix": "on", "iterations": 1},
        [{"MFSDP_HOTFIX_AUDIT": str(tmp_path / "file" / "audit")}] * 2, tmp_path,
        path=(Path(release_path("megatron-fsdp", "0.5.1")),))
    for rank, got in enumerate(reports):
        log = (tmp_path / f"rank{rank}.log").read_text()
        assert got is not None and not got["crashed"], log[-3000:]
        assert log.count("audit-report failed") == 1, log[-3000:]
    assert reports[0] is not None and reports[0]["max_abs_grad_error"] == 0.0


def test_audit_command_summarises_a_torchrun_job(tmp_path: Path) -> None:
    spec = CaseSpec(flavour="standalone", iterations=1).to_json()
    out = run_python(
        "", Path(release_path("megatron-fsdp", "0.5.1")), env={"MFSDP_HOTFIX": "0",
                                                              "GLOO_SOCKET_IFNAME": "lo"},
        args=("-m", "mfsdp_hotfix", "audit", "--out", str(tmp_path / "job" / "audit"), "--",
              sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc-per-node", "2", str(REPO / "tests/real_library/audit_job.py"), spec,
              str(tmp_path / "store")))
    text = out.stdout + out.stderr
    assert out.returncode == 3, text[-4000:]  # the job exited 0; the verdict sets the status
    assert "mfsdp_hotfix audit, 2 ranks: UNORDERED" in text, text[-4000:]  # rank 0's job line
    assert verdict_line(out.stdout).startswith("audit: UNORDERED: a gradient slot was reused"), text
    assert "\n  a gradient-buffer slot was reused by a stream not ordered" in out.stdout, text
    assert "\n  megatron_fsdp 0.5.1 (era B), ranks 0,1:" in out.stdout, text
    assert "\n    hotfix fixes applied: none\n" in out.stdout, text
    files: dict[str, Any] = {p.name: json.loads(p.read_text())
                             for p in (tmp_path / "job").glob("audit.rank*.json")}
    assert sorted(files) == ["audit.rank0.json", "audit.rank1.json"]
    assert all(f["final"] and f["copies"][0]["unordered"] > 0 for f in files.values())
    # two data-parallel ranks: no one-rank gradient buffer, and not a word of one
    assert all(f["copies"][0]["one_rank_grads"] is None for f in files.values())
    assert "one rank" not in text and "size-one" not in text, text[-4000:]


def _audit_job(tmp_path: Path, release: Path, spec: CaseSpec, hotfix: str = "0",
               ranks: int = 2) -> Any:
    return run_python(
        "", release, env={"MFSDP_HOTFIX": hotfix, "GLOO_SOCKET_IFNAME": "lo"},
        args=("-m", "mfsdp_hotfix", "audit", "--out", str(tmp_path / "job" / "audit"), "--",
              sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc-per-node", str(ranks), str(REPO / "tests/real_library/audit_job.py"),
              spec.to_json(), str(tmp_path / "store")))


SIZE_ONE = ("5 dense ZeRO-2/3 gradient buffer(s) whose data-parallel group has one rank: the "
            "size-one group defect (single-rank-grads-reduced-every-microbatch)")


HSDP = ("5 dense ZeRO-2/3 gradient buffer(s) whose data-parallel group has one rank (5 of them "
        "under HSDP: a DP-Shard group of one rank): the size-one group defect "
        "(single-rank-grads-reduced-every-microbatch)")


@pytest.mark.parametrize(("hotfix", "outer", "status", "words"), [
    ("0", 1, 3, f"{SIZE_ONE} is not repaired, because single-rank-reduce is not applied to this "
                "copy"),
    ("1", 1, 4, f"{SIZE_ONE} applies to this job and is repaired by single-rank-reduce\n"),
    ("0", 2, 3, f"{HSDP} is not repaired, because single-rank-reduce is not applied"),
    ("1", 2, 4, f"{HSDP} applies to this job and is repaired by single-rank-reduce\n")],
    ids=["shipped", "hotfix", "hsdp-shipped", "hsdp-hotfix"])
def test_one_rank_says_whether_the_size_one_group_defect_is_repaired(
        tmp_path: Path, hotfix: str, outer: int, status: int, words: str) -> None:
    """A data-parallel group of one rank, ZeRO-3, 2 microbatches per step: one rank, or HSDP
    over two ranks with a DP-Shard group of one. No slot is reused, and before, every one ended
    NOT CHECKED, also as shipped, whose gradients are wrong (the selftest runner's reference
    comparison, tests/fixes/test_single_rank_reduce.py)."""
    spec = CaseSpec(flavour="standalone", iterations=1, world=outer, outer=outer,
                    microbatches=2)
    out = _audit_job(tmp_path, Path(release_path("megatron-fsdp", "0.6.1")), spec, hotfix,
                     ranks=outer)
    text = out.stdout + out.stderr
    assert out.returncode == status, text[-4000:]
    verdict = "WRONG GRADIENTS" if status == 3 else "NOT CHECKED"
    ranks = f"{outer} rank{'s' if outer > 1 else ''}"
    assert f"mfsdp_hotfix audit, {ranks}: {verdict}: 0 unordered of 0" in text, text[-4000:]
    assert words in out.stdout, out.stdout
    assert verdict_line(out.stdout).startswith(f"audit: {verdict}: "), out.stdout
    if status == 3:
        assert "its gradients are wrong as shipped (up to 2 microbatches per step)" in out.stdout
        assert "  workarounds without the hotfix: one microbatch per step" in out.stdout
    for written in (json.loads(p.read_text()) for p in (tmp_path / "job").glob("audit.rank*")):
        assert written["copies"][0]["one_rank_grads"] == {
            "dense": 5, "expert": 0, "hsdp": 5 if outer > 1 else 0, "microbatches": 2,
            "defect": "yes", "may_self_add": False}


@pytest.mark.parametrize(("release", "hotfix", "status", "words"), [
    ("0.6.1", "1", 4, f"{SIZE_ONE} applies to this job and is repaired by single-rank-reduce\n"),
    ("0.6.1", "0", 4, "this job accumulated one microbatch per step, which 0.6.1 gets right, but "
                      "with 2 or more its gradients are wrong: load the hotfix\n"),
    # 0.3.x adds the buffer onto itself: wrong from one microbatch on
    ("0.3.1", "0", 3, f"{SIZE_ONE} is not repaired, because single-rank-reduce is not applied "
                      "to this copy")],
    ids=["0.6.1-hotfix", "0.6.1-shipped", "0.3.1-shipped"])
def test_the_example_job_on_one_rank_tells_the_size_one_group_defect(
        tmp_path: Path, release: str, hotfix: str, status: int, words: str) -> None:
    """examples/train_fsdp.py with torchrun --nproc-per-node 1, as a one-GPU user runs it under
    the audit (docs/AUDIT.md, "An example job"): one microbatch per step."""
    out = run_python(
        "", Path(release_path("megatron-fsdp", release)),
        env={"MFSDP_HOTFIX": hotfix, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"},
        args=("-m", "mfsdp_hotfix", "audit", "--out", str(tmp_path / "run1"), "--",
              sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc-per-node", "1", str(REPO / "examples" / "train_fsdp.py")))
    text = out.stdout + out.stderr
    assert out.returncode == status, text[-4000:]
    assert words in out.stdout, out.stdout
    verdict = "WRONG GRADIENTS" if status == 3 else "NOT CHECKED"
    assert verdict_line(out.stdout).startswith(f"audit: {verdict}: "), out.stdout


def test_audit_command_sees_the_maxpool_race_as_shipped(tmp_path: Path) -> None:
    """Before the audit watched every pool allocator, this job ended 'audit: ordered' with 0 of 0
    reuses. Its counts are the configuration matrix's (the same case there, recorded in
    docs/configurations.json)."""
    row = next(r for r in configurations.CONFIGURATIONS if r.id == "maxpool-zero3")
    want = configurations.load_record()[row.id]["runs"]["off"]
    spec = row.spec("off")
    spec.audit = False  # `mfsdp-hotfix audit` arms it
    out = _audit_job(tmp_path, Path(release_path("megatron-fsdp", "0.6.1")), spec)
    text = out.stdout + out.stderr
    assert out.returncode == 3, text[-4000:]
    assert want["unordered"] > 0
    assert (f"ranks 0,1: UNORDERED: {want['unordered']} unordered of {want['reuses']} "
            "gradient-slot reuses") in out.stdout, text
    assert (f"gradient pools: fsdp_grads (MaxPoolAllocator): {want['unordered']} unordered of "
            f"{want['reuses']}") in out.stdout, text
    assert verdict_line(out.stdout).startswith("audit: UNORDERED: "), text


def test_a_gradient_pool_of_an_allocator_the_audit_does_not_know_is_unwatched(
        tmp_path: Path) -> None:
    """A release whose gradient pool comes from a class the audit has no entry for (here
    0.6.1 with MaxPoolAllocator renamed) is UNWATCHED, never ordered, and exits 4."""
    release = tmp_path / "release"
    shutil.copytree(release_path("megatron-fsdp", "0.6.1"), release)
    module = release / "megatron_fsdp" / "param_and_grad_buffer.py"
    module.write_text(module.read_text().replace("MaxPoolAllocator", "NewPoolAllocator"))
    spec = CaseSpec(flavour="standalone", units=6, iterations=1,
                    options={"maxpool_double_buffer": True})
    out = _audit_job(tmp_path, release, spec, hotfix="1")
    text = out.stdout + out.stderr
    assert out.returncode == 4, text[-4000:]
    assert "UNWATCHED: 0 unordered of 0 gradient-slot reuses\n" in out.stdout, text
    assert "\n    why: gradient pool(s) fsdp_grads (NewPoolAllocator) built from a class the " \
           "audit does not watch\n" in out.stdout, text
    assert verdict_line(out.stdout).startswith("audit: UNWATCHED: "), text
    assert "mfsdp_hotfix audit, 2 ranks: UNWATCHED" in text, text[-4000:]


def test_the_example_job_crashing_as_shipped_is_the_releases_crash_and_exit_3(
        tmp_path: Path) -> None:
    """examples/train_fsdp.py on megatron-fsdp 0.4.0 with MFSDP_HOTFIX=0, as docs/AUDIT.md runs
    it: the job fails, and a finding still exits 3; under the traceback, whose frames between
    the caller and the release are the audit's observer, and that the error is the release's."""
    out = run_python(
        "", Path(release_path("megatron-fsdp", "0.4.0")),
        env={"MFSDP_HOTFIX": "0", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"},
        args=("-m", "mfsdp_hotfix", "audit", "--out", str(tmp_path / "shipped"), "--",
              sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc-per-node", "2", str(REPO / "examples" / "train_fsdp.py")))
    text = out.stdout + out.stderr
    assert out.returncode == 3, text[-4000:]
    assert verdict_line(out.stdout).startswith(
        "audit: CRASH: the release's double buffer crashed; load the hotfix"), text[-4000:]
    assert ("\n  the release's double buffer crashed ('No buffer found for bucket_id', era A): "
            "Megatron-FSDP's own code raised it") in out.stdout, text[-4000:]
    assert "mfsdp_hotfix/slot_reuse.py" in out.stderr, out.stderr[-4000:]
    assert ("mfsdp_hotfix: this error was raised by Megatron-FSDP's own "
            "FixedPoolAllocator.allocate (the release's code). The frames of "
            "mfsdp_hotfix/patching.py and mfsdp_hotfix/slot_reuse.py above are the on-the-job "
            "audit (MFSDP_HOTFIX_AUDIT), which watches") in out.stderr, out.stderr[-4000:]
