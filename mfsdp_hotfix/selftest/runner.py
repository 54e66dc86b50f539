"""Run one case as a pair of worker processes and merge what the two ranks report.

Why subprocesses: the ``torch.cuda`` stand-in must never enter the caller's process, each case
needs a fresh interpreter (one release, hotfix on or off), and gloo has been seen to die
natively now and then; a case whose rank died by a signal is run once more.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mfsdp_hotfix import processes
from mfsdp_hotfix.selftest.spec import CaseResult, CaseSpec

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # folder holding mfsdp_hotfix/


def worker_env(spec: CaseSpec) -> dict[str, str]:
    """Environment of the workers: release first on the path, hotfix switches as the spec says."""
    env = dict(os.environ)
    paths = [spec.path] if spec.path else []
    if spec.python or str(_PACKAGE_ROOT) not in {str(Path(p).resolve()) for p in sys.path if p}:
        paths.append(str(_PACKAGE_ROOT))
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    env.pop("MFSDP_HOTFIX", None)
    env.pop("MFSDP_HOTFIX_DISABLED_FIXES", None)
    env.pop("MFSDP_HOTFIX_AUDIT", None)
    if spec.hotfix == "off":
        env["MFSDP_HOTFIX"] = "0"
    if spec.disabled_fixes:
        env["MFSDP_HOTFIX_DISABLED_FIXES"] = spec.disabled_fixes
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _attempt(spec: CaseSpec, tick: Callable[[float], None] | None) -> tuple[
        list[dict[str, Any] | None], list[int], list[bool], str]:
    """One try of ``spec``: its ranks, started together, ended (with their folder) whatever ends
    the wait, a closed pipe or Ctrl-C included (``processes.supervised``)."""
    with processes.supervised() as children, contextlib.ExitStack() as files:
        tmp = children.temp_dir("mfsdp-selftest-")
        store = os.path.join(tmp, "store")
        env = worker_env(spec)
        if spec.audit:
            env["MFSDP_HOTFIX_AUDIT"] = os.path.join(tmp, "audit")
            # the job summary waits for the peer at exit: well inside the peer-gone kill below
            env.setdefault("MFSDP_HOTFIX_CROSS_RANK_TIMEOUT", "10")
        procs = []
        logs = []
        world = spec.world
        for rank in range(world):
            log = files.enter_context(open(os.path.join(tmp, f"rank{rank}.log"), "w+b"))
            logs.append(log)
            procs.append(children.start(
                [spec.python or sys.executable, "-m", "mfsdp_hotfix.selftest.worker",
                 spec.to_json(),
                 str(rank), str(world), store, tmp],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        started = time.monotonic()
        first_exit: float | None = None
        killed = [False] * world
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if first_exit is None and any(p.poll() is not None for p in procs):
                first_exit = now
            over_time = now - started > spec.timeout_s
            peer_gone = first_exit is not None and now - first_exit > 20.0
            if over_time or peer_gone:  # a rank left; its peer may wait in a collective forever
                for rank, p in enumerate(procs):
                    if p.poll() is None:
                        children.end(p)
                        killed[rank] = True
                break
            if tick is not None:
                tick(now - started)
            time.sleep(0.2)
        codes = [p.wait() for p in procs]
        reports: list[dict[str, Any] | None] = []
        for rank in range(world):
            path = Path(tmp) / f"rank{rank}.json"
            reports.append(json.loads(path.read_text()) if path.exists() else None)
            if reports[-1] is not None:  # the audit's own file, as a user would read it
                audit_file = Path(tmp) / f"audit.rank{rank}.json"
                reports[-1]["audit_file"] = (json.loads(audit_file.read_text())
                                             if audit_file.exists() else None)
        tail = ""
        for rank, log in enumerate(logs):
            log.seek(0)
            text = log.read().decode(errors="replace")
            why = " (killed by the harness: peer gone or over time)" if killed[rank] else ""
            tail += f"--- rank {rank} (exit {codes[rank]}{why}) ---\n{text[-3000:]}\n"
        return reports, codes, killed, tail


def run_case(spec: CaseSpec, tick: Callable[[float], None] | None = None) -> CaseResult:
    """Run ``spec`` on two ranks; rerun once if a rank died by a signal without reporting."""
    started = time.monotonic()
    attempts = 0
    while True:
        attempts += 1
        reports, codes, killed, tail = _attempt(spec, tick)
        # A signal we did not send (SIGSEGV, SIGABRT from malloc) before the rank reported.
        died = any(r is None and c < 0 and not k
                   for r, c, k in zip(reports, codes, killed, strict=True))
        if not died or attempts >= 2:
            break
    result = merge(spec, reports, codes, tail)
    result.attempts = attempts
    result.wall_s = time.monotonic() - started
    return result


def merge(spec: CaseSpec, reports: list[dict[str, Any] | None], codes: list[int],
          tail: str) -> CaseResult:
    result = CaseResult(spec=spec, returncodes=list(codes), log_tail=tail[-6000:])
    present = [r for r in reports if r is not None]
    result.crashed = len(present) < len(reports) or any(r.get("crashed", True) for r in present)
    for report in present:
        if report.get("exception") and not result.exception:
            result.exception = str(report["exception"])
            result.traceback = report.get("traceback")
    if len(present) < len(reports) and not result.exception:
        missing = [i for i, r in enumerate(reports) if r is None]
        result.exception = f"rank(s) {missing} reported nothing (exit codes {codes})"
    result.cannot_import = next((r["cannot_import"] for r in present if r.get("cannot_import")),
                                None)
    rank0 = reports[0] or {}
    result.grads_compared = int(rank0.get("grads_compared") or 0)
    result.max_abs_grad_error = rank0.get("max_abs_grad_error")
    result.max_rel_grad_error = rank0.get("max_rel_grad_error")
    result.grad_digest = rank0.get("grad_digest")
    result.worst_grads = dict(rank0.get("worst_grads") or {})
    orderings = [r["ordering"] for r in present if "ordering" in r]
    if orderings:
        result.ordering_checks = sum(int(o["checks"]) for o in orderings)
        result.ordering_violations = sum(int(o["violations"]) for o in orderings)
        result.first_violations = [v for o in orderings for v in o["first_violations"]][:5]
    if spec.audit:
        _merge_audit(result, present)
    result.release = dict(rank0.get("release") or (present[0].get("release") if present else {})
                          or {})
    result.grad_reduce = rank0.get("grad_reduce")
    result.hotfix_status = rank0.get("hotfix_status")
    worker_times = [float(r["worker_s"]) for r in present if "worker_s" in r]
    result.worker_s = max(worker_times) if worker_times else None
    loop_times = [float(r["fsdp_s"]) for r in present if "fsdp_s" in r]
    result.fsdp_s = max(loop_times) if loop_times else None
    return result


def _merge_audit(result: CaseResult, present: list[dict[str, Any]]) -> None:
    """The audit's counts from the rank files it wrote (what a user reads), summed over ranks."""
    from mfsdp_hotfix.audit.summary import summarise

    files = [r["audit_file"] for r in present if r.get("audit_file")]
    result.audit_files = len(files)
    result.audit_verdict = summarise({int(f.get("rank", i)): f
                                      for i, f in enumerate(files)}, "audit")[0]
    if not files:
        result.audit_state = "no rank file written"
        return
    result.audit_report = files[0]
    copies = [c for f in files for c in f.get("copies", [])]
    result.audit_reuses = sum(int(c.get("reuses", 0)) for c in copies)
    result.audit_unordered = sum(int(c.get("unordered", 0)) for c in copies)
    result.audit_crashed = any(c.get("crashed") for c in copies)
    # A rank that neither trained a step nor saw a reuse or crash (its peer crashed) writes none.
    result.audit_state = "; ".join(sorted({str(f.get("audit")) for f in files}))
