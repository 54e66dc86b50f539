"""The cases of each phase of run_matrix.py: one ``harness.py`` process per case, described by
its label, release, variant and the harness options it runs with.

A phase plans its serialized truth runs (``is_truth``: the same configuration under
``CUDA_LAUNCH_BLOCKING=1``, gradients saved) beside the asynchronous runs that compare with them;
the driver runs every truth first. The sizes (``SMALL``, ``BIG_B``, ``LARGE``) are the phases'
models.
"""

from __future__ import annotations

import json
import os

import workdir
from release_wheels import RELEASES

# correctness model: small enough that 20+ steps of every case fit, big enough to have work
SMALL = dict(units=4, hidden=512, ffn=1024, tokens=4096, dtype="fp32", steps=20, warmup=2,
             microbatches=2)
# The ZeRO-3 second-defect size: the configuration at which that defect was first reported
BIG_B = dict(units=8, hidden=2048, ffn=4096, tokens=4096, dtype="fp32", steps=4, warmup=0,
             microbatches=2)
# performance model: bf16, hidden 4096, 8 units
LARGE = dict(units=8, hidden=4096, ffn=16384, tokens=4096, dtype="bf16", steps=30, warmup=5,
             microbatches=2)


AUDIT_SMALL = dict(SMALL, steps=6, warmup=1)


VARIANTS = {  # name -> (db, fix)
    "nodb": (0, "none"),
    "db": (1, "none"),
    "db+hotfix": (1, "hotfix"),
    "db+ref": (1, "ref"),
    "nodb+hotfix": (0, "hotfix"),
}



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
    plan = PHASES.get(phase)
    if plan is None:
        raise SystemExit(f"unknown phase {phase}")
    fixv = "db+hotfix" if hotfix_ok else "db+ref"
    return plan(fixv, hotfix_ok, args)


def _all_releases():
    return [r[0] for r in RELEASES]


def smoke(fixv, hotfix_ok, args):
    small = dict(SMALL, steps=3, warmup=1)
    cases = []
    cases += correctness_cases(_all_releases(), 2, 0, 0, "fake", ["db", fixv], [20], small)
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


def matrix(fixv, hotfix_ok, args):
    allrel = _all_releases()
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


def matrix2(fixv, hotfix_ok, args):
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


def issueb2(fixv, hotfix_ok, args):
    # the reported ZeRO-3 condition at 16k tokens, one case at a time (no other process on
    # the GPU), plain fake group vs NCCL work semantics
    big16 = dict(BIG_B, tokens=16384, steps=3)
    cases = []
    for rel in ("fsdp-0.5.1", "fsdp-0.6.1"):
        cases += correctness_cases([rel], 3, 0, 0, "fake", ["db"], [0], big16, tag="|16k")
        cases += correctness_cases([rel], 3, 0, 0, "nccl_sem", ["db"], [0], big16, tag="|16k")
    return separate_truth(cases, "16k")


def issueb3(fixv, hotfix_ok, args):
    # as issueb2 but no host synchronisation between steps (grads read back at the end)
    big16 = dict(BIG_B, tokens=16384, steps=3, defer_readback=True)
    cases = correctness_cases(["fsdp-0.5.1"], 3, 0, 0, "fake", ["db"], [0], big16, tag="|16k-async")
    cases += correctness_cases(["fsdp-0.5.1"], 3, 0, 0, "nccl_sem", ["db"], [0], big16,
                               tag="|16k-async")
    cases += correctness_cases(["fsdp-0.6.1"], 3, 0, 0, "fake", ["db"], [0], big16, tag="|16k-async")
    return separate_truth(cases, "16k", trace_slots=False)


def auditsmoke(fixv, hotfix_ok, args):
    small = dict(AUDIT_SMALL, steps=3)
    cases = audit_rows(["fsdp-0.5.1"], fixv, [0], small, "auditsmoke")
    cases += [sweep_case("fsdp-0.4.0", 2, 2, "db", size=small),
              sweep_case("core-0.19.2", 3, 1, fixv, size=small)]
    big = dict(LARGE, steps=8, warmup=2)
    cases += [c for c in audit_perf_cases(1, ("fsdp-0.6.1",))]
    for c in cases[-2:]:
        c["harness"].update(steps=big["steps"], warmup=big["warmup"])
    return cases


def audit(fixv, hotfix_ok, args):
    # as shipped (audit diagnoses) and with the hotfix (audit verifies), ZeRO-2, 2
    # microbatches, grads compared with the serialized truth; then a sweep of ZeRO-1/2/3 x
    # 1/2 microbatches and no double buffer, audit counts only
    allrel = _all_releases()
    cases = audit_rows(allrel, fixv, [0, 20], AUDIT_SMALL, "audit")
    for rel in allrel:
        for zero in (1, 2, 3):
            for mb in (1, 2):
                for v in ("db", fixv):
                    cases.append(sweep_case(rel, zero, mb, v))
        for v in ("nodb", "nodb+hotfix"):
            cases.append(sweep_case(rel, 2, 2, v))
    return cases


def auditperf(fixv, hotfix_ok, args):
    return audit_perf_cases(args.perf_reps)


def perf2(fixv, hotfix_ok, args):
    out = []
    for rel, v in (("core-0.19.2", fixv), ("fsdp-0.5.1", fixv), ("core-0.19.2", "nodb"),
                   ("fsdp-0.5.1", "db"), ("fsdp-0.5.1", "nodb")):
        db, fix = VARIANTS[v]
        out.append(dict(label=f"{rel}|z2|perf|{v}|d0|rep1", release=rel, variant=v, zero=2,
                        pg="fake", delay_ms=0, perf=True, rep=1,
                        harness=dict(LARGE, zero=2, db=db, fix=fix, delay_ms=0,
                                     no_grads=True)))
    return out


def perfupstream(fixv, hotfix_ok, args):
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


def perf(fixv, hotfix_ok, args):
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


def issueb(fixv, hotfix_ok, args):
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


# phase name -> its cases, given (the hotfix variant, whether the hotfix imports, the options)
PHASES = {"smoke": smoke, "matrix": matrix, "matrix2": matrix2, "issueb2": issueb2,
          "issueb3": issueb3, "auditsmoke": auditsmoke, "audit": audit, "auditperf": auditperf,
          "perf2": perf2, "perfupstream": perfupstream, "perf": perf, "issueb": issueb}
