"""The runs of a call side by side within its time budget: each set's truths ahead of the runs
compared with them, the runs without TE first while TE is being built, a route whose first runs
all stopped before training given up, and a run the budget would cut not started."""

from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import threading
import time
from typing import Any

import workdir
from side_by_side import run_side_by_side

from .launch import Paths, run_case
from .plan import needs_te, truth_variant
from .stage import SCRIPTS
from .unit_tests import collect_unit_tests, run_unit_tests


def pipelined(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The plan's order, but each set's truths (a configuration's serialized runs, or the
    reference of a ``set``) go one set ahead of its other runs (a run waiting for its truth
    holds a worker; a cut budget still leaves whole sets)."""
    def key(c: dict[str, Any]) -> str:
        return str(c.get("set") or c.get("config", c["id"]))

    def truth(c: dict[str, Any]) -> bool:
        return bool(c.get("serialized") or c.get("judged"))

    out: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []  # the runs of the set whose truths were queued
    current = None
    for c in cases:
        if key(c) != current:
            current = key(c)
            if truth(c):
                out += [x for x in cases if key(x) == current and truth(x)]
            out += pending
            pending = []
        if not truth(c) or c.get("config") is None:
            if c.get("config") is None or any(key(x) == current and truth(x) for x in cases):
                pending.append(c)
            else:
                out.append(c)
    out += pending
    assert sorted(x["id"] for x in out) == sorted(x["id"] for x in cases)
    return out


def te_last(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """While TE is being built, the runs that need it (and those judged by one that needs it)
    after those that do not, each part in its order: a run waiting for TE holds a worker that a
    run without TE could use. A truth stays before the runs compared with it."""
    by_id = {c["id"]: c for c in cases}

    def waits(c: dict[str, Any]) -> bool:
        return needs_te(c) or (bool(c.get("judge")) and needs_te(by_id.get(c["judge"], c)))

    return sorted(cases, key=waits)


FAIL_FAST = 8
COLLECT_TIMEOUT = 180.0  # importing megatron and TE, nothing run
MIN_START_S = 45  # a run started with less of the budget left would be cut
MIN_FREE_DISK = 8 * 2**30  # a run's capture is about half a gigabyte; truths are kept


class Driver:
    def __init__(self, paths: Paths, cycles_per_ms: float, deadline: float, workers: int,
                 case_timeout: float, unit_timeout: float) -> None:
        self.paths = paths
        self.cpm = cycles_per_ms
        self.deadline = deadline
        self.workers = workers
        self.case_timeout = case_timeout
        self.unit_timeout = unit_timeout
        self.truths: dict[str, cf.Future] = {}
        # runs without TE while TE is being built: a few, so that the build keeps its cores
        self.no_te_slots = threading.BoundedSemaphore(max(1, min(workers, 6)))
        self.lock = threading.Lock()
        self.trained: dict[str, list[bool]] = {}  # per route (impl): did each run train?
        self.stopped: dict[str, str] = {}  # route -> why its remaining runs are not started

    def one(self, c: dict[str, Any]) -> dict[str, Any]:
        route = c.get("impl", "te")
        if route in self.stopped:
            return dict(c, outcome="not run", error=self.stopped[route])
        r = self._one(c)
        if c["group"] != "unit" and r["outcome"] != "not run":
            self._count(route, r)
        return r

    def _count(self, route: str, r: dict[str, Any]) -> None:
        """The first ``FAIL_FAST`` runs of a route all stopped before training: an error of the
        harness (or of the machine) is likelier than of the release, and the device time is
        better kept for a fixed harness: the route's remaining runs are not started."""
        with self.lock:
            seen = self.trained.setdefault(route, [])
            seen.append(bool((r.get("capture") or {}).get("iterations")))
            if len(seen) == FAIL_FAST and not any(seen):
                self.stopped[route] = (f"not started: the first {FAIL_FAST} runs of this route "
                                       f"stopped before their first iteration (last: "
                                       f"{str(r.get('error'))[:200]})")

    def _one(self, c: dict[str, Any]) -> dict[str, Any]:
        if c["release"] not in self.paths.src:
            return dict(c, outcome="not run", error="no checkout of this release: none given, "
                        "its megatron/training is not the wheel's, or it lacks "
                        + ", ".join(SCRIPTS) + " (the record's checkouts say which)")
        if c.get("truth_of") in self.truths:
            if self.truths[c["truth_of"]].result()["outcome"] == "not run":
                return dict(c, outcome="not run", error="its serialized run was not run")
        if needs_te(c):
            import engine

            while engine.te_state() == "building" and time.time() < self.deadline - 30:
                time.sleep(2)
            if engine.te_state() == "failed":
                return dict(c, outcome="not run", error="TransformerEngine's setup failed")
        if c["group"] == "unit":
            left = self.deadline - time.time()
            if left < MIN_START_S:
                return dict(c, outcome="not run", error="time budget exhausted")
            missing = self.paths.unit_tests_missing.get(c["release"])
            if missing:
                return dict(c, outcome="not run", error="the checkout lacks modules the unit "
                            "tests import: " + ", ".join(missing))
            collected = collect_unit_tests(c, self.paths, min(COLLECT_TIMEOUT, left))
            if collected["errors"] or not collected["ids"]:
                # pytest runs no test where one module fails to import
                return dict(c, outcome="not run", hotfix=collected["hotfix"],
                            error="collecting the unit tests failed: "
                            + ("; ".join(collected["errors"]) or "none found"))
            left = self.deadline - time.time()
            return run_unit_tests(c, self.paths, min(self.unit_timeout, left), collected["ids"])
        if not needs_te(c) and self.te_building():
            with self.no_te_slots:  # bounded() reads the budget left after the wait
                return self.bounded(c)
        return self.bounded(c)

    def bounded(self, c: dict[str, Any]) -> dict[str, Any]:
        """A run under the case timeout or what is left of the budget; one that the budget cut
        is ``not run`` (a later call runs it), one that outlasted the case timeout a crash."""
        left = self.deadline - time.time()
        if left < MIN_START_S:
            return dict(c, outcome="not run", error="time budget exhausted")
        free = shutil.disk_usage(workdir.run_dir()).free
        if free < MIN_FREE_DISK:
            return dict(c, outcome="not run", error=f"only {free / 2**30:.1f} GiB of disk left")
        r = run_case(c, self.paths, self.cpm, min(self.case_timeout, left))
        if r.get("rc") == "timeout":
            if left < self.case_timeout:
                r.update(outcome="not run", error=f"cut by the time budget after {left:.0f} s")
            else:
                r.update(outcome="crash", error=f"no end within {self.case_timeout:.0f} s")
        return r

    @staticmethod
    def te_building() -> bool:
        import engine

        return bool(engine.te_state() == "building")

    def run_all(self, cases: list[dict[str, Any]], log=print,
                progress=None) -> list[dict[str, Any]]:
        cases = te_last(pipelined(cases)) if self.te_building() else pipelined(cases)
        truths = {}
        for c in cases:
            if c["group"] == "unit" or c.get("judged"):
                continue
            if c.get("judge"):  # judged against its reference (mlm_verdict), not a serialized run
                c["truth"] = os.path.join(workdir.run_dir(), "cases",
                                          c["judge"].replace("|", "_"), "capture.pt")
                c["truth_of"] = c["judge"]
                continue
            key = f"{c['config']}|{truth_variant(c)}"
            if c["serialized"]:
                truths[key] = os.path.join(workdir.run_dir(), "cases",
                                           c["id"].replace("|", "_"), "capture.pt")
            else:
                c["truth"], c["truth_of"] = truths.get(key), key
        return run_side_by_side(cases, self.one, self.workers, self.register,
                                lambda r: log(short(r)), "id", progress)

    def register(self, c: dict[str, Any], f: cf.Future) -> None:
        """What later runs are compared with: a judged run's reference, a serialized run."""
        if c.get("judged"):
            self.truths[c["id"]] = f
        elif c.get("serialized") and c["group"] != "unit":
            self.truths[f"{c['config']}|{truth_variant(c)}"] = f


def short(r: dict[str, Any]) -> str:
    cmp = r.get("comparison") or {}
    extra = f" rel_l2={cmp.get('rel_l2')}" if cmp else ""
    if r.get("audit"):
        extra += f" audit={r['audit']}"
    if r.get("tests"):
        counts: dict[str, int] = {}
        for state in r["tests"].values():
            counts[state.split(":")[0]] = counts.get(state.split(":")[0], 0) + 1
        extra += f" tests={counts}"
    err = "" if r.get("outcome") in ("exact", "ok") else f" {str(r.get('error'))[:200]}"
    return f"{r.get('outcome', '?'):12s} {r['id']}{extra} ({r.get('proc_s', '-')} s){err}"
