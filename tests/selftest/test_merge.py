"""Merging the two ranks' reports into one case result (no subprocess)."""

from __future__ import annotations

from typing import Any

from mfsdp_hotfix.selftest.runner import merge
from mfsdp_hotfix.selftest.spec import CaseSpec


def _report(rank: int, **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"rank": rank, "crashed": False, "worker_s": 5.0 + rank,
                            "ordering": {"checks": 18, "violations": rank * 3,
                                         "first_violations": [{"rank": rank}]}}
    base.update(fields)
    return base


def test_both_ranks_ok() -> None:
    r = merge(CaseSpec(), [_report(0, max_abs_grad_error=0.0, grad_digest="d"), _report(1)],
              [0, 0], "")
    assert not r.crashed and r.max_abs_grad_error == 0.0 and r.grad_digest == "d"
    assert (r.ordering_checks, r.ordering_violations, r.worker_s) == (36, 3, 6.0)


def test_a_rank_that_reported_nothing_is_a_crash_but_its_peer_explains_it() -> None:
    r = merge(CaseSpec(), [_report(0, crashed=True, exception="AssertionError: No buffer"),
                           None], [0, -9], "")
    assert r.crashed and r.exception == "AssertionError: No buffer"
    r = merge(CaseSpec(), [_report(0), None], [0, -11], "")
    assert r.crashed and "rank(s) [1] reported nothing" in (r.exception or "")
