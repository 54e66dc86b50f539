#!/usr/bin/env python3
"""Runs many harness cases on one GPU: worker processes, each importing torch, the release and
(optionally) TransformerEngine once and running a list of cases in-process.

A *job* is one process: its environment fixes what is per process (release on ``PYTHONPATH``,
``CUDA_LAUNCH_BLOCKING``, ``MFSDP_HOTFIX``, ``MFSDP_HOTFIX_AUDIT``, ``TORCH_CUDA_SANITIZER``, TE);
its ``specs`` are ``harness.run_case`` specs. Worker mode (``engine.py --job FILE``) appends one
JSON line per case to the job's result file and exits 3 when a case left the CUDA context
unusable; the driver (:class:`Engine`) then records that case as a crash and re-queues the rest.
Result files live in the run's own folder (``workdir.run_dir()``), records are matched to the
job's cases by id, and a run that ends with a planned case unrecorded raises.

The driver keeps at most ``limit()`` workers running, holds TE jobs until TransformerEngine is
ready (``te_state``), respects a wall deadline (a job cut by it keeps the records it wrote; the
cases it did not reach are recorded as ``not run``), and runs jobs in queue order, so a job that
compares with serialized truths must come after the job that writes them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import comparison
import release_wheels
import workdir

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# short name -> (wheel glob, import path), from the one release table (release_wheels.RELEASES)
RELEASES = {name: (pattern, pkg) for name, pattern, pkg in release_wheels.RELEASES}
TE_RC = "/tmp/te-setup.rc"
TE_ENV = "/tmp/te-env.sh"

# variant -> (harness fix, extra env); "shipped" imports nothing, "shipped-audit" imports the
# hotfix with MFSDP_HOTFIX=0 so that the audit diagnoses the shipped code
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "shipped": ("none", {}),
    "hotfix": ("hotfix", {}),
    "shipped-audit": ("hotfix", {"MFSDP_HOTFIX": "0"}),
    "shipped-off": ("hotfix", {"MFSDP_HOTFIX": "0"}),  # the audit's truth: same code, no audit
    "hotfix-audit": ("hotfix", {}),
}


def job(name: str, release: str, variant: str, specs: list[dict[str, Any]], *,
        serialized: bool = False, te: bool = False, sanitizer: bool = False) -> dict[str, Any]:
    """One worker process's job; every spec gets the process keys of the job."""
    fix, env = VARIANTS[variant]
    env = dict(env)
    if serialized:
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    if sanitizer:
        env["TORCH_CUDA_SANITIZER"] = "1"
    if variant.endswith("-audit"):
        env["MFSDP_HOTFIX_AUDIT"] = os.path.join(workdir.run_dir(), "audit",
                                                 name.replace("/", "_"))
    pkg = RELEASES[release][1]
    for s in specs:
        s.update(pkg=pkg, fix=fix, release=release, variant=variant, serialized=serialized,
                 sanitizer=sanitizer)
    return {"name": name, "release": release, "variant": variant, "serialized": serialized,
            "te": te, "sanitizer": sanitizer, "env": env, "specs": specs}


def calibrate() -> dict[str, Any]:
    """Cycles of ``torch.cuda._sleep`` per millisecond, measured with CUDA events (in a child
    process, so that this driver holds no CUDA context)."""
    code = (f"import json, sys, torch\nsys.path.insert(0, {HERE!r})\nimport run_matrix\n"
            "out = run_matrix.calibrate()\n"
            "out.update(gpu=torch.cuda.get_device_name(0), torch=torch.__version__)\n"
            "print(json.dumps(out))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except Exception as e:
        raise SystemExit(f"calibration failed: {e}: {r.stdout[-500:]} {r.stderr[-2000:]}") from None


def te_state() -> str:
    """absent (no TE setup started), building, ready, failed."""
    if os.path.exists(TE_RC):
        with open(TE_RC) as f:
            # 11: TE's setup passed its required smoke test and only an extra kernel check
            # failed (the setup's own exit statuses); TE is installed and usable
            return "ready" if f.read().strip() in ("0", "11") else "failed"
    if os.path.exists("/tmp/te-setup.started"):
        return "building"
    try:
        import importlib.util

        return "ready" if importlib.util.find_spec("transformer_engine") else "absent"
    except Exception:
        return "absent"


def te_env() -> dict[str, str]:
    """The variables /tmp/te-env.sh sets (PYTHONPATH, LD_LIBRARY_PATH, ...)."""
    if not os.path.exists(TE_ENV):
        return {}
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(["bash", "-c", f"source {TE_ENV} >/dev/null 2>&1; env -0"],
                         capture_output=True, text=True, env=base)
    env = {}
    for item in out.stdout.split("\0"):
        if "=" in item:
            k, v = item.split("=", 1)
            if k in ("PYTHONPATH", "LD_LIBRARY_PATH", "NVTE_FRAMEWORK", "CUDA_HOME"):
                env[k] = v
    return env


class Engine:
    def __init__(self, rel_paths: dict[str, str], workers: int, deadline: float,
                 cycles_per_ms: float, limit: Callable[[], int] | None = None,
                 log: Callable[[str], None] = print) -> None:
        self.rel_paths = rel_paths
        self.workers = workers
        self.deadline = deadline
        self.cpm = cycles_per_ms
        self.limit = limit or (lambda: self.workers)
        self.log = log
        self.seq = 0
        self.jobs_dir = os.path.join(workdir.run_dir(), "jobs")
        os.makedirs(self.jobs_dir)  # a run's own: an existing one is an error

    # ---- one process
    def _env(self, j: dict[str, Any]) -> dict[str, str]:
        env = dict(os.environ)
        paths = [REPO, self.rel_paths[j["release"]]]
        if j["te"]:
            tenv = te_env()
            if tenv.get("PYTHONPATH"):
                paths.append(tenv.pop("PYTHONPATH"))
            env.update(tenv)
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        env["PYTHONUNBUFFERED"] = "1"
        env["OMP_NUM_THREADS"] = "1"
        env["MFSDP_HOTFIX_CROSS_RANK_CHECK"] = "off"  # FakeStore has no set/get
        for k in ("CUDA_LAUNCH_BLOCKING", "TORCH_CUDA_SANITIZER", "MFSDP_HOTFIX",
                  "MFSDP_HOTFIX_AUDIT"):
            env.pop(k, None)
        env.update(j["env"])
        if env.get("MFSDP_VAL_CPU") == "1" and j["variant"] == "shipped":
            env["MFSDP_HOTFIX"] = "0"  # the CPU stand-in is imported from the package
        return env

    def _start(self, j: dict[str, Any]) -> dict[str, Any]:
        self.seq += 1
        base = os.path.join(self.jobs_dir, f"{self.seq:04d}")
        for s in j["specs"]:
            s.setdefault("cycles_per_ms", self.cpm)
        with open(base + ".job.json", "w") as f:
            json.dump(j, f)
        log = open(base + ".log", "w")
        p = subprocess.Popen([sys.executable, os.path.join(HERE, "engine.py"), "--job",
                              base + ".job.json", "--results", base + ".jsonl"],
                             env=self._env(j), stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        return {"job": j, "proc": p, "base": base, "log": log, "t0": time.time()}

    def _finish(self, r: dict[str, Any], killed: bool) -> tuple[list[dict[str, Any]],
                                                                list[dict[str, Any]]]:
        """Records of a finished job, and the specs still to run (re-queued). Records are matched
        to the job's specs by case id: a line of another case is an error, not a result."""
        r["log"].close()
        j, base = r["job"], r["base"]
        rc = r["proc"].returncode
        specs = {s["id"]: s for s in j["specs"]}
        recs, seen = [], set()
        if os.path.exists(base + ".jsonl"):
            with open(base + ".jsonl") as f:
                for line in f:
                    if not line.strip():
                        continue
                    rec = json.loads(line)
                    if rec.get("id") not in specs or rec["id"] in seen:
                        raise RuntimeError(f"{base}.jsonl: a record of case {rec.get('id')!r}, "
                                           f"which job {j['name']} does not have to run (once)")
                    seen.add(rec["id"])
                    rec["job"] = {"name": j["name"], "seq": os.path.basename(base), "rc": rc,
                                  "run": workdir.run_id()}
                    recs.append(rec)
        rest = [s for s in j["specs"] if s["id"] not in seen]
        tail = _tail(base + ".log")
        if not rest:
            return recs, []
        if killed:
            for s in rest:
                recs.append(_record(s, "not run: --budget-s reached before it started", j, base))
            return recs, []
        if rc == 0:  # a worker that finished its list wrote every case: this is a bug, say so
            for s in rest:
                recs.append(_record(s, "the worker exited 0 without this case's record", j, base,
                                    crashed=True))
            return recs, []
        # the process died (or exited 3 after a fatal case) before finishing its list
        fatal_prev = recs and recs[-1].get("fatal")
        if not fatal_prev:
            recs.append(_record(rest[0], f"worker process died (rc={rc}): {tail[-600:]}", j,
                                base, crashed=True))
            rest = rest[1:]
        return recs, rest

    # ---- many
    def run(self, jobs: list[dict[str, Any]], on_records: Callable[[list[dict[str, Any]]], None]
            | None = None) -> list[dict[str, Any]]:
        planned = [_case(s) for j in jobs for s in j["specs"]]
        if len(set(planned)) != len(planned) or any(i is None for _, i in planned):
            raise ValueError("every case of a run needs an id of its own in its phase")
        queue = deque(jobs)
        running: list[dict[str, Any]] = []
        out: list[dict[str, Any]] = []
        retries: dict[str, int] = {}
        while queue or running:
            now = time.time()
            # start what may start
            state = None
            i = 0
            while len(running) < self.limit() and i < len(queue) and now < self.deadline:
                j = queue[i]
                if j["release"] not in self.rel_paths:
                    del queue[i]
                    out += [_record(s, "not run: release wheel not carried", j, "")
                             for s in j["specs"]]
                    continue
                if j["te"]:
                    state = state or te_state()
                    if state in ("failed", "absent"):
                        del queue[i]
                        out += [_record(s, f"not run: TransformerEngine {state}", j, "")
                                for s in j["specs"]]
                        continue
                    if state == "building":
                        i += 1
                        continue
                del queue[i]
                running.append(self._start(j))
            if now >= self.deadline and queue:
                for j in queue:
                    out += [_record(s, "not run: --budget-s reached before it started", j, "")
                            for s in j["specs"]]
                queue.clear()
            # reap
            for r in list(running):
                killed = False
                if r["proc"].poll() is None:
                    if time.time() < self.deadline:
                        continue
                    r["proc"].kill()
                    r["proc"].wait()
                    killed = True
                running.remove(r)
                recs, rest = self._finish(r, killed)
                out += recs
                if on_records:
                    on_records(recs)
                name = r["job"]["name"]
                if rest:
                    retries[name] = retries.get(name, 0) + 1
                    if retries[name] <= 3:
                        queue.appendleft(dict(r["job"], specs=rest))
                    else:
                        out += [_record(s, "not run: worker died 3 times", r["job"], r["base"])
                                for s in rest]
                self.log(f"[engine] {name}: {len(recs)} records, rc={r['proc'].returncode}, "
                         f"{time.time() - r['t0']:.1f}s, {len(queue)} queued, "
                         f"{len(running)} running, {self.deadline - time.time():.0f}s left")
            time.sleep(0.2)
        missing = set(planned) - {_case(r["spec"]) for r in out}
        if missing or len(out) != len(planned):
            raise RuntimeError(f"{len(planned)} cases planned, {len(out)} records; no record of "
                               f"{sorted(missing)[:10]}")
        return out


def _case(spec: dict[str, Any]) -> tuple[str, Any]:
    """A case's identity in a run: its phase and its id (phases share ids, such as seeds)."""
    return str(spec.get("phase")), spec.get("id")


def _record(spec: dict[str, Any], why: str, j: dict[str, Any], base: str,
            crashed: bool = False) -> dict[str, Any]:
    rec: dict[str, Any] = {"id": spec.get("id"), "spec": spec, "crashed": crashed,
                           "error": why if crashed else None,
                           "job": {"name": j["name"], "seq": os.path.basename(base),
                                   "run": workdir.run_id()}}
    if not crashed:
        rec["skipped"] = why
    elif (spec.get("truth") or {}).get("mode") == "compare":
        rec["comparison"] = comparison.not_compared("crash", truth_crashed=None)
    if crashed and (spec.get("truth") or {}).get("mode") == "save":
        try:
            with open(spec["truth"]["path"] + ".crash", "w") as f:
                f.write(why)
        except OSError:
            pass
    return rec


def _tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - n))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def worker(job_path: str, results: str) -> int:
    sys.path.insert(0, HERE)
    import harness

    with open(job_path) as f:
        j = json.load(f)
    with open(results, "a") as out:
        for spec in j["specs"]:
            rec = harness.run_case(spec)
            out.write(json.dumps(rec, default=str) + "\n")
            out.flush()
            print(f"[worker] {spec.get('id')}: crashed={rec['crashed']} "
                  f"{(rec.get('comparison') or {}).get('outcome', '')} {rec.get('wall_s')}s "
                  f"{rec.get('error') or ''}"[:400], flush=True)
            if rec.get("fatal"):
                return 3
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--job", required=True)
    ap.add_argument("--results", required=True)
    a = ap.parse_args()
    sys.exit(worker(a.job, a.results))
