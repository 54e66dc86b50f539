"""What the audit leaves behind: one JSON file per rank, one summary line per job, and the
``mfsdp-hotfix audit`` command's reading of the files.

Rank file ``<path>.rank<N>.json``: ``{"rank", "world_size", "final", "finish_grad_sync_calls",
"audit", "copies": [{"package", "version", "era", "fixes", "audited", "reuses", "unordered",
"unseen", "first_unordered", "crashed", "crash", "note", "one_rank_grads"}]}``. ``unseen``: slot
reuses after a reduce-scatter whose event the audit never saw recorded (it was armed late, or the
code records events in a way it does not observe); they are not judged. ``one_rank_grads``: the
copy's ZeRO-2/3 gradient buffers whose data-parallel group has one rank (null: none), which the
size-one group defect (``release_defects.SINGLE_RANK_GRADS``) makes wrong unless repaired.

The file is written after every ``finish_grad_sync`` (so a job killed mid-run still leaves its
last step's counts) and at exit (a crash is recorded then): one small file per rank, written to
a temporary file and renamed, so a reader never sees half a file.

Job summary: at exit, each rank publishes its totals in the process group's key-value store (the
one the cross-rank check uses, with its switch and timeout); rank 0 waits for them and logs one
line. Neither a file that cannot be written nor a failing store stops the job: one warning each.
Reading rank files needs neither torch nor megatron.
"""

from __future__ import annotations

import errno
import glob
import json
import logging
import os
import re
from datetime import timedelta
from typing import Any

from ..fix_catalogue import SINGLE_RANK_REDUCE
from ..release_defects import SINGLE_RANK_GRADS

log = logging.getLogger("mfsdp_hotfix")

STORE_PREFIX = "mfsdp_hotfix/audit/"
# A command killed by signal N exits, as the shell reports it, with this plus N.
SIGNALLED = 128


def rank_file(path: str, rank: int) -> str:
    return f"{path}.rank{rank}.json"


class RankFile:
    """Writes one rank's report, whole."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.written = 0

    def write(self, report: dict[str, Any]) -> str:
        """Write ``report`` now; returns the file name. Raises OSError on failure."""
        target = rank_file(self.path, int(report["rank"]))
        folder = os.path.dirname(target)
        if folder:
            os.makedirs(folder, exist_ok=True)
        temporary = f"{target}.{os.getpid()}.tmp"
        with open(temporary, "w") as handle:
            json.dump(report, handle, indent=1, sort_keys=True, default=str)
        os.replace(temporary, target)
        self.written += 1
        return target


def probe(path: str) -> str | None:
    """Why a rank file ``path.rank<N>.json`` cannot be written (None: it can). As root,
    ``os.access`` says yes to everything, so this creates a file and removes it: beside the rank
    files when their folder exists, else in the nearest folder above (where it would be made)."""
    folder = os.path.dirname(path) or "."
    target = f"{path}.probe{os.getpid()}.tmp"
    while not os.path.isdir(folder):
        if os.path.exists(folder) or os.path.dirname(folder) == folder:
            return f"{folder} is not a folder"
        folder = os.path.dirname(folder)
        target = os.path.join(folder, f".mfsdp-hotfix-probe{os.getpid()}.tmp")
    try:
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.remove(target)
    except OSError as exc:
        if exc.errno == errno.ENOENT and os.path.isdir(folder):
            # The folder is there: its filesystem makes no new files (proc answers ENOENT,
            # whose own words, "No such file or directory", would send the user looking for it).
            kind = _filesystem(folder)
            return (f"cannot create a file in {folder}: "
                    + (f"it is on a {kind} filesystem, which" if kind else "its filesystem")
                    + " takes no new files")
        return f"cannot create a file in {folder} ({exc.strerror or exc})"
    return None


def _filesystem(folder: str) -> str | None:
    """The type of the filesystem ``folder`` is on, from ``/proc/self/mounts`` (None: unknown)."""
    where = os.path.realpath(folder)
    best, kind = "", None
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = where == point or where.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        return None
    return kind


# The verdicts, worst first: (meaning, what to do, exit status of ``mfsdp-hotfix audit`` when
# the command itself exited 0). Only ``ordered`` means something was checked and found right.
VERDICTS: dict[str, tuple[str, str, int]] = {
    "UNORDERED": ("a gradient-buffer slot was reused by a stream not ordered after the "
                  "reduce-scatter still reading it: on a GPU, silent gradient corruption",
                  "load the hotfix, or run with fsdp_double_buffer=False; with the hotfix "
                  "loaded, report it with the rank files", 3),
    "CRASH": ("the release's double buffer crashed ('No buffer found for bucket_id', era A): "
              "Megatron-FSDP's own code raised it; frames of mfsdp_hotfix/patching.py and "
              "mfsdp_hotfix/slot_reuse.py in the traceback are the audit's observer, which "
              "passes the release's errors on unchanged",
              "load the hotfix, or run with fsdp_double_buffer=False", 3),
    "WRONG GRADIENTS": ("a ZeRO-2/3 gradient buffer's data-parallel group has one rank "
                        "(data-parallel size 1; experts with expert-parallel size equal to the "
                        "data-parallel size) and the release defect "
                        "single-rank-grads-reduced-every-microbatch is not repaired there: the "
                        "releases reduce that buffer in every microbatch, so its gradients are "
                        "wrong as shipped (the lines above say which buffers, and why the "
                        "repair is missing)",
                        "load the hotfix, whose single-rank-reduce repairs it (`mfsdp-hotfix "
                        "status --verbose` says whether it applies); without it, the "
                        "workarounds above", 3),
    "UNWATCHED": ("a Megatron-FSDP copy, or a gradient pool it built, is of a shape the audit "
                  "cannot watch (an allocator or hooks it does not know): nothing about it was "
                  "checked",
                  "read the note above; run with fsdp_double_buffer=False, or report the "
                  "release with `mfsdp-hotfix status --json`", 4),
    "INCOMPLETE": ("some ranks wrote no file, their audit was disabled by an error, or some "
                   "reuses could not be judged: what was checked is not the whole job",
                   "see the lines above; rerun with a path every rank can write", 4),
    "NOT CHECKED": ("the audit watched the job but saw no gradient-slot reuse: no gradient "
                    "pool was built (fsdp_double_buffer=False; or ZeRO-1/2 through "
                    "megatron-core's adapter, which makes no FSDP unit on the releases) or its "
                    "slots were never handed out (one data-parallel rank; ZeRO-1: gradients not "
                    "sharded): there was nothing to check",
                    "nothing to fix where no pool was built; otherwise run at least one full "
                    "step with 2+ ranks, ZeRO-2/3 and 3+ FSDP units", 4),
    "ordered": ("every gradient-slot reuse the audit saw was ordered after the reduce-scatter "
                "that last read the slot", "nothing", 0),
    "UNWRITABLE": ("no rank file could be written where the audit was told to write them, "
                   "so nothing the ranks counted is here",
                   "give --out (or MFSDP_HOTFIX_AUDIT) a path every rank can write", 4),
    "NO DATA": ("no rank wrote a file: the hotfix was not loaded in the training processes, "
                "no Megatron-FSDP copy was imported, no finish_grad_sync() ran, or the ranks "
                "could not write there (each rank's warning says so)",
                "run through `mfsdp-hotfix audit` or the installed bootstrap", 4),
}
_ORDER = list(VERDICTS)


def worst(verdicts: list[str]) -> str:
    """The first of ``verdicts`` in the order of :data:`VERDICTS`."""
    return min(verdicts, key=_ORDER.index)


FOUND = 3  # the exit status of a finding: UNORDERED, CRASH or WRONG GRADIENTS
WRONG = "WRONG GRADIENTS"


def exit_status(verdict: str, command_status: int) -> int:
    """``mfsdp-hotfix audit``'s exit status (docs/CLI.md, "Exit statuses"): 3 for a finding
    whatever the command's status (a crash fails the command, and is the finding); else the
    command's when it failed (128 + N after signal N); else the verdict's (0 only for
    ``ordered``, 4 for a verdict that checked nothing or not everything)."""
    if VERDICTS[verdict][2] == FOUND:
        return FOUND
    if command_status < 0:  # killed by a signal
        return SIGNALLED - command_status
    return command_status or VERDICTS[verdict][2]


def one_rank(copy: dict[str, Any]) -> tuple[str, int, str] | None:
    """The size-one group defect in one copy's record: ``(state, buffers, words)``, the state
    ``wrong`` (not repaired, and this job is in its configuration), ``repaired`` (by
    single-rank-reduce) or ``right`` (not repaired, but one microbatch per step on a release
    that gets that right); None where no ZeRO-2/3 gradient buffer has a one-rank group or the
    copy's code has no such defect. A release that may add the buffer onto itself
    (``may_self_add``) is wrong from one microbatch on, and under HSDP not repaired."""
    found = copy.get("one_rank_grads")
    if not found or found.get("defect") == "no":
        return None
    dense, expert, hybrid = (int(found.get(k) or 0) for k in ("dense", "expert", "hsdp"))
    kinds = [f"{n} {kind}" for n, kind in ((dense, "dense"), (expert, "expert")) if n]
    buffers = (" and ".join(kinds) + " ZeRO-2/3 gradient buffer(s) whose data-parallel group "
               "has one rank" + (f" ({hybrid} of them under HSDP: a DP-Shard group of one "
                                 "rank)" if hybrid else ""))
    defect = f"the size-one group defect ({SINGLE_RANK_GRADS.name})"
    applied = SINGLE_RANK_REDUCE.id in (copy.get("fixes") or [])
    self_add = found.get("may_self_add", True)
    if applied and not (hybrid and self_add):
        return "repaired", dense + expert, (f"{buffers}: {defect} applies to this job and is "
                                            f"repaired by {SINGLE_RANK_REDUCE.id}")
    why = (f"{SINGLE_RANK_REDUCE.id} does not cover it here: not covered is "
           f"{SINGLE_RANK_GRADS.not_covered}, and a copy without such a release's label or a "
           "later one is taken as one of those" if applied else
           f"{SINGLE_RANK_REDUCE.id} is not applied to this copy (the hotfix is off, or the fix "
           "is disabled, refused or unverified: `mfsdp-hotfix status --verbose` says which)")
    if found.get("defect") != "yes":
        why += ", and the hotfix does not know its hooks' code shape, so it may have the defect"
    microbatches = int(found.get("microbatches") or 0)
    if microbatches == 1 and not self_add:
        return "right", dense + expert, (
            f"{buffers}: {defect} applies and is not repaired, because {why}; this job "
            f"accumulated one microbatch per step, which {copy.get('version')} gets right, but "
            "with 2 or more its gradients are wrong: load the hotfix")
    steps = (f"up to {microbatches} microbatches per step" if microbatches > 1 else
             "1 microbatch per step" if microbatches else "microbatches per step not seen")
    return "wrong", dense + expert, (f"{buffers}: {defect} is not repaired, because {why}; "
                                     f"its gradients are wrong as shipped ({steps})")


def copy_verdict(copy: dict[str, Any]) -> tuple[str, str | None]:
    """One copy's verdict on one rank (or summed over ranks), and why when it is not a count
    (or, where a one-rank gradient buffer has the size-one group defect, what it is)."""
    verdict, why = _slot_verdict(copy)
    size_one = one_rank(copy)
    if size_one is None:
        return verdict, why
    state, _, words = size_one
    if state == "wrong" and worst([verdict, WRONG]) == WRONG:
        return WRONG, words
    if verdict == "NOT CHECKED":
        return verdict, f"{why}; {words}"
    return verdict, why


def _slot_verdict(copy: dict[str, Any]) -> tuple[str, str | None]:
    pools = copy.get("grad_pools")
    if copy.get("audited") is False:
        return "UNWATCHED", copy.get("note") or "not audited"
    if copy.get("unwatched_pools"):
        return "UNWATCHED", ("gradient pool(s) " + ", ".join(copy["unwatched_pools"])
                             + " built from a class the audit does not watch")
    if int(copy.get("unordered", 0)):
        return "UNORDERED", None
    if copy.get("crashed"):
        return "CRASH", None
    if int(copy.get("unseen", 0)):
        return "INCOMPLETE", f"{copy['unseen']} reuses not judged (reduce-scatter not seen)"
    if not int(copy.get("reuses", 0)):
        if pools == {}:
            return "NOT CHECKED", ("no gradient pool was built (fsdp_double_buffer off, or no "
                                   "FSDP unit)")
        return "NOT CHECKED", ("gradient pool(s) " + ", ".join(pools or {}) + " built, no slot "
                               "reused" if pools else "no gradient-slot reuse seen")
    return "ordered", None


def _used(copy: dict[str, Any]) -> bool:
    """A copy that built a gradient pool, saw anything, could not be watched, or built a
    one-rank gradient buffer that has the size-one group defect."""
    return copy.get("grad_pools") != {} or bool(
        copy.get("reuses") or copy.get("crashed") or copy.get("unseen")
        or copy.get("unwatched_pools") or copy.get("audited") is False) \
        or one_rank(copy) is not None


def totals(report: dict[str, Any]) -> dict[str, int]:
    """One rank's numbers, summed over its copies."""
    copies = report.get("copies", [])
    used = [c for c in copies if _used(c)]
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
        parts.append(f"unordered on ranks {_ranks(sorted(unordered))}")
    if crashed:
        parts.append(f"'No buffer found' crash on ranks {_ranks(crashed)}")
    defect = f"the size-one group defect ({SINGLE_RANK_GRADS.name})"
    for state, told in (("wrong", "is not repaired there: gradients wrong as shipped"),
                        ("right", "is not repaired there, right with one microbatch per step "
                                  "only"),
                        ("repaired", f"is repaired there by {SINGLE_RANK_REDUCE.id}")):
        if size_one[state]:
            parts.append(f"{sum(size_one[state].values())} gradient buffer(s) whose "
                         f"data-parallel group has one rank on ranks "
                         f"{_ranks(sorted(size_one[state]))}: {defect} {told}")
    if unwatched:
        parts.append(f"a copy or gradient pool the audit cannot watch on ranks "
                     f"{_ranks(unwatched)}")
    if disabled:
        parts.append(f"audit disabled by an error on ranks {_ranks(disabled)}")
    if verdict == "NOT CHECKED":
        parts.append("no gradient-slot reuse was seen: nothing was checked")
    if unseen:
        parts.append(f"{unseen} reuses not judged (their reduce-scatter was not seen)")
    if silent:
        parts.append(f"no report within {timeout_s:g} s from ranks {_ranks(silent)}")
    unwritten = [r for r, t in found.items() if t.get("unwritten")]
    if unwritten:
        parts.append(f"no rank file could be written at {path} on ranks {_ranks(unwritten)} "
                     "(their warning says why)")
    details = "" if len(unwritten) == len(found) else f" (details: {path}.rank*.json)"
    return verdict, "; ".join(parts) + details


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks)) if len(ranks) < 8 else \
        f"{ranks[0]}..{ranks[-1]} ({len(ranks)} ranks)"


# ---- reading (the CLI)
def rank_files(path: str) -> dict[int, str]:
    """The rank files of ``path`` present now, by rank."""
    pattern = re.compile(re.escape(os.path.basename(path)) + r"\.rank(\d+)\.json$")
    found = {}
    for name in sorted(glob.glob(glob.escape(path) + ".rank*.json")):
        match = pattern.search(os.path.basename(name))
        if match is not None:
            found[int(match.group(1))] = name
    return found


def read_rank_files(path: str) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """The rank files of ``path``, and those that could not be read."""
    reports: dict[int, dict[str, Any]] = {}
    unreadable: list[str] = []
    for rank, name in rank_files(path).items():
        try:
            with open(name) as handle:
                reports[rank] = json.load(handle)
        except (OSError, ValueError) as exc:
            unreadable.append(f"{name} ({exc})")
    return reports, unreadable


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
    """The verdict and its line where no rank wrote a file: ``unwritable`` says why none could."""
    if unwritable:
        return "UNWRITABLE", [f"no rank file {path}.rank<N>.json: {unwritable}"]
    return "NO DATA", [f"no rank file {path}.rank<N>.json was written: no Megatron-FSDP "
                       "copy was imported, the hotfix was not loaded in the training "
                       "processes (run through `mfsdp-hotfix audit` or the installed "
                       "bootstrap), no finish_grad_sync() ran, the ranks could not write "
                       "there (each says so in a warning), or the command did not pass "
                       "MFSDP_HOTFIX_AUDIT on to them (`mfsdp-hotfix selftest` does not: "
                       "use `mfsdp-hotfix selftest --audit`)"]


def _per_copy(reports: dict[int, dict[str, Any]]
              ) -> dict[tuple[str, str, str, str], dict[str, Any]]:
    """The ranks' records of each Megatron-FSDP copy (package, version, era, fixes applied),
    summed over the ranks that imported it."""
    per_copy: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    for rank, report in sorted(reports.items()):
        for copy in report.get("copies", []):
            key = (str(copy.get("package")), str(copy.get("version")), str(copy.get("era")),
                   ", ".join(copy.get("fixes") or []) or "none")
            entry = per_copy.setdefault(key, {
                "ranks": [], "reuses": 0, "unordered": 0, "unseen": 0, "crashed": [], "first": None,
                "notes": set(), "verdicts": [], "size_one": {}, "used": False, "pools": {}})
            entry["verdicts"].append(copy_verdict(copy))
            size_one = one_rank(copy)
            if size_one is not None:
                entry["size_one"].setdefault(size_one[2], []).append(rank)
            entry["used"] = entry["used"] or _used(copy)
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


def _copy_lines(key: tuple[str, str, str, str], entry: dict[str, Any], verdict: str
                ) -> list[str]:
    """One copy's line with its ``verdict`` over the ranks, and the details under it."""
    package, version, era, fixes = key
    why = next((w for v, w in entry["verdicts"] if v == verdict and w), None)
    lines = [f"{package} {version} (era {era}, hotfix fixes applied: {fixes}), ranks "
             f"{_ranks(entry['ranks'])}: {verdict}: {entry['unordered']} unordered of "
             f"{entry['reuses']} gradient-slot reuses"
             + (f" ({entry['unseen']} more not judged: their reduce-scatter was not "
                "seen)" if entry["unseen"] else "")
             + (f" [{why}]" if why and verdict in ("UNWATCHED", "NOT CHECKED") else "")]
    if verdict != "NOT CHECKED":  # its reason in brackets says it already
        for words, ranks in entry["size_one"].items():
            lines.append(f"  one-rank gradient buffers, ranks {_ranks(ranks)}: {words}")
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
        lines.append(f"no rank file from ranks {_ranks(missing)} of {world}")
    unfinished = [r for r, rep in reports.items() if not rep.get("final")]
    if unfinished:
        lines.append(f"rank files not final (the process did not exit normally) on ranks "
                     f"{_ranks(sorted(unfinished))}")
    return bool(missing or disabled), lines
