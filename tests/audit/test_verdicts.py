"""The verdicts of one copy, the same in the CLI's summary and the job line, and the exit
statuses they give (no torch needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rank_records import POOLS, copy_record, rank_record

from mfsdp_hotfix.audit.job_line import job_line, totals
from mfsdp_hotfix.audit.summary import summarise
from mfsdp_hotfix.audit.verdicts import FOUND, VERDICTS, copy_verdict, exit_status, one_rank


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
    assert copy_verdict(copy_record(**fields)) == (verdict, why)
    got, lines = summarise({0: rank_record(0, world=1, **fields)}, "p")
    assert got == verdict and f"ranks 0: {verdict}: " in lines[0], lines
    job, _ = job_line({0: totals(rank_record(0, world=1, **fields))}, 1, "p", 1.0)
    assert job == verdict
    if verdict in ("UNWATCHED", "NOT CHECKED"):
        assert lines[:3] == [lines[0], "  hotfix fixes applied: none", f"  why: {why}"], lines


@pytest.mark.parametrize(("verdict", "command", "status"), [
    ("ordered", 0, 0), ("UNORDERED", 0, 3), ("CRASH", 0, 3), ("UNWATCHED", 0, 4),
    ("INCOMPLETE", 0, 4), ("NOT CHECKED", 0, 4), ("UNWRITABLE", 0, 4), ("NO DATA", 0, 4),
    ("ordered", 2, 2), ("NOT CHECKED", 1, 1), ("NO DATA", -9, 137), ("WRONG GRADIENTS", 0, 3),
    # a finding is 3 whatever the command did: a crash fails the command, and is the finding
    ("CRASH", 1, 3), ("UNORDERED", -9, 3), ("WRONG GRADIENTS", 1, 3)])
def test_exit_status_follows_the_verdict(verdict: str, command: int, status: int) -> None:
    assert exit_status(verdict, command) == status
    assert (VERDICTS[verdict][2] == 0) == (verdict == "ordered")


def test_docs_audit_md_lists_every_verdict_and_links_the_exit_statuses() -> None:
    """The exit statuses live in one place, docs/CLI.md (its numbers are claims of the code's
    constants, tests/claims.py); AUDIT.md lists the verdicts in their order and links there."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "AUDIT.md").read_text()
    table = text.split("| verdict | meaning | what to do |", 1)[1]
    rows = [line.split("|") for line in table.strip().splitlines()[1:]
            if line.startswith("| `")]
    assert [row[1].strip().strip("`") for row in rows] == list(VERDICTS)
    assert '[CLI.md, "Exit statuses"](CLI.md#exit-statuses)' in " ".join(text.split())


# ---- the size-one group defect (release_defects.SINGLE_RANK_GRADS) at one data-parallel rank
ONE_POOL = {"fsdp_grads (FixedPoolAllocator)": 0}  # one rank: its pool hands out no slot


def _one_rank(fixes: tuple[str, ...] = (), **found: Any) -> dict[str, Any]:
    grads = {"dense": 5, "expert": 0, "hsdp": 0, "microbatches": 2, "defect": "yes",
             "may_self_add": False, **found}
    return copy_record(version="0.6.1", era="C", reuses=0, grad_pools=ONE_POOL,
                       fixes=list(fixes), one_rank_grads=grads)


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
    got, why = copy_verdict(copy)
    assert got == verdict and words in (why or ""), why
    summary, lines = summarise({0: {**rank_record(0, world=1), "copies": [copy]}}, "p")
    assert summary == verdict and lines[0].startswith("megatron_fsdp 0.6.1 (era C), ranks 0: "
                                                      f"{verdict}: "), lines
    assert lines[1].startswith("  hotfix fixes applied: "), lines
    text = " ".join("\n".join(lines).split())
    # where nothing was checked, why on one line and the one-rank buffers on the next
    assert all(part in text for part in (words.split("; ", 1) if verdict == "NOT CHECKED"
                                         else [words])), lines
    if verdict == "NOT CHECKED":  # why nothing was checked, then the one-rank buffers
        assert lines[2].startswith("  why: ") and words.split("; ")[-1] in lines[3], lines
        assert lines[3].startswith("  one-rank gradient buffers, ranks 0: "), lines
    else:
        assert lines[2].startswith("  one-rank gradient buffers, ranks 0: "), lines
        assert lines[3] == ("  workarounds without the hotfix: one microbatch per step, on "
                            "megatron-fsdp 0.4.0 and later / megatron-core 0.17 and later; or "
                            "fused wgrad accumulation off (gradient_accumulation_fusion=False), "
                            "on megatron-fsdp 0.4.0 and later / megatron-core 0.17 and later, "
                            "where the scale is 1 (data-parallel size 1, not experts)"), lines
    job, line = job_line({0: totals({**rank_record(0, world=1), "copies": [copy]})}, 1,
                         "p", 1.0)
    assert job == verdict and "whose data-parallel group has one rank on ranks 0: the size-one "\
        "group defect (single-rank-grads-reduced-every-microbatch) is " in line, line
    assert exit_status(verdict, 0) == (3 if verdict == "WRONG GRADIENTS" else 4)


def test_without_the_double_buffer_a_one_rank_copy_still_counts() -> None:
    """No gradient pool, no slot reuse: the copy is still the job's, and its defect the
    verdict (before, 'no Megatron-FSDP copy in the rank files built a gradient pool')."""
    copy = {**_one_rank(), "grad_pools": {}}
    verdict, lines = summarise({0: {**rank_record(0, world=1), "copies": [copy]}}, "p")
    assert verdict == "WRONG GRADIENTS", lines
    repaired = {**_one_rank(("single-rank-reduce",)), "grad_pools": {}}
    verdict, lines = summarise({0: {**rank_record(0, world=1), "copies": [repaired]}}, "p")
    assert verdict == "NOT CHECKED" and lines[3].endswith("repaired by single-rank-reduce"), \
        lines


@pytest.mark.parametrize("copy", [
    copy_record(reuses=0, grad_pools=ONE_POOL, one_rank_grads=None),  # no one-rank group
    _one_rank(defect="no")])  # code without the defect (NVIDIA/Megatron-LM#6773)
def test_where_the_size_one_defect_does_not_apply_nothing_changes(copy: dict[str, Any]) -> None:
    assert one_rank(copy) is None
    verdict, lines = summarise({0: {**rank_record(0, world=1), "copies": [copy]}}, "p")
    assert verdict == "NOT CHECKED" and lines[2] == (
        "  why: gradient pool(s) fsdp_grads (FixedPoolAllocator) built, no slot reused"), lines
    assert "one rank" not in " ".join(lines)
    assert "one rank" not in job_line({0: totals(rank_record(0, world=1))}, 1, "p", 1)[1]


def test_an_unordered_reuse_stays_the_worst_and_the_defect_is_still_told() -> None:
    copy = {**_one_rank(expert=2, dense=0), "reuses": 8, "unordered": 2,
            "grad_pools": {"fsdp_grads (FixedPoolAllocator)": 8}}
    verdict, lines = summarise({r: {**rank_record(r), "copies": [copy]} for r in (0, 1)}, "p")
    assert verdict == "UNORDERED"
    assert any(line.startswith("  one-rank gradient buffers, ranks 0,1: 2 expert ") for line in
               lines), lines


def test_the_verdict_names_the_registrys_defect_and_fix() -> None:
    from mfsdp_hotfix import fix_catalogue, release_defects

    meaning, todo, status = VERDICTS["WRONG GRADIENTS"]
    assert release_defects.SINGLE_RANK_GRADS.name in meaning and status == FOUND
    assert fix_catalogue.SINGLE_RANK_REDUCE.id in todo
    order = list(VERDICTS)
    assert order.index("CRASH") < order.index("WRONG GRADIENTS") < order.index("UNWATCHED")
