"""The CLI's summary of the rank files (no torch needed)."""

from __future__ import annotations

from rank_records import POOLS, copy_record, rank_record

from mfsdp_hotfix.audit.summary import summarise


def test_no_rank_file_where_none_can_be_written_is_unwritable_not_no_data() -> None:
    verdict, lines = summarise({}, "/proc/x", "cannot create a file in /proc (...)")
    assert verdict == "UNWRITABLE" and lines == [
        "no rank file /proc/x.rank<N>.json: cannot create a file in /proc (...)"]
    assert summarise({}, "/p/a")[0] == "NO DATA"


def test_summary_of_rank_files() -> None:
    first = {"pool": "fsdp_grads", "slot": "(0, 0)", "previous_bucket": 4, "new_bucket": 2,
             "rs_event": "stream 0x1 @3", "writer": "default stream"}
    verdict, lines = summarise({0: rank_record(0, unordered=3, first_unordered=first),
                                1: rank_record(1)}, "/p/audit")
    assert verdict == "UNORDERED"
    assert lines[:2] == ["megatron_fsdp 0.5.1 (era B), ranks 0,1: UNORDERED: 3 unordered of 36 "
                         "gradient-slot reuses", "  hotfix fixes applied: none"], lines
    assert "first unordered reuse (rank 0)" in lines[2] and '"new_bucket": 2' in lines[2]
    assert summarise({0: rank_record(0), 1: rank_record(1)}, "p")[0] == "ordered"
    assert summarise({0: rank_record(0, crashed=True, crash={"bucket": 2})}, "p")[0] == "CRASH"
    verdict, lines = summarise({0: rank_record(0, world=4)}, "p")
    assert verdict == "INCOMPLETE" and "no rank file from ranks 1,2,3 of 4" in lines
    assert summarise({}, "p")[0] == "NO DATA"
    verdict, lines = summarise({0: rank_record(0, world=1, unseen=4)}, "p")
    assert verdict == "INCOMPLETE" and "  4 more not judged: their reduce-scatter was not " \
        "seen" in lines, lines


def test_a_copy_that_built_no_pool_does_not_hide_another_copys_result() -> None:
    unused = copy_record(package="megatron.core.distributed.fsdp.src.megatron_fsdp", reuses=0,
                         grad_pools={})
    ranks = {r: {**rank_record(r, grad_pools=POOLS),
                 "copies": [copy_record(grad_pools=POOLS), unused]}
             for r in (0, 1)}
    assert summarise(ranks, "p")[0] == "ordered"
    for copy in (copy_record(reuses=0, grad_pools={}), unused):
        alone = {r: {**rank_record(r), "copies": [copy]} for r in (0, 1)}
        verdict, lines = summarise(alone, "p")
        assert verdict == "NOT CHECKED", lines
        assert lines[-1] == "no Megatron-FSDP copy in the rank files built a gradient pool"
    assert summarise({0: {**rank_record(0, world=1), "copies": []}}, "p")[0] == "NOT CHECKED"
