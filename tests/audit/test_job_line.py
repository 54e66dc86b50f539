"""The job line from the ranks' totals, and the totals' exchange through the store."""

from __future__ import annotations

import pytest

from mfsdp_hotfix.audit.job_line import exchange, job_line


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
    got, line = job_line(found, 2, "/p/audit", 5.0)
    assert got == verdict and words in line and "/p/audit.rank*.json" in line


def test_the_job_line_says_when_no_rank_could_write_its_file() -> None:
    """Its counts stand, but it points at no file that is not there."""
    totals = {"reuses": 4, "unordered": 0, "crashed": 0, "unwritten": 1}
    verdict, line = job_line({0: totals, 1: totals}, 2, "/proc/x", 5.0)
    assert verdict == "ordered" and line.endswith(
        "; no rank file could be written at /proc/x on ranks 0,1 (their warning says why)"), line
    _, line = job_line({0: totals, 1: {**totals, "unwritten": 0}}, 2, "/p/a", 5.0)
    assert line.endswith("on ranks 0 (their warning says why) (details: /p/a.rank*.json)"), line


def test_exchange_through_a_store() -> None:
    torch_distributed = pytest.importorskip("torch.distributed")
    store = torch_distributed.HashStore()
    assert exchange(store, 1, 2, {"reuses": 3, "unordered": 1, "crashed": 0}, 1) is None
    found = exchange(store, 0, 2, {"reuses": 5, "unordered": 0, "crashed": 0}, 1)
    assert found == {0: {"reuses": 5, "unordered": 0, "crashed": 0},
                     1: {"reuses": 3, "unordered": 1, "crashed": 0}}
