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
Writes ``<phase>.json`` (every case's record) under --out and prints a table.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import glob
import json
import os
import subprocess
import sys
import time
import zipfile

import workdir

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

CORE_PKG = "megatron.core.distributed.fsdp.src.megatron_fsdp"
RELEASES = [  # (short name, wheel glob, import path)
    ("fsdp-0.4.0", "megatron_fsdp-0.4.0-*.whl", "megatron_fsdp"),
    ("fsdp-0.5.1", "megatron_fsdp-0.5.1-*.whl", "megatron_fsdp"),
    ("fsdp-0.6.1", "megatron_fsdp-0.6.1-*.whl", "megatron_fsdp"),
    ("core-0.18.2", "megatron_core-0.18.2-*.whl", CORE_PKG),
    ("core-0.19.2", "megatron_core-0.19.2-*.whl", CORE_PKG),
    # NVIDIA PR #6316 (fsdp_buffer_count, N-slot pools), not released: its megatron_fsdp folder
    # zipped from a Megatron-LM clone by `validation/pack_tree.py pull-request/6316`
    ("pr6316", "megatron_fsdp-pr6316-*.zip", "megatron_fsdp"),
    # the same code shape rebuilt from the megatron-fsdp 0.6.1 wheel, as CI tests it, with
    # fsdp_buffer_count=3 as its default: `python tests/snapshots.py build pr6316 DIR
    # --buffer-count 3`, then DIR's contents zipped as megatron_fsdp-pr6316rebuilt-n3.zip
    ("pr6316-rebuilt", "megatron_fsdp-pr6316rebuilt-*.zip", "megatron_fsdp"),
    # the change proposed upstream (upstream/), applied to NVIDIA main and to PR #6316:
    # `validation/pack_tree.py main --patch upstream/main.patch --name upstreammain` and
    # `validation/pack_tree.py pull-request/6316 --patch upstream/pr6316.patch --name upstreampr6316`
    ("upstream-main", "megatron_fsdp-upstreammain-*.zip", "megatron_fsdp"),
    ("upstream-pr6316", "megatron_fsdp-upstreampr6316-*.zip", "megatron_fsdp"),
]
# the phases' default release list: what users can install
RELEASED = [r[0] for r in RELEASES if not r[0].startswith(("pr", "upstream"))]
REL = {r[0]: r for r in RELEASES}

# correctness model: small enough that 20+ steps of every case fit, big enough to have work
SMALL = dict(units=4, hidden=512, ffn=1024, tokens=4096, dtype="fp32", steps=20, warmup=2,
             microbatches=2)
# The ZeRO-3 second-defect size: the configuration at which that defect was first reported
BIG_B = dict(units=8, hidden=2048, ffn=4096, tokens=4096, dtype="fp32", steps=4, warmup=0,
             microbatches=2)
# performance model: bf16, hidden 4096, 8 units
LARGE = dict(units=8, hidden=4096, ffn=16384, tokens=4096, dtype="bf16", steps=30, warmup=5,
             microbatches=2)


def unpack_releases(wheel_dir):
    paths = {}
    for name, pattern, _ in RELEASES:
        found = sorted(glob.glob(os.path.join(wheel_dir, pattern)))
        if not found:
            continue
        dest = os.path.join(workdir.PARENT, "rel", name)  # shared by runs: wheels never change
        if not os.path.exists(os.path.join(dest, ".done")):
            os.makedirs(dest, exist_ok=True)
            with zipfile.ZipFile(found[0]) as z:
                z.extractall(dest)
            open(os.path.join(dest, ".done"), "w").close()
        paths[name] = dest
    return paths


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


AUDIT_SMALL = dict(SMALL, steps=6, warmup=1)


def audited(case):
    """The same case with the audit on: shipped code runs with the hotfix imported but
    ``MFSDP_HOTFIX=0`` (the audit diagnoses), hotfix variants with it on (the audit verifies).
    Truth runs stay as they are."""
    if case.get("is_truth"):
        return case
    c = json.loads(json.dumps(case))
    shipped = c["harness"]["fix"] == "none"
    c["harness"]["fix"] = "hotfix"
    name = c["label"].replace("|", "_").replace(":", "-").replace("+", "p")
    c["env"] = dict(c.get("env", {}), MFSDP_HOTFIX_AUDIT=os.path.join(workdir.run_dir(), "audit", name))
    if shipped:
        c["env"]["MFSDP_HOTFIX"] = "0"
    c["variant"] += "+audit"
    c["label"] = c["label"].replace(f"|{case['variant']}|", f"|{c['variant']}|")
    return c


def audit_rows(releases, fixv, delays, size, suffix):
    """Shipped and hotfix rows with the audit on, grads compared with their own serialized
    truth; a release whose serialized shipped run crashes (era A) runs without one."""
    cases = [audited(c) for c in correctness_cases(releases, 2, 0, 0, "nccl_sem",
                                                   ["db", fixv], delays, size)]
    cases = separate_truth(cases, suffix, trace_slots=False)
    for c in cases:
        if c["release"] == "fsdp-0.4.0" and c["variant"] == "db+audit":
            c["harness"].pop("truth", None)
            c["harness"]["no_grads"] = True
    return [c for c in cases if not (c.get("is_truth") and c["release"] == "fsdp-0.4.0"
                                     and c["variant"] == "db")]


def sweep_case(rel, zero, mb, v, delay=0, size=None):
    """An audit-only case (no grads read back, no truth): what the audit counts."""
    db, fix = VARIANTS[v]
    size = dict(size or AUDIT_SMALL, microbatches=mb)
    return audited(dict(label=f"{rel}|z{zero}|mb{mb}|nccl_sem|{v}|d{delay}|sweep", release=rel,
                        variant=v, zero=zero, pg="nccl_sem", delay_ms=delay,
                        harness=dict(size, zero=zero, db=db, fix=fix, delay_ms=delay,
                                     pg="nccl_sem", no_grads=True)))


def audit_perf_cases(reps, releases=("fsdp-0.6.1", "core-0.19.2")):
    """LARGE, hotfix on, audit off vs on, interleaved (rep0 of every variant, then rep1 ...)."""
    out = []
    for rep in range(reps):
        for rel in releases:
            for audit in (False, True):
                c = dict(label=f"{rel}|z2|perf|db+hotfix|d0|rep{rep}", release=rel,
                         variant="db+hotfix", zero=2, pg="nccl_sem", delay_ms=0, perf=True,
                         rep=rep, harness=dict(LARGE, zero=2, db=1, fix="hotfix", delay_ms=0,
                                               pg="nccl_sem", no_grads=True))
                out.append(audited(c) if audit else c)
    return out


VARIANTS = {  # name -> (db, fix)
    "nodb": (0, "none"),
    "db": (1, "none"),
    "db+hotfix": (1, "hotfix"),
    "db+ref": (1, "ref"),
    "nodb+hotfix": (0, "hotfix"),
}


def kill_switch_case(shipped):
    """The shipped double-buffer case run with the hotfix imported but ``MFSDP_HOTFIX=0``: it
    must behave exactly as shipped."""
    c = json.loads(json.dumps(shipped))
    c["label"] = c["label"].replace("|db|", "|db+hotfix(MFSDP_HOTFIX=0)|")
    c["harness"]["fix"] = "hotfix"
    c["env"] = {"MFSDP_HOTFIX": "0"}
    return c


def separate_truth(cases, suffix, trace_slots=True):
    """Give a phase's truth runs their own grads file (``*_<suffix>.pt``), so that its cases
    compare against their own serialized run, not the smaller matrix's."""
    for c in cases:
        if trace_slots:
            c["harness"]["trace_slots"] = True
        if c.get("is_truth"):
            c["harness"]["save_grads"] = c["harness"]["save_grads"].replace(".pt", f"_{suffix}.pt")
            c["label"] += f"|{suffix}"
        else:
            c["harness"]["truth"] = c["harness"]["truth"].replace(".pt", f"_{suffix}.pt")
    return cases


def correctness_cases(releases, zero, norm, head, pg, variants, delays, size, tag=""):
    cases = []
    for rel in releases:
        for v in variants:
            db, fix = VARIANTS[v]
            tpath = os.path.join(workdir.run_dir(), "truth", f"{rel}_z{zero}_n{norm}_h{head}_{v}.pt")
            base = dict(size, zero=zero, db=db, fix=fix, norm=norm, head=head)
            cases.append(dict(
                label=f"{rel}|z{zero}|{'norm' if norm else 'fused'}{'+head' if head else ''}|truth:{v}",
                release=rel, is_truth=True, variant=v, zero=zero, norm=norm, head=head, pg="fake",
                delay_ms=0, env={"CUDA_LAUNCH_BLOCKING": "1"},
                harness=dict(base, save_grads=tpath, pg="fake")))
            for d in delays:
                cases.append(dict(
                    label=f"{rel}|z{zero}|{'norm' if norm else 'fused'}{'+head' if head else ''}|{pg}|{v}|d{d}{tag}",
                    release=rel, variant=v, zero=zero, norm=norm, head=head, pg=pg, delay_ms=d,
                    harness=dict(base, delay_ms=d, pg=pg, truth=tpath)))
    # de-duplicate truth runs shared between pg modes
    seen, out = set(), []
    for c in cases:
        if c["label"] in seen:
            continue
        seen.add(c["label"])
        out.append(c)
    return out


def phase_cases(phase, hotfix_ok, args):
    seen, out = set(), []
    for c in _phase_cases(phase, hotfix_ok, args):
        if c["label"] not in seen:
            seen.add(c["label"])
            out.append(c)
    return out


def _phase_cases(phase, hotfix_ok, args):
    fixv = "db+hotfix" if hotfix_ok else "db+ref"
    allrel = [r[0] for r in RELEASES]
    if phase == "smoke":
        small = dict(SMALL, steps=3, warmup=1)
        cases = []
        cases += correctness_cases(allrel, 2, 0, 0, "fake", ["db", fixv], [20], small)
        cases += correctness_cases(["fsdp-0.5.1", "fsdp-0.6.1"], 3, 0, 0, "nccl_sem",
                                   ["db"], [0], small)
        cases += correctness_cases(["fsdp-0.5.1"], 2, 1, 0, "fake", ["db"], [20], small)
        cases += correctness_cases(["fsdp-0.5.1"], 3, 0, 0, "fake", ["db"], [0], small)
        if hotfix_ok:
            cases += correctness_cases(["fsdp-0.5.1"], 2, 0, 0, "fake", ["db+ref"], [20], small)
        # one large-model step-time probe (unit backward time, step time)
        big = dict(LARGE, steps=8, warmup=2, no_grads=True)
        cases.append(dict(label="fsdp-0.6.1|z2|perf-probe|db", release="fsdp-0.6.1", variant="db",
                          zero=2, pg="fake", delay_ms=0, perf=True,
                          harness=dict(big, zero=2, db=1, fix="none", delay_ms=0)))
        return cases
    if phase == "matrix":
        cases = []
        variants = ["nodb", "db", fixv]
        for norm in (0, 1):
            cases += correctness_cases(allrel, 2, norm, 0, "fake", variants, [0, 5, 20, 50], SMALL)
        # control: the validation-only prototype of the same rule (validation/refpatch.py)
        if hotfix_ok:
            for norm in (0, 1):
                cases += correctness_cases(allrel, 2, norm, 0, "fake", ["db+ref"], [20], SMALL)
        # ZeRO-3 rows (the second defect is examined at a larger size in phase issueb)
        cases += correctness_cases(allrel, 3, 0, 0, "fake", variants, [0, 20], SMALL)
        # ZeRO-2 NCCL-semantics control: the gradient race must not depend on the work handles
        cases += correctness_cases(["fsdp-0.5.1", "fsdp-0.6.1"], 2, 0, 0, "nccl_sem",
                                   ["db", fixv], [20], SMALL)
        # kill switch control: MFSDP_HOTFIX=0 must behave as shipped
        if hotfix_ok:
            for rel in ("fsdp-0.5.1", "fsdp-0.4.0"):
                cases.append(kill_switch_case(correctness_cases([rel], 2, 0, 0, "fake", ["db"],
                                                                [20], SMALL)[1]))
        return cases
    if phase == "matrix2":
        # what the first matrix run's --budget-s cut, minus the small ZeRO-3 rows (issueb covers
        # ZeRO-3 at the size where its second defect shows) and the refpatch controls
        cases = correctness_cases(["core-0.19.2"], 2, 1, 0, "fake", ["nodb", "db", fixv],
                                  [0, 5, 20, 50], SMALL)
        cases += correctness_cases(["fsdp-0.5.1", "fsdp-0.6.1"], 2, 0, 0, "nccl_sem",
                                   ["db", fixv], [20], SMALL)
        if hotfix_ok:
            truth, shipped = correctness_cases(["fsdp-0.5.1"], 2, 0, 0, "fake", ["db"], [20], SMALL)
            cases += [truth, kill_switch_case(shipped)]
        return cases
    if phase == "issueb2":
        # the reported ZeRO-3 condition at 16k tokens, one case at a time (no other process on
        # the GPU), plain fake group vs NCCL work semantics
        big16 = dict(BIG_B, tokens=16384, steps=3)
        cases = []
        for rel in ("fsdp-0.5.1", "fsdp-0.6.1"):
            cases += correctness_cases([rel], 3, 0, 0, "fake", ["db"], [0], big16, tag="|16k")
            cases += correctness_cases([rel], 3, 0, 0, "nccl_sem", ["db"], [0], big16, tag="|16k")
        return separate_truth(cases, "16k")
    if phase == "issueb3":
        # as issueb2 but no host synchronisation between steps (grads read back at the end)
        big16 = dict(BIG_B, tokens=16384, steps=3, defer_readback=True)
        cases = correctness_cases(["fsdp-0.5.1"], 3, 0, 0, "fake", ["db"], [0], big16, tag="|16k-async")
        cases += correctness_cases(["fsdp-0.5.1"], 3, 0, 0, "nccl_sem", ["db"], [0], big16,
                                   tag="|16k-async")
        cases += correctness_cases(["fsdp-0.6.1"], 3, 0, 0, "fake", ["db"], [0], big16, tag="|16k-async")
        return separate_truth(cases, "16k", trace_slots=False)
    if phase == "auditsmoke":
        small = dict(AUDIT_SMALL, steps=3)
        cases = audit_rows(["fsdp-0.5.1"], fixv, [0], small, "auditsmoke")
        cases += [sweep_case("fsdp-0.4.0", 2, 2, "db", size=small),
                  sweep_case("core-0.19.2", 3, 1, fixv, size=small)]
        big = dict(LARGE, steps=8, warmup=2)
        cases += [c for c in audit_perf_cases(1, ("fsdp-0.6.1",))]
        for c in cases[-2:]:
            c["harness"].update(steps=big["steps"], warmup=big["warmup"])
        return cases
    if phase == "audit":
        # as shipped (audit diagnoses) and with the hotfix (audit verifies), ZeRO-2, 2
        # microbatches, grads compared with the serialized truth; then a sweep of ZeRO-1/2/3 x
        # 1/2 microbatches and no double buffer, audit counts only
        cases = audit_rows(allrel, fixv, [0, 20], AUDIT_SMALL, "audit")
        for rel in allrel:
            for zero in (1, 2, 3):
                for mb in (1, 2):
                    for v in ("db", fixv):
                        cases.append(sweep_case(rel, zero, mb, v))
            for v in ("nodb", "nodb+hotfix"):
                cases.append(sweep_case(rel, 2, 2, v))
        return cases
    if phase == "auditperf":
        return audit_perf_cases(args.perf_reps)
    if phase == "perf2":
        out = []
        for rel, v in (("core-0.19.2", fixv), ("fsdp-0.5.1", fixv), ("core-0.19.2", "nodb"),
                       ("fsdp-0.5.1", "db"), ("fsdp-0.5.1", "nodb")):
            db, fix = VARIANTS[v]
            out.append(dict(label=f"{rel}|z2|perf|{v}|d0|rep1", release=rel, variant=v, zero=2,
                            pg="fake", delay_ms=0, perf=True, rep=1,
                            harness=dict(LARGE, zero=2, db=db, fix=fix, delay_ms=0,
                                         no_grads=True)))
        return out
    if phase == "perfupstream":
        # the change proposed upstream, as shipped (no hotfix), against the hotfix on the
        # release with the same three functions (0.6.1 = main's), interleaved
        out = []
        for rep in range(args.perf_reps):
            for rel, v in (("fsdp-0.6.1", fixv), ("upstream-main", "db")):
                db, fix = VARIANTS[v]
                out.append(dict(label=f"{rel}|z2|perf|{v}|d0|rep{rep}", release=rel, variant=v,
                                zero=2, pg="fake", delay_ms=0, perf=True, rep=rep,
                                harness=dict(LARGE, zero=2, db=db, fix=fix, delay_ms=0,
                                             no_grads=True)))
        return out
    if phase == "perf":
        fixv_h = fixv
        dly = args.perf_delay_ms
        order = []
        plan = [("fsdp-0.6.1", ["db", fixv_h, "nodb"], [0, dly]),
                ("core-0.19.2", ["db", fixv_h], [0]),
                ("fsdp-0.5.1", [fixv_h], [0])]
        for rep in range(args.perf_reps):
            for rel, vs, ds in plan:
                for d in ds:
                    for v in vs:
                        db, fix = VARIANTS[v]
                        order.append(dict(
                            label=f"{rel}|z2|perf|{v}|d{d}|rep{rep}", release=rel, variant=v,
                            zero=2, pg="fake", delay_ms=d, perf=True, rep=rep,
                            harness=dict(LARGE, zero=2, db=db, fix=fix, delay_ms=d,
                                         no_grads=True)))
        return order
    if phase == "issueb":
        # ZeRO-3 second defect, at the size where it was reported (8 units 2048->4096->2048),
        # plain fake group vs NCCL work semantics; pool-slot assignment traced
        cases = []
        for rel, vs in (("fsdp-0.5.1", ["db", fixv]), ("fsdp-0.6.1", ["db"]),
                        ("fsdp-0.4.0", [fixv]), ("core-0.18.2", ["db"])):
            cases += correctness_cases([rel], 3, 0, 0, "fake", vs, [0], BIG_B, tag="|big")
            cases += correctness_cases([rel], 3, 0, 0, "nccl_sem", vs, [0, 20], BIG_B, tag="|big")
        for rel in ("fsdp-0.5.1", "fsdp-0.6.1"):  # bucket outside the pool, no double buffer
            cases += correctness_cases([rel], 3, 0, 1, "fake", ["nodb"], [0], BIG_B, tag="|big")
            cases += correctness_cases([rel], 3, 0, 1, "nccl_sem", ["nodb"], [0], BIG_B,
                                       tag="|big")
        return separate_truth(cases, "big")
    raise SystemExit(f"unknown phase {phase}")


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
