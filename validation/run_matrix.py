#!/usr/bin/env python3
"""Driver for the GPU validation matrix: one GPU run, many cases, each case its own process.

    python3 validation/run_matrix.py --phase smoke|matrix|perf --out "$OUT"

Phases ``issueb``, ``issueb2`` and ``issueb3`` examine the second defect reported for ZeRO-3 on
megatron-fsdp <= 0.5.x (docs/VALIDATION.md, "ZeRO-3: the second reported defect"); the names stay
as the committed records carry them. On the GPU machine it unpacks the wheels of
``validation/wheels/*.whl`` into one folder per release under /tmp (never two Megatron-FSDP copies on one path), calibrates
``torch.cuda._sleep`` cycles per millisecond with CUDA events, then runs ``harness.py`` once per
case: first the ground-truth runs (the same configuration under ``CUDA_LAUNCH_BLOCKING=1``), then
the asynchronous runs, which compare their gradients against the truth of the same configuration.
Writes ``<phase>.json`` (every case's record) under --out and prints a table. The phases'
cases are planned by matrix_cases.py.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time

import workdir
from matrix_cases import LARGE, SMALL, phase_cases
from release_wheels import REL, unpack_releases

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def env_report():
    rep = {}
    code = ("import importlib,json\nout={}\n"
            "for m in ['torch','numpy','einops','packaging','wrapt']:\n"
            "  try:\n    mod=importlib.import_module(m); out[m]=getattr(mod,'__version__','?')\n"
            "  except Exception as e: out[m]='MISSING '+type(e).__name__\n"
            "import torch; out['gpu']=torch.cuda.get_device_name(0); out['cuda']=torch.version.cuda\n"
            "print(json.dumps(out))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    try:
        rep["packages"] = json.loads(r.stdout.strip().splitlines()[-1])
    except Exception:
        rep["packages"] = {"error": (r.stdout + r.stderr)[-2000:]}
    r = subprocess.run([sys.executable, "-c",
                        "import mfsdp_hotfix,json; print(json.dumps(mfsdp_hotfix.status(), default=str))"],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO))
    rep["hotfix_importable"] = r.returncode == 0
    rep["hotfix_probe"] = (r.stdout + r.stderr)[-1500:]
    r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,"
                        "clocks.max.sm", "--format=csv,noheader"], capture_output=True, text=True)
    rep["nvidia_smi"] = r.stdout.strip()
    rep["python"] = sys.version.split()[0]
    return rep


def calibrate():
    import torch
    torch.cuda.init()
    res = []
    for n in (1_000_000, 10_000_000, 50_000_000):
        for _ in range(3):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            torch.cuda._sleep(n)
            e.record()
            torch.cuda.synchronize()
            res.append((n, s.elapsed_time(e)))
    big = [n / ms for n, ms in res if n == 50_000_000]
    return {"cycles_per_ms": sorted(big)[len(big) // 2], "samples": res}


class Runner:
    def __init__(self, out, rel_paths, cycles_per_ms, workers, budget_s, case_timeout):
        self.out = out
        self.rel_paths = rel_paths
        self.cpm = cycles_per_ms
        self.workers = workers
        self.deadline = time.time() + budget_s
        self.case_timeout = case_timeout
        os.makedirs(os.path.join(workdir.run_dir(), "cases"), exist_ok=True)
        os.makedirs(os.path.join(workdir.run_dir(), "truth"), exist_ok=True)

    def run_case(self, c):
        if time.time() > self.deadline:
            return dict(c, skipped="not run: --budget-s reached before it started")
        if c["release"] not in self.rel_paths:
            return dict(c, skipped="release wheel not carried")
        if c.get("is_truth") and os.path.exists(c["harness"]["save_grads"]):
            return dict(c, skipped="truth already computed in this call (reused)")
        if c["harness"].get("truth") and not os.path.exists(c["harness"]["truth"]):
            return dict(c, skipped="no truth file (truth run crashed or was skipped)")
        name = c["label"].replace("|", "_").replace(":", "-").replace("+", "p")
        jout = os.path.join(workdir.run_dir(), "cases", name + ".json")
        args = [sys.executable, os.path.join(HERE, "harness.py"), "--pkg", REL[c["release"]][2],
                "--out", jout, "--label", c["label"], "--cycles-per-ms", str(self.cpm)]
        for k, v in c["harness"].items():
            if v is True:
                args.append("--" + k.replace("_", "-"))
            elif v is not False and v is not None:
                args += ["--" + k.replace("_", "-"), str(v)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([REPO, self.rel_paths[c["release"]]])
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("OMP_NUM_THREADS", "4")
        # the fake group's FakeStore implements no set/get: the hotfix's cross-rank check (a
        # store round-trip between real ranks) cannot run in a one-process fake world of 2
        env["MFSDP_HOTFIX_CROSS_RANK_CHECK"] = "off"
        env.update(c.get("env", {}))
        audit_path = env.get("MFSDP_HOTFIX_AUDIT")
        t0 = time.time()
        try:
            p = subprocess.run(args, env=env, capture_output=True, text=True,
                               timeout=self.case_timeout)
            rc, log = p.returncode, (p.stdout + p.stderr)[-2500:]
        except subprocess.TimeoutExpired as e:
            rc, log = "timeout", str(e)[-500:]
        rec = dict(c)
        rec["proc_s"] = round(time.time() - t0, 2)
        rec["rc"] = rc
        if os.path.exists(jout):
            with open(jout) as f:
                rec["result"] = json.load(f)
        else:
            rec["result"] = None
            rec["log_tail"] = log
        if rc not in (0,) and rec["result"] is None:
            rec["log_tail"] = log
        if audit_path:  # the rank file as the audit left it at the process's exit
            rank_file = audit_path + ".rank0.json"
            rec["audit_file"] = (json.load(open(rank_file)) if os.path.exists(rank_file)
                                 else None)
            rec["audit_log"] = [line for line in log.splitlines() if "audit" in line][-5:]
        return rec

    def run_all(self, cases):
        """Truth runs first (in parallel), then everything else (in parallel)."""
        results = []
        for wave in (True, False):
            todo = [c for c in cases if bool(c.get("is_truth")) == wave]
            if self.workers <= 1:
                for c in todo:
                    r = self.run_case(c)
                    results.append(r)
                    print(short(r), flush=True)
            else:
                with cf.ThreadPoolExecutor(self.workers) as ex:
                    for r in ex.map(self.run_case, todo):
                        results.append(r)
                        print(short(r), flush=True)
        return results


def short(r):
    res = r.get("result") or {}
    if r.get("skipped"):
        return f"SKIP {r['label']}: {r['skipped']}"
    if "audit_file" in r:
        return f"{'CRASH' if res.get('crashed') else 'ok'} {r['label']}: {audit_cell(r)} " \
               f"rel_l2={res.get('rel_l2')} step={res.get('step_ms_median')}ms proc={r.get('proc_s')}s"
    if res.get("crashed"):
        return f"CRASH {r['label']}: {res.get('error')}"
    if res is None or not res:
        return f"FAIL {r['label']} rc={r.get('rc')}: {r.get('log_tail', '')[-300:]}"
    return (f"ok {r['label']}: rel_l2={res.get('rel_l2')} max_abs={res.get('max_abs')} "
            f"step={res.get('step_ms_median')}ms peak={res.get('peak_mem_mb')}MB "
            f"proc={r.get('proc_s')}s")


def audit_cell(r):
    """The audit's counts from the rank file it wrote at exit."""
    f = r.get("audit_file")
    if not f:
        return "audit: NO RANK FILE"
    copies = f.get("copies", [])
    crash = [c["crash"] for c in copies if c.get("crashed")]
    return (f"audit {f.get('audit')}: {sum(c['unordered'] for c in copies)} unordered of "
            f"{sum(c['reuses'] for c in copies)} reuses" + (f", crash {crash[0]}" if crash else ""))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", required=True, nargs="+")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/mfsdp_out"))
    ap.add_argument("--wheels", default=os.path.join(HERE, "wheels"))
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--budget-s", type=float, default=520)
    ap.add_argument("--budgets", default="", help="per-phase budgets in s, comma list")
    ap.add_argument("--case-timeout", type=float, default=240)
    ap.add_argument("--perf-delay-ms", type=float, default=2.0)
    ap.add_argument("--perf-reps", type=int, default=2)
    ap.add_argument("--releases", default="", help="comma list to restrict")
    ap.add_argument("--dry", action="store_true", help="list the cases and exit")
    args = ap.parse_args()
    if args.dry:
        for phase in args.phase:
            cs = phase_cases(phase, True, args)
            print(f"== {phase}: {len(cs)} cases ({sum(1 for c in cs if c.get('is_truth'))} truth)")
            for c in cs:
                print("  ", c["label"])
        return
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    rel_paths = unpack_releases(args.wheels)
    env = env_report()
    cal = calibrate()
    print(json.dumps({"env": env, "calibration": cal["cycles_per_ms"]}, default=str), flush=True)
    hotfix_ok = env["hotfix_importable"]
    runner = Runner(args.out, rel_paths, cal["cycles_per_ms"], args.workers, args.budget_s,
                    args.case_timeout)
    for phase in args.phase:
        cases = phase_cases(phase, hotfix_ok, args)
        if args.releases:
            keep = set(args.releases.split(","))
            cases = [c for c in cases if c["release"] in keep]
        if args.budgets:
            b = [float(x) for x in args.budgets.split(",")]
            runner.deadline = time.time() + b[args.phase.index(phase)]
        if phase in ("perf", "perf2", "issueb2", "issueb3", "auditperf", "perfupstream"):
            runner.workers = 1
        print(f"== phase {phase}: {len(cases)} cases, workers={runner.workers}", flush=True)
        tp = time.time()
        results = runner.run_all(cases)
        doc = {"phase": phase, "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
               "env": env, "calibration": cal, "phase_wall_s": round(time.time() - tp, 1),
               "small_model": SMALL, "large_model": LARGE, "cases": results}
        with open(os.path.join(args.out, f"{phase}.json"), "w") as f:
            json.dump(doc, f, indent=1, default=str)
    print(f"== total wall {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
