"""The audit's job line: at exit, each rank publishes its totals in the process group's
key-value store (the one the cross-rank check uses, with its switch and timeout); rank 0 waits for
them and logs one line with the job's verdict. A failing store does not stop the job: one warning.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from ..fix_catalogue import SINGLE_RANK_REDUCE
from ..release_defects import SINGLE_RANK_GRADS
from .verdicts import WRONG, copy_verdict, is_used, one_rank

STORE_PREFIX = "mfsdp_hotfix/audit/"


def totals(report: dict[str, Any]) -> dict[str, int]:
    """One rank's numbers, summed over its copies."""
    copies = report.get("copies", [])
    used = [c for c in copies if is_used(c)]
    size_one = [found for found in map(one_rank, copies) if found is not None]
    return {"reuses": sum(int(c.get("reuses", 0)) for c in copies),
            "unordered": sum(int(c.get("unordered", 0)) for c in copies),
            "unseen": sum(int(c.get("unseen", 0)) for c in copies),
            "crashed": int(any(c.get("crashed") for c in copies)),
            "disabled": int(bool(report.get("audit", "on") != "on")),
            "unwatched": sum(copy_verdict(c)[0] == "UNWATCHED" for c in used),
            **{f"one_rank_{state}": sum(n for s, n, _ in size_one if s == state)
               for state in ("wrong", "repaired", "right")}}


def exchange(store: Any, rank: int, world: int, mine: dict[str, int], timeout_s: float
             ) -> dict[int, dict[str, int]] | None:
    """Publish this rank's totals; on rank 0, wait for the others' and return them by rank."""
    keys = [f"{STORE_PREFIX}{r}" for r in range(world)]
    store.set(keys[rank], json.dumps(mine))
    if rank != 0:
        return None
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception:
        pass  # the ranks that did not answer are named in the job line
    return {r: json.loads(store.get(key)) for r, key in enumerate(keys) if store.check([key])}


def job_line(found: dict[int, dict[str, int]], world: int, path: str, timeout_s: float
             ) -> tuple[str, str]:
    """The job's verdict (one of :data:`VERDICTS` but ``NO DATA``) and its line, from the ranks'
    totals (``unwritten``: the rank could not write its file, which the line says; the counts
    stand)."""
    reuses = sum(t["reuses"] for t in found.values())
    unordered = {r: t["unordered"] for r, t in found.items() if t["unordered"]}
    crashed = [r for r, t in found.items() if t["crashed"]]
    disabled = [r for r, t in found.items() if t.get("disabled")]
    unseen = sum(t.get("unseen", 0) for t in found.values())
    silent = [r for r in range(world) if r not in found]
    unwatched = [r for r, t in found.items() if t.get("unwatched")]
    size_one = {state: {r: t[f"one_rank_{state}"] for r, t in found.items()
                        if t.get(f"one_rank_{state}")} for state in ("wrong", "repaired", "right")}
    verdict = ("UNORDERED" if unordered else "CRASH" if crashed else
               WRONG if size_one["wrong"] else
               "UNWATCHED" if unwatched else "INCOMPLETE" if silent or disabled or unseen else
               "NOT CHECKED" if not reuses else "ordered")
    parts = [f"mfsdp_hotfix audit, {world} rank{'s' if world > 1 else ''}: {verdict}: "
             f"{sum(unordered.values())} unordered of {reuses} gradient-slot reuses"]
    if unordered:
        parts.append(f"unordered on ranks {rank_list(sorted(unordered))}")
    if crashed:
        parts.append(f"'No buffer found' crash on ranks {rank_list(crashed)}")
    defect = f"the size-one group defect ({SINGLE_RANK_GRADS.name})"
    for state, told in (("wrong", "is not repaired there: gradients wrong as shipped"),
                        ("right", "is not repaired there, right with one microbatch per step "
                                  "only"),
                        ("repaired", f"is repaired there by {SINGLE_RANK_REDUCE.id}")):
        if size_one[state]:
            parts.append(f"{sum(size_one[state].values())} gradient buffer(s) whose "
                         f"data-parallel group has one rank on ranks "
                         f"{rank_list(sorted(size_one[state]))}: {defect} {told}")
    if unwatched:
        parts.append(f"a copy or gradient pool the audit cannot watch on ranks "
                     f"{rank_list(unwatched)}")
    if disabled:
        parts.append(f"audit disabled by an error on ranks {rank_list(disabled)}")
    if verdict == "NOT CHECKED":
        parts.append("no gradient-slot reuse was seen: nothing was checked")
    if unseen:
        parts.append(f"{unseen} reuses not judged (their reduce-scatter was not seen)")
    if silent:
        parts.append(f"no report within {timeout_s:g} s from ranks {rank_list(silent)}")
    unwritten = [r for r, t in found.items() if t.get("unwritten")]
    if unwritten:
        parts.append(f"no rank file could be written at {path} on ranks "
                     f"{rank_list(unwritten)} (their warning says why)")
    details = "" if len(unwritten) == len(found) else f" (details: {path}.rank*.json)"
    return verdict, "; ".join(parts) + details


def rank_list(ranks: list[int]) -> str:
    """Ranks as the job line and the command's summary name them: each, or from 8 on the range."""
    return ",".join(map(str, ranks)) if len(ranks) < 8 else \
        f"{ranks[0]}..{ranks[-1]} ({len(ranks)} ranks)"
