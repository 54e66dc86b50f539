"""Rank files, the job line and the CLI's reading of the files (no torch needed)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from mfsdp_hotfix.audit import report


def _copy(**fields: Any) -> dict[str, Any]:
    base = {"package": "megatron_fsdp", "version": "0.5.1", "era": "B", "fixes": [],
            "audited": True, "reuses": 18, "unordered": 0, "first_unordered": None,
            "crashed": False, "crash": None, "note": None}
    return {**base, **fields}


def _rank(rank: int, world: int = 2, **fields: Any) -> dict[str, Any]:
    return {"rank": rank, "world_size": world, "final": True, "audit": "on",
            "copies": [_copy(**fields)]}


def test_rank_file_is_written_whole_and_replaced(tmp_path: Path) -> None:
    out = report.RankFile(str(tmp_path / "sub" / "audit"))
    name = out.write(_rank(3))
    assert name == str(tmp_path / "sub" / "audit.rank3.json")
    assert json.loads(Path(name).read_text())["rank"] == 3
    assert out.write(_rank(3, reuses=7)) == name
    assert json.loads(Path(name).read_text())["copies"][0]["reuses"] == 7
    assert os.listdir(tmp_path / "sub") == ["audit.rank3.json"]  # no temporary left behind


def test_an_unwritable_path_raises_for_the_caller_to_report(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        report.RankFile(str(tmp_path / "file" / "audit")).write(_rank(0))


@pytest.mark.parametrize(("found", "verdict", "words"), [
    ({0: {"reuses": 4, "unordered": 0, "crashed": 0}, 1: {"reuses": 4, "unordered": 0,
                                                          "crashed": 0}},
     "ordered", "0 unordered of 8 gradient-slot reuses"),
    ({0: {"reuses": 4, "unordered": 2, "crashed": 0}, 1: {"reuses": 4, "unordered": 0,
                                                          "crashed": 0}},
     "UNORDERED", "unordered on ranks 0"),
    ({0: {"reuses": 0, "unordered": 0, "crashed": 1}}, "CRASH", "crash on ranks 0"),
    ({0: {"reuses": 4, "unordered": 0, "crashed": 0}}, "INCOMPLETE",
     "no report within 5 s from ranks 1"),
    ({0: {"reuses": 0, "unordered": 0, "crashed": 0}, 1: {"reuses": 0, "unordered": 0,
                                                          "crashed": 0}},
     "NOT CHECKED", "0 unordered of 0 gradient-slot reuses; no gradient-slot reuse was seen"),
    ({0: {"reuses": 4, "unordered": 0, "crashed": 0, "unwatched": 1},
      1: {"reuses": 4, "unordered": 0, "crashed": 0}},
     "UNWATCHED", "a copy or gradient pool the audit cannot watch on ranks 0"),
])
def test_job_line(found: dict[int, dict[str, int]], verdict: str, words: str) -> None:
    got, line = report.job_line(found, 2, "/p/audit", 5.0)
    assert got == verdict and words in line and "/p/audit.rank*.json" in line


def test_the_job_line_says_when_no_rank_could_write_its_file() -> None:
    """Its counts stand, but it points at no file that is not there."""
    totals = {"reuses": 4, "unordered": 0, "crashed": 0, "unwritten": 1}
    verdict, line = report.job_line({0: totals, 1: totals}, 2, "/proc/x", 5.0)
    assert verdict == "ordered" and line.endswith(
        "; no rank file could be written at /proc/x on ranks 0,1 (their warning says why)"), line
    _, line = report.job_line({0: totals, 1: {**totals, "unwritten": 0}}, 2, "/p/a", 5.0)
    assert line.endswith("on ranks 0 (their warning says why) (details: /p/a.rank*.json)"), line


@pytest.mark.parametrize(("where", "words"), [
    # a folder nobody can create files in: the true reason, not proc's "No such file"
    ("/proc/x", "cannot create a file in /proc: it is on a proc filesystem, which takes no new "
                "files"),
    ("file/run1", "/file is not a folder"),
    ("new/deeper/run1", None),  # created when the files are written: probed where it would be
    ("run1", None),
])
def test_probe_creates_a_file_and_removes_it(tmp_path: Path, where: str, words: str | None
                                            ) -> None:
    (tmp_path / "file").write_text("")
    path = where if where.startswith("/") else str(tmp_path / where)
    problem = report.probe(path)
    assert (problem is None) == (words is None) and (words is None or words in problem), problem
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing left behind


def test_no_rank_file_where_none_can_be_written_is_unwritable_not_no_data() -> None:
    verdict, lines = report.summarise({}, "/proc/x", "cannot create a file in /proc (...)")
    assert verdict == "UNWRITABLE" and lines == [
        "no rank file /proc/x.rank<N>.json: cannot create a file in /proc (...)"]
    assert report.summarise({}, "/p/a")[0] == "NO DATA"


def test_exchange_through_a_store() -> None:
    torch_distributed = pytest.importorskip("torch.distributed")
    store = torch_distributed.HashStore()
    assert report.exchange(store, 1, 2, {"reuses": 3, "unordered": 1, "crashed": 0}, 1) is None
    found = report.exchange(store, 0, 2, {"reuses": 5, "unordered": 0, "crashed": 0}, 1)
    assert found == {0: {"reuses": 5, "unordered": 0, "crashed": 0},
                     1: {"reuses": 3, "unordered": 1, "crashed": 0}}


def test_reading_rank_files(tmp_path: Path) -> None:
    prefix = str(tmp_path / "audit")
    Path(prefix + ".rank0.json").write_text(json.dumps(_rank(0)))
    Path(prefix + ".rank12.json").write_text("{")
    Path(prefix + ".rank2.json.123.tmp").write_text("{")
    Path(prefix + "x.rank3.json").write_text("{}")
    assert report.rank_files(prefix) == {0: prefix + ".rank0.json", 12: prefix + ".rank12.json"}
    reports, unreadable = report.read_rank_files(prefix)
    assert list(reports) == [0] and unreadable[0].startswith(prefix + ".rank12.json (")


def test_summary_of_rank_files() -> None:
    first = {"pool": "fsdp_grads", "slot": "(0, 0)", "previous_bucket": 4, "new_bucket": 2,
             "rs_event": "stream 0x1 @3", "writer": "default stream"}
    verdict, lines = report.summarise({0: _rank(0, unordered=3, first_unordered=first),
                                       1: _rank(1)}, "/p/audit")
    assert verdict == "UNORDERED"
    assert lines[0].startswith("megatron_fsdp 0.5.1 (era B, hotfix fixes applied: none), ranks "
                               "0,1: UNORDERED: 3 unordered of 36 gradient-slot reuses")
    assert "first unordered reuse (rank 0)" in lines[1] and '"new_bucket": 2' in lines[1]
    assert report.summarise({0: _rank(0), 1: _rank(1)}, "p")[0] == "ordered"
    assert report.summarise({0: _rank(0, crashed=True, crash={"bucket": 2})}, "p")[0] == "CRASH"
    verdict, lines = report.summarise({0: _rank(0, world=4)}, "p")
    assert verdict == "INCOMPLETE" and "no rank file from ranks 1,2,3 of 4" in lines
    assert report.summarise({}, "p")[0] == "NO DATA"
    verdict, lines = report.summarise({0: _rank(0, world=1, unseen=4)}, "p")
    assert verdict == "INCOMPLETE" and "(4 more not judged" in lines[0]


POOLS = {"fsdp_grads (MaxPoolAllocator)": 18}


@pytest.mark.parametrize(("fields", "verdict", "why"), [
    ({"grad_pools": POOLS}, "ordered", None),
    ({"reuses": 0, "grad_pools": {}}, "NOT CHECKED",
     "no gradient pool was built (fsdp_double_buffer off, or no FSDP unit)"),
    ({"reuses": 0, "grad_pools": {"fsdp_grads (FixedPoolAllocator)": 0}}, "NOT CHECKED",
     "gradient pool(s) fsdp_grads (FixedPoolAllocator) built, no slot reused"),
    ({"reuses": 0, "audited": False, "grad_pools": None, "note": "not audited: X"},
     "UNWATCHED", "not audited: X"),
    ({"grad_pools": POOLS, "unwatched_pools": ["fsdp_grads (NewPoolAllocator)"]}, "UNWATCHED",
     "gradient pool(s) fsdp_grads (NewPoolAllocator) built from a class the audit does not "
     "watch"),
    ({"reuses": 0, "grad_pools": {}, "unwatched_pools": ["fsdp_grads (NewPoolAllocator)"]},
     "UNWATCHED", "gradient pool(s) fsdp_grads (NewPoolAllocator) built from a class the audit "
     "does not watch"),
    ({"unordered": 2, "grad_pools": POOLS}, "UNORDERED", None),
    ({"unseen": 3, "grad_pools": POOLS}, "INCOMPLETE",
     "3 reuses not judged (reduce-scatter not seen)"),
])
def test_copy_verdicts(fields: dict[str, Any], verdict: str, why: str | None) -> None:
    assert report.copy_verdict(_copy(**fields)) == (verdict, why)
    got, lines = report.summarise({0: _rank(0, world=1, **fields)}, "p")
    assert got == verdict and f"ranks 0: {verdict}: " in lines[0], lines
    job, _ = report.job_line({0: report.totals(_rank(0, world=1, **fields))}, 1, "p", 1.0)
    assert job == verdict
    if verdict in ("UNWATCHED", "NOT CHECKED"):
        assert lines[0].endswith(f"[{why}]"), lines


def test_a_copy_that_built_no_pool_does_not_hide_another_copys_result() -> None:
    unused = _copy(package="megatron.core.distributed.fsdp.src.megatron_fsdp", reuses=0,
                   grad_pools={})
    ranks = {r: {**_rank(r, grad_pools=POOLS), "copies": [_copy(grad_pools=POOLS), unused]}
             for r in (0, 1)}
    assert report.summarise(ranks, "p")[0] == "ordered"
    for copy in (_copy(reuses=0, grad_pools={}), unused):
        alone = {r: {**_rank(r), "copies": [copy]} for r in (0, 1)}
        verdict, lines = report.summarise(alone, "p")
        assert verdict == "NOT CHECKED", lines
        assert lines[-1] == "no Megatron-FSDP copy in the rank files built a gradient pool"
    assert report.summarise({0: {**_rank(0, world=1), "copies": []}}, "p")[0] == "NOT CHECKED"


@pytest.mark.parametrize(("verdict", "command", "status"), [
    ("ordered", 0, 0), ("UNORDERED", 0, 3), ("CRASH", 0, 3), ("UNWATCHED", 0, 4),
    ("INCOMPLETE", 0, 4), ("NOT CHECKED", 0, 4), ("UNWRITABLE", 0, 4), ("NO DATA", 0, 4),
    ("ordered", 2, 2), ("NOT CHECKED", 1, 1), ("NO DATA", -9, 137), ("WRONG GRADIENTS", 0, 3),
    # a finding is 3 whatever the command did: a crash fails the command, and is the finding
    ("CRASH", 1, 3), ("UNORDERED", -9, 3), ("WRONG GRADIENTS", 1, 3)])
def test_exit_status_follows_the_verdict(verdict: str, command: int, status: int) -> None:
    assert report.exit_status(verdict, command) == status
    assert (report.VERDICTS[verdict][2] == 0) == (verdict == "ordered")


def test_docs_audit_md_lists_every_verdict_and_links_the_exit_statuses() -> None:
    """The exit statuses live in one place, docs/CLI.md (its numbers are claims of the code's
    constants, tests/claims.py); AUDIT.md lists the verdicts in their order and links there."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "AUDIT.md").read_text()
    table = text.split("| verdict | meaning | what to do |", 1)[1]
    rows = [line.split("|") for line in table.strip().splitlines()[1:]
            if line.startswith("| `")]
    assert [row[1].strip().strip("`") for row in rows] == list(report.VERDICTS)
    assert '[CLI.md, "Exit statuses"](CLI.md#exit-statuses)' in " ".join(text.split())


# ---- the size-one group defect (release_defects.SINGLE_RANK_GRADS) at one data-parallel rank
ONE_POOL = {"fsdp_grads (FixedPoolAllocator)": 0}  # one rank: its pool hands out no slot


def _one_rank(fixes: tuple[str, ...] = (), **found: Any) -> dict[str, Any]:
    grads = {"dense": 5, "expert": 0, "hsdp": 0, "microbatches": 2, "defect": "yes",
             "may_self_add": False, **found}
    return _copy(version="0.6.1", era="C", reuses=0, grad_pools=ONE_POOL, fixes=list(fixes),
                 one_rank_grads=grads)


@pytest.mark.parametrize(("copy", "verdict", "words"), [
    (_one_rank(), "WRONG GRADIENTS",
     "5 dense ZeRO-2/3 gradient buffer(s) whose data-parallel group has one rank: the size-one "
     "group defect (single-rank-grads-reduced-every-microbatch) is not repaired, because "
     "single-rank-reduce is not applied to this copy (the hotfix is off, or the fix is "
     "disabled, refused or unverified: `mfsdp-hotfix status --verbose` says which); its "
     "gradients are wrong as shipped (up to 2 microbatches per step)"),
    (_one_rank(("single-rank-reduce",)), "NOT CHECKED",
     "gradient pool(s) fsdp_grads (FixedPoolAllocator) built, no slot reused; 5 dense ZeRO-2/3 "
     "gradient buffer(s) whose data-parallel group has one rank: the size-one group defect "
     "(single-rank-grads-reduced-every-microbatch) applies to this job and is repaired by "
     "single-rank-reduce"),
    (_one_rank(microbatches=1), "NOT CHECKED",
     "this job accumulated one microbatch per step, which 0.6.1 gets right, but with 2 or more "
     "its gradients are wrong: load the hotfix"),
    # megatron-fsdp 0.3.x adds the buffer onto itself: wrong from one microbatch on
    (_one_rank(microbatches=1, may_self_add=True), "WRONG GRADIENTS",
     "its gradients are wrong as shipped (1 microbatch per step)"),
    (_one_rank(microbatches=0, expert=2, dense=0), "WRONG GRADIENTS",
     "2 expert ZeRO-2/3 gradient buffer(s) whose data-parallel group has one rank: "),
    (_one_rank(defect="unknown"), "WRONG GRADIENTS",
     "the hotfix does not know its hooks' code shape, so it may have the defect; its gradients "
     "are wrong as shipped (up to 2 microbatches per step)"),
    (_one_rank(("single-rank-reduce",), hsdp=5, may_self_add=True), "WRONG GRADIENTS",
     "(5 of them under HSDP: a DP-Shard group of one rank): the size-one group defect "
     "(single-rank-grads-reduced-every-microbatch) is not repaired, because single-rank-reduce "
     "does not cover it here: not covered is HSDP with a one-rank DP-Shard group on "
     "megatron-fsdp 0.3.0-0.3.1"),
    (_one_rank(("single-rank-reduce",), hsdp=5), "NOT CHECKED", "and is repaired by "
                                                                "single-rank-reduce"),
])
def test_a_one_rank_gradient_buffer_says_whether_the_size_one_defect_is_repaired(
        copy: dict[str, Any], verdict: str, words: str) -> None:
    got, why = report.copy_verdict(copy)
    assert got == verdict and words in (why or ""), why
    summary, lines = report.summarise({0: {**_rank(0, world=1), "copies": [copy]}}, "p")
    assert summary == verdict and lines[0].startswith("megatron_fsdp 0.6.1 (era C, hotfix fixes "
                                                      "applied: "), lines
    text = "\n".join(lines)
    assert words in " ".join(text.split()), lines
    if verdict == "NOT CHECKED":  # said in the copy's line, in brackets
        assert lines[0].endswith("]") and words in lines[0], lines
    else:
        assert lines[1].startswith("  one-rank gradient buffers, ranks 0: "), lines
        assert lines[2] == ("  workarounds without the hotfix: one microbatch per step, on "
                            "megatron-fsdp 0.4.0 and later / megatron-core 0.17 and later; or "
                            "fused wgrad accumulation off (gradient_accumulation_fusion=False), "
                            "on megatron-fsdp 0.4.0 and later / megatron-core 0.17 and later, "
                            "where the scale is 1 (data-parallel size 1, not experts)"), lines
    job, line = report.job_line({0: report.totals({**_rank(0, world=1), "copies": [copy]})}, 1,
                                "p", 1.0)
    assert job == verdict and "whose data-parallel group has one rank on ranks 0: the size-one "\
        "group defect (single-rank-grads-reduced-every-microbatch) is " in line, line
    assert report.exit_status(verdict, 0) == (3 if verdict == "WRONG GRADIENTS" else 4)


def test_without_the_double_buffer_a_one_rank_copy_still_counts() -> None:
    """No gradient pool, no slot reuse: the copy is still the job's, and its defect the
    verdict (before, 'no Megatron-FSDP copy in the rank files built a gradient pool')."""
    copy = {**_one_rank(), "grad_pools": {}}
    verdict, lines = report.summarise({0: {**_rank(0, world=1), "copies": [copy]}}, "p")
    assert verdict == "WRONG GRADIENTS", lines
    repaired = {**_one_rank(("single-rank-reduce",)), "grad_pools": {}}
    verdict, lines = report.summarise({0: {**_rank(0, world=1), "copies": [repaired]}}, "p")
    assert verdict == "NOT CHECKED" and "repaired by single-rank-reduce]" in lines[0], lines


@pytest.mark.parametrize("copy", [
    _copy(reuses=0, grad_pools=ONE_POOL, one_rank_grads=None),  # no one-rank group
    _one_rank(defect="no")])  # code without the defect (NVIDIA/Megatron-LM#6773)
def test_where_the_size_one_defect_does_not_apply_nothing_changes(copy: dict[str, Any]) -> None:
    assert report.one_rank(copy) is None
    verdict, lines = report.summarise({0: {**_rank(0, world=1), "copies": [copy]}}, "p")
    assert verdict == "NOT CHECKED" and lines[0].endswith(
        "[gradient pool(s) fsdp_grads (FixedPoolAllocator) built, no slot reused]"), lines
    assert "one rank" not in " ".join(lines)
    assert "one rank" not in report.job_line({0: report.totals(_rank(0, world=1))}, 1, "p", 1)[1]


def test_an_unordered_reuse_stays_the_worst_and_the_defect_is_still_told() -> None:
    copy = {**_one_rank(expert=2, dense=0), "reuses": 8, "unordered": 2,
            "grad_pools": {"fsdp_grads (FixedPoolAllocator)": 8}}
    verdict, lines = report.summarise({r: {**_rank(r), "copies": [copy]} for r in (0, 1)}, "p")
    assert verdict == "UNORDERED"
    assert any(line.startswith("  one-rank gradient buffers, ranks 0,1: 2 expert ") for line in
               lines), lines


def test_the_verdict_names_the_registrys_defect_and_fix() -> None:
    from mfsdp_hotfix import fix_catalogue, release_defects

    meaning, todo, status = report.VERDICTS["WRONG GRADIENTS"]
    assert release_defects.SINGLE_RANK_GRADS.name in meaning and status == report.FOUND
    assert fix_catalogue.SINGLE_RANK_REDUCE.id in todo
    order = list(report.VERDICTS)
    assert order.index("CRASH") < order.index("WRONG GRADIENTS") < order.index("UNWATCHED")
