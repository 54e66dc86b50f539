"""The cases of a call side by side within its time budget: those that need no TE first while TE
is built (on few workers, so that the build keeps its cores), each case in a folder of its own, a
case that the budget would cut not started, and a case that fails in any way recorded as such
without touching the others."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import traceback
from typing import Any

import engine
from megatron_lm.plan import needs_te
from side_by_side import run_side_by_side

from .command import command, run
from .plan import CHECK_OVERHEAD_S, RUN_S, RUN_TIMEOUT_S
from .reading import case_result

NO_TE_SLOTS = 4  # while TE builds on 12 of the 16 cores


class Driver:
    def __init__(self, scripts: dict[str, str], release_dirs: dict[str, str], folder: str,
                 deadline: float, workers: int) -> None:
        self.scripts = scripts
        self.release_dirs = release_dirs
        self.folder = folder
        self.deadline = deadline
        self.workers = workers
        self.no_te = threading.BoundedSemaphore(NO_TE_SLOTS)
        self.per_run: list[float] = []  # seconds per run of the checks that ended so far

    def one(self, c: dict[str, Any]) -> dict[str, Any]:
        """A case's result; whatever goes wrong in the harness is this case's record alone."""
        try:
            return self._one(c)
        except Exception as exc:  # the other cases go on; this one says why it has no result
            return dict(c, outcome="harness error", error=f"{type(exc).__name__}: {exc}",
                        traceback=traceback.format_exc()[-3000:])

    def _one(self, c: dict[str, Any]) -> dict[str, Any]:
        if c["release"] not in self.scripts:
            return dict(c, outcome="not run", error="no staged Megatron-LM checkout of this "
                        "release whose megatron/training is the wheel's (the record's "
                        "checkouts say why)")
        if needs_te(c):
            while engine.te_state() == "building" and time.time() < self.deadline:
                time.sleep(2)
            if engine.te_state() not in ("ready", "absent"):
                return dict(c, outcome="not run", error=f"TransformerEngine's setup: "
                            f"{engine.te_state()}")
            return self.bounded(c)
        with self.no_te if engine.te_state() == "building" else contextlib.nullcontext():
            return self.bounded(c)

    def bounded(self, c: dict[str, Any]) -> dict[str, Any]:
        """The check, if the budget left holds its estimate; ended past the budget, or a minute
        past the command's own time limit for its runs (a command that hangs itself)."""
        left, need = self.deadline - time.time(), self.needed(c)
        if left < need:
            return dict(c, outcome="not run", error=f"time budget: {left:.0f} s left, the "
                        f"check takes about {need:.0f} s")
        folder = os.path.join(self.folder, c["id"].replace("|", "_").replace(",", "_"))
        os.makedirs(folder)
        out = os.path.join(folder, "parity")  # the command's own folder: it makes it
        argv, env, added = command(c, self.scripts[c["release"]],
                                   self.release_dirs[c["release"]], out)
        t0 = time.time()
        limit = c["runs"] * RUN_TIMEOUT_S + 60
        rc, stdout, stderr = run(argv, env, folder, min(left, limit))
        wall = round(time.time() - t0, 1)
        if rc != "timeout":
            self.per_run.append(wall / c["runs"])
        return case_result(dict(c, argv=argv, env_added=added, cwd=folder, rc=rc, wall_s=wall,
                                cut=rc == "timeout" and left < limit), stdout, stderr)

    def needed(self, c: dict[str, Any]) -> float:
        """Seconds a check will take: its runs at the median pace of the checks that ended on
        this machine (at first the plan's estimate), and the command's own overhead."""
        pace = sorted(self.per_run)[len(self.per_run) // 2] if self.per_run else RUN_S
        return c["runs"] * max(pace, RUN_S) + CHECK_OVERHEAD_S

    def run_all(self, cases: list[dict[str, Any]], log=print, progress=None
                ) -> list[dict[str, Any]]:
        if engine.te_state() == "building":  # the cases without TE first, each part in order
            cases = sorted(cases, key=needs_te)
        return run_side_by_side(cases, self.one, self.workers, lambda c, f: None,
                                lambda r: log(short(r)), "id", progress)


def short(r: dict[str, Any]) -> str:
    """One line a case leaves on the console."""
    rel = r.get("first_grad_norm_rel")
    extra = f" grad-norm rel {rel:.2g}" if isinstance(rel, float) else ""
    if r.get("shipped_verdict"):
        extra += f" shipped: {r['shipped_verdict']}"
    err = f" {str(r.get('error'))[:200]}" if r.get("error") else ""
    return (f"{r.get('verdict') or r.get('outcome', '?'):15s} {r['id']} rc={r.get('rc')}"
            f"{extra} ({r.get('wall_s', '-')} s){err}")
