"""The audit's rank files: one JSON file per rank, ``<path>.rank<N>.json``, written by each rank
and read by the ``mfsdp-hotfix audit`` command.

Rank file ``<path>.rank<N>.json``: ``{"rank", "world_size", "final", "finish_grad_sync_calls",
"audit", "copies": [{"package", "version", "era", "fixes", "audited", "reuses", "unordered",
"unseen", "first_unordered", "crashed", "crash", "note", "one_rank_grads"}]}``. ``unseen``: slot
reuses after a reduce-scatter whose event the audit never saw recorded (it was armed late, or the
code records events in a way it does not observe); they are not judged. ``one_rank_grads``: the
copy's ZeRO-2/3 gradient buffers whose data-parallel group has one rank (null: none), which the
size-one group defect (``release_defects.SINGLE_RANK_GRADS``) makes wrong unless repaired.

The file is written after every ``finish_grad_sync`` (so a job killed mid-run still leaves its
last step's counts) and at exit (a crash is recorded then): one small file per rank, written to
a temporary file and renamed, so a reader never sees half a file. A file that cannot be written
does not stop the job: one warning. Reading rank files needs neither torch nor megatron.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import re
from typing import Any


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
