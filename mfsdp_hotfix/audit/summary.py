"""The ``mfsdp-hotfix audit`` command's summary of the rank files: the job's verdict, one line per
Megatron-FSDP copy summed over the ranks that imported it, and the ranks whose counts are
missing or partial. It needs neither torch nor megatron.
"""

from __future__ import annotations

import json
from typing import Any

from ..fix_catalogue import FIXES
from ..release_defects import SINGLE_RANK_GRADS
from .job_line import rank_list
from .verdicts import WRONG, copy_verdict, is_used, one_rank, worst


def summarise(reports: dict[int, dict[str, Any]], path: str, unwritable: str | None = None
              ) -> tuple[str, list[str]]:
    """A verdict (one of :data:`VERDICTS`) and the lines that explain it, from the rank
    files; ``unwritable``: why rank files cannot be written at ``path`` (:func:`probe`)."""
    if not reports:
        return _no_rank_files(path, unwritable)
    per_copy = _per_copy(reports)
    lines = []
    copy_verdicts = []
    for key, entry in per_copy.items():
        verdict = worst([v for v, _ in entry["verdicts"]])
        if entry["used"]:
            copy_verdicts.append(verdict)
        lines += _copy_lines(key, entry, verdict)
    incomplete, rank_lines = _rank_gaps(reports)
    lines += rank_lines
    if not copy_verdicts:
        lines.append("no Megatron-FSDP copy in the rank files built a gradient pool"
                     if per_copy else "no Megatron-FSDP copy was imported in the ranks that "
                     "wrote files")
    found = copy_verdicts or ["NOT CHECKED"]
    if incomplete:
        found.append("INCOMPLETE")
    return worst(found), lines


def _no_rank_files(path: str, unwritable: str | None) -> tuple[str, list[str]]:
    """The verdict and its lines where no rank wrote a file: ``unwritable`` says why none
    could; else what happened, which rank files of a training process would have told."""
    if unwritable:
        return "UNWRITABLE", [f"no rank file {path}.rank<N>.json: {unwritable}"]
    return "NO DATA", [
        f"no rank file {path}.rank<N>.json was written",
        "if a process should have: a launcher that does not pass PYTHONPATH and "
        "MFSDP_HOTFIX_AUDIT on to its ranks, a job that ended before its first step, or ranks "
        "that could not write there (each warns on stderr); `mfsdp-hotfix selftest` does not "
        "pass the audit on to its ranks: use `mfsdp-hotfix selftest --audit`"]


def _per_copy(reports: dict[int, dict[str, Any]]
              ) -> dict[tuple[str, str, str, str], dict[str, Any]]:
    """The ranks' records of each Megatron-FSDP copy (package, version, era, fixes applied),
    summed over the ranks that imported it."""
    per_copy: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    for rank, report in sorted(reports.items()):
        for copy in report.get("copies", []):
            key = (str(copy.get("package")), str(copy.get("version")), str(copy.get("era")),
                   ", ".join(sorted(copy.get("fixes") or [], key=_catalogue_order)) or "none")
            entry = per_copy.setdefault(key, {
                "ranks": [], "reuses": 0, "unordered": 0, "unseen": 0, "crashed": [], "first": None,
                "notes": set(), "verdicts": [], "size_one": {}, "used": False, "pools": {}})
            entry["verdicts"].append(copy_verdict(copy))
            size_one = one_rank(copy)
            if size_one is not None:
                entry["size_one"].setdefault(size_one[2], []).append(rank)
            entry["used"] = entry["used"] or is_used(copy)
            pools = entry["pools"]
            for pool, reuses in (copy.get("grad_pools") or {}).items():
                unordered = (copy.get("grad_pools_unordered") or {}).get(pool, 0)
                was = pools.get(pool, (0, 0))
                pools[pool] = (was[0] + unordered, was[1] + reuses)
            entry["ranks"].append(rank)
            entry["reuses"] += int(copy.get("reuses", 0))
            entry["unordered"] += int(copy.get("unordered", 0))
            entry["unseen"] += int(copy.get("unseen", 0))
            if copy.get("unordered"):
                entry["first"] = entry["first"] or (rank, copy.get("first_unordered"))
            if copy.get("crashed"):
                entry["crashed"].append((rank, copy.get("crash")))
            if copy.get("note"):
                entry["notes"].add(copy["note"])
    return per_copy


def _catalogue_order(fix: str) -> tuple[int, str]:
    """Fixes in the catalogue's order, as ``status`` lists them (an unknown one last)."""
    order = [known.id for known in FIXES]
    return (order.index(fix) if fix in order else len(order), fix)


def _copy_lines(key: tuple[str, str, str, str], entry: dict[str, Any], verdict: str
                ) -> list[str]:
    """One copy's line with its ``verdict`` over the ranks, and the details under it."""
    package, version, era, fixes = key
    why = next((w for v, w in entry["verdicts"] if v == verdict and w), None)
    lines = [f"{package} {version} (era {era}), ranks {rank_list(entry['ranks'])}: {verdict}: "
             f"{entry['unordered']} unordered of {entry['reuses']} gradient-slot reuses",
             f"  hotfix fixes applied: {fixes}"]
    if entry["unseen"]:
        lines.append(f"  {entry['unseen']} more not judged: their reduce-scatter was not seen")
    if why and verdict in ("UNWATCHED", "NOT CHECKED"):
        lines.append(f"  why: {why.split('; ', 1)[0] if entry['size_one'] else why}")
    for words, ranks in entry["size_one"].items():
        lines.append(f"  one-rank gradient buffers, ranks {rank_list(ranks)}: {words}")
    if verdict == WRONG:
        lines.append("  workarounds without the hotfix: "
                     + "; or ".join(SINGLE_RANK_GRADS.workarounds))
    if entry["pools"]:
        lines.append("  gradient pools: " + ", ".join(
            f"{pool}: {u} unordered of {n}" for pool, (u, n) in entry["pools"].items()))
    if entry["first"]:
        rank, first = entry["first"]
        lines.append(f"  first unordered reuse (rank {rank}): {json.dumps(first)}")
    for rank, crash in entry["crashed"][:3]:
        lines.append(f"  crashed on rank {rank}: {json.dumps(crash)}")
    lines += [f"  note: {note}" for note in sorted(entry["notes"])]
    return lines


def _rank_gaps(reports: dict[int, dict[str, Any]]) -> tuple[bool, list[str]]:
    """Lines on the ranks whose counts are missing or partial, and whether that leaves the job
    incomplete (a rank with no file, or whose audit was disabled)."""
    disabled = {r: rep.get("audit") for r, rep in reports.items() if rep.get("audit", "on") != "on"}
    lines = [f"  audit {why} on rank {rank}: counts there are incomplete"
             for rank, why in sorted(disabled.items())]
    worlds = {int(rep.get("world_size") or 0) for rep in reports.values()}
    world = max(worlds) if worlds else 0
    missing = [r for r in range(world) if r not in reports]
    if missing:
        lines.append(f"no rank file from ranks {rank_list(missing)} of {world}")
    unfinished = [r for r, rep in reports.items() if not rep.get("final")]
    if unfinished:
        lines.append(f"rank files not final (the process did not exit normally) on ranks "
                     f"{rank_list(sorted(unfinished))}")
    return bool(missing or disabled), lines
