#!/usr/bin/env python3
"""The GPU validation phases, in one GPU run (see gpu_call.sh):

    python3 validation/gpu_phases.py --phases smoke|fuzz|te|long|oracles ... --out $OUT
        [--budget-s 530] [--workers 12] [--seeds LO:HI]

Unpacks the release wheels of ``validation/wheels/``, calibrates ``torch.cuda._sleep`` (cycles per ms), plans the
phases' jobs and runs them with :class:`engine.Engine` (at most ``--workers`` processes on the
GPU; fewer while TransformerEngine is being built; TE jobs wait until it is ready). Writes one
``<phase>.json.gz`` per phase under ``--out`` (every record, the environment, the calibration;
rewritten as records come in, so a run cut short leaves what it had) and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import engine  # noqa: E402
import fuzz  # noqa: E402
import release_wheels  # noqa: E402
import te_matrix  # noqa: E402
import workdir  # noqa: E402
from phase_records import Output, summarize  # noqa: E402

ALL = list(release_wheels.RELEASED)
PHASES = ("smoke", "fuzz", "te", "long", "oracles", "maxpool", "nslot", "upstream")
LONG = dict(hidden=256, units=[{"ffn": f, "norm": i == 3} for i, f in
                               enumerate((512, 1024, 768, 512, 1024, 256))],
            tokens=1024, microbatches=4, steps=20, optimizer="adam", lr=1e-3, dtype="fp32",
            layer="emulated", fuse=True, db=True)
LONG_FAULTS = {"seed": 20, "budget_ms": 1500.0, "rs": {"p": 0.4, "max_ms": 10.0},
               "ag": {"p": 0.2, "max_ms": 5.0}, "compute": {"p": 0.3, "max_ms": 5.0},
               "compute_units": [0, 2, 4], "compute_phases": ["fwd", "bwd"]}


def long_jobs(releases: list[str], zeros: tuple[int, ...] = (2, 3), phase: str = "long"
              ) -> list[dict[str, Any]]:
    """20 optimizer steps x 4 microbatches, per release, variant and ZeRO: one serialized truth,
    then the run without and with the fault (both compared with it)."""
    jobs = []
    for release in releases:
        for variant in ("shipped", "hotfix"):
            truths, runs = [], []
            for zero in zeros:
                key = f"{release}|long|z{zero}"
                path = workdir.truth_path(phase, release, variant, key.replace("|", "_"))
                base = dict(LONG, zero=zero, phase=phase, row=key)
                truths.append(dict(base, id=f"{key}|{variant}|serialized",
                                   truth={"mode": "save", "path": path}))
                for fault in (False, True):
                    runs.append(dict(base, id=f"{key}|{variant}|{'fault' if fault else 'nofault'}",
                                     fault=fault, faults=LONG_FAULTS if fault else None,
                                     truth={"mode": "compare", "path": path}))
            jobs.append(engine.job(f"{phase}/{release}/{variant}/serialized", release, variant,
                                   truths, serialized=True))
            jobs.append(engine.job(f"{phase}/{release}/{variant}", release, variant, runs))
    return jobs


def oracle_jobs(releases: list[str], seeds: list[int], te: bool, phase: str = "oracles"
                ) -> list[dict[str, Any]]:
    """For a sample of fuzz seeds: the audit (shipped = hotfix imported with MFSDP_HOTFIX=0)
    with its gradients compared to a serialized run, and PyTorch's CUDA stream sanitizer."""
    jobs = []
    for release in releases:
        for variant, audit_v, truth_v in (("shipped", "shipped-audit", "shipped-off"),
                                          ("hotfix", "hotfix-audit", "hotfix")):
            for is_te in (False, True):
                if is_te and not te:
                    continue
                picked = [s for s in seeds if (fuzz.draw(s)["layer"] != "emulated") == is_te]
                if not picked:
                    continue
                truths, runs, sans = [], [], []
                for seed in picked:
                    spec = dict(fuzz.draw(seed), seed=seed, phase=phase, oracle_variant=variant)
                    path = workdir.truth_path(phase, release, variant, f"s{seed}")
                    truths.append(dict(spec, id=f"{release}|s{seed}|{variant}|serialized",
                                       truth={"mode": "save", "path": path}))
                    runs.append(dict(spec, id=f"{release}|s{seed}|{variant}|audit", oracle="audit",
                                     truth={"mode": "compare", "path": path, "delete": True}))
                    sans.append(dict(spec, id=f"{release}|s{seed}|{variant}|sanitizer",
                                     oracle="sanitizer", read_grads=True))
                tag = f"{phase}/{release}/{variant}/{'te' if is_te else 'emu'}"
                jobs.append(engine.job(tag + "/serialized", release, truth_v, truths,
                                       serialized=True, te=is_te))
                jobs.append(engine.job(tag + "/audit", release, audit_v, runs, te=is_te))
                jobs.append(engine.job(tag + "/sanitizer", release, variant, sans, te=is_te,
                                       sanitizer=True))
    return jobs


def smoke_jobs(te: bool, releases: list[str]) -> list[dict[str, Any]]:
    """A few fuzz seeds per era, one long run, one audit + sanitizer seed, one TE case per
    layer family (and delayed wgrad), ZeRO-3, 20 ms reduce-scatter delay."""
    one = "fsdp-0.5.1" if "fsdp-0.5.1" in releases else releases[0]
    jobs = fuzz.plan(releases, [0, 1, 2], te_available=False, phase="smoke-fuzz", block=3)
    jobs += long_jobs([one], zeros=(3,), phase="smoke-long")
    jobs += oracle_jobs([one], [fuzz_emulated_seed()], te=False, phase="smoke-oracles")
    if te:
        layers = [("te-linear", True, False), ("te-layernorm-linear", True, False),
                  ("te-layernorm-mlp", False, False), ("te-grouped-linear", True, False),
                  ("te-linear", True, True)]
        jobs += te_matrix.plan([one], layers=layers, zeros=(3,), dtypes=("fp32",),
                               delays=(20,), phase="smoke-te", per_job=10)
    return jobs


def seed_range(text: str) -> tuple[int, int]:
    """``LO:HI`` (seeds LO to HI-1), for argparse."""
    lo, sep, hi = text.partition(":")
    try:
        bounds = (int(lo), int(hi))
    except ValueError:
        bounds = (0, -1)
    if not sep or not 0 <= bounds[0] < bounds[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: give a range LO:HI of seeds with "
                                         "0 <= LO < HI, such as 0:100")
    return bounds


def fuzz_emulated_seed() -> int:
    return next(s for s in range(1000) if fuzz.draw(s)["layer"] == "emulated")


def phase_jobs(phase: str, a: argparse.Namespace, te: bool) -> list[dict[str, Any]]:
    releases = a.releases.split(",") if a.releases else ALL
    lo, hi = a.seeds
    if phase == "smoke":
        return smoke_jobs(te, releases)
    if phase == "fuzz":
        return fuzz.plan(releases, list(range(lo, hi)), te_available=te, block=a.block)
    if phase == "te":
        return te_matrix.plan(releases, layers=te_matrix.LAYERS[:a.te_layers])
    if phase == "maxpool":
        return te_matrix.plan([r for r in releases if r in te_matrix.MAXPOOL_RELEASES],
                              layers=te_matrix.MAXPOOL_LAYERS, dtypes=("fp32",),
                              phase="maxpool", size={"maxpool": True})
    if phase == "nslot":
        return te_matrix.plan([r for r in releases if r in te_matrix.NSLOT_RELEASES]
                              or list(te_matrix.NSLOT_RELEASES), layers=te_matrix.NSLOT_LAYERS,
                              dtypes=("fp32",), phase="nslot",
                              size={"buffer_count": te_matrix.NSLOT_COUNT,
                                    "units": te_matrix.NSLOT_UNITS})
    if phase == "upstream":
        return [job for release, size in te_matrix.UPSTREAM_TREES.items()
                for job in te_matrix.plan([release], layers=te_matrix.NSLOT_LAYERS,
                                          dtypes=("fp32",), phase="upstream", size=size,
                                          per_job=6, variants=("shipped",))]
    if phase == "long":
        return long_jobs(releases)
    if phase == "oracles":
        return oracle_jobs(releases, list(range(lo, lo + a.oracle_seeds)), te)
    raise SystemExit(f"unknown phase {phase}")


def shrink(jobs: list[dict[str, Any]]) -> None:
    """--tiny: the same plan at a size a CPU runs in seconds."""
    for j in jobs:
        for s in j["specs"]:
            s.update(hidden=32, tokens=32, steps=min(int(s.get("steps", 3)), 3))
            if isinstance(s.get("units"), list):
                s["units"] = [dict(u, ffn=max(16, int(u["ffn"]) // 16)) for u in s["units"]]
            else:
                s["ffn"] = max(16, int(s.get("ffn", 1024)) // 16)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phases", nargs="+", required=True, choices=PHASES)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/mfsdp_out"))
    ap.add_argument("--wheels", default=os.path.join(HERE, "wheels"))
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--build-workers", type=int, default=4,
                    help="workers while TransformerEngine is being built")
    ap.add_argument("--budget-s", type=float, default=530.0,
                    help="wall seconds for all phases, from the driver's start")
    ap.add_argument("--seeds", default="0:100", type=seed_range, metavar="LO:HI",
                    help="fuzz seeds LO to HI-1 (default 0:100); oracles take "
                         "--oracle-seeds of them from LO")
    ap.add_argument("--oracle-seeds", type=int, default=6)
    ap.add_argument("--block", type=int, default=50, help="fuzz seeds per worker process")
    ap.add_argument("--te-layers", type=int, default=len(te_matrix.LAYERS),
                    help="the first N layer configurations of te_matrix.LAYERS (most important "
                         "first)")
    ap.add_argument("--releases", default="")
    ap.add_argument("--dry", action="store_true", help="list the jobs and exit (no GPU)")
    ap.add_argument("--cpu", action="store_true",
                    help="test mode: CPU tensors and the torch.cuda stand-in, no faults, no TE")
    ap.add_argument("--tiny", action="store_true",
                    help="test mode: shrink every case (hidden 32, 32 tokens, ffn / 16, 3 steps)")
    return ap.parse_args()


def dry_run(a: argparse.Namespace) -> None:
    """List every phase's jobs (no GPU: planning only)."""
    te = True
    for phase in a.phases:
        jobs = phase_jobs(phase, a, te)
        n = sum(len(j["specs"]) for j in jobs)
        print(f"== {phase}: {len(jobs)} jobs, {n} cases")
        for j in jobs:
            print(f"   {j['name']}: {len(j['specs'])} cases, te={j['te']}, env={j['env']}")


def calibration(a: argparse.Namespace) -> dict[str, Any]:
    """The GPU's sleep cycles per ms; in CPU test mode none, and the cases told to run on CPU."""
    if a.cpu:
        os.environ["MFSDP_VAL_CPU"] = "1"
        return {"cycles_per_ms": 0.0, "gpu": "cpu (test mode)"}
    return engine.calibrate()


def queue(a: argparse.Namespace, cal: dict[str, Any]
          ) -> tuple[list[dict[str, Any]], dict[str, Output]]:
    """One queue for all phases, in the order given (the order is the priority when the budget
    runs out), and each phase's raw file; TE jobs wait while TE is being built, and later
    emulated jobs run meanwhile."""
    te = engine.te_state() in ("ready", "building")
    jobs, outputs = [], {}
    for phase in a.phases:
        pj = phase_jobs(phase, a, te)
        if a.tiny:
            shrink(pj)
        for j in pj:
            j["phase"] = phase
        jobs += pj
        outputs[phase] = Output(a.out, phase, {
            "calibration": cal, "te_state_at_start": engine.te_state(), "workers": a.workers,
            "argv": sys.argv, "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "run": workdir.run_id()})
        print(f"== phase {phase}: {len(pj)} jobs, {sum(len(j['specs']) for j in pj)} cases",
              flush=True)
    return jobs, outputs


def run_queue(a: argparse.Namespace, eng: engine.Engine, jobs: list[dict[str, Any]],
              outputs: dict[str, Output], started: float) -> dict[str, list[dict[str, Any]]]:
    """Run the queue; every record goes to its phase's raw file as it comes in."""
    by_phase: dict[str, list[dict[str, Any]]] = {p: [] for p in a.phases}
    phase_of = {j["name"]: j["phase"] for j in jobs}

    def route(recs: list[dict[str, Any]]) -> None:
        for r in recs:
            phase = phase_of.get((r.get("job") or {}).get("name", ""), a.phases[-1])
            by_phase[phase].append(r)
            outputs[phase].add([r])
            outputs[phase].doc["phase_wall_s"] = round(time.time() - started, 1)

    try:
        leftovers = eng.run(jobs, on_records=route)
    finally:  # the engine raises when a planned case has no record: keep what came in
        for output in outputs.values():
            output.write()
    routed = {id(r) for rs in by_phase.values() for r in rs}
    route([r for r in leftovers if id(r) not in routed])  # records of jobs never started
    return by_phase


def close_phase(phase: str, recs: list[dict[str, Any]], output: Output) -> None:
    """The phase's raw file, complete, and its summary with one line per distinct crash."""
    output.doc["te_state_at_end"] = engine.te_state()
    output.write(complete=True)
    print(f"== {phase}: {output.doc.get('phase_wall_s')}s: {summarize(recs)}", flush=True)
    crashes = [r for r in recs if r.get("crashed") and not (r.get("spec") or {}).get("oracle")]
    seen: set[str] = set()
    for r in crashes:  # one line per distinct error
        err = (r.get("error") or "")[:160]
        if err not in seen and len(seen) < 8:
            seen.add(err)
            print(f"   crash e.g. {r.get('id')}: {err}")


def main() -> None:
    a = parse()
    t0 = time.time()
    if a.dry:
        dry_run(a)
        return
    os.makedirs(a.out, exist_ok=True)
    rel_paths = release_wheels.unpack_releases(a.wheels)
    cal = calibration(a)
    print(json.dumps({"calibration": cal["cycles_per_ms"], "gpu": cal.get("gpu"),
                      "releases": sorted(rel_paths), "te": engine.te_state()}), flush=True)
    deadline = t0 + a.budget_s

    def limit() -> int:
        return a.build_workers if engine.te_state() == "building" else a.workers

    started = time.time()
    jobs, outputs = queue(a, cal)
    eng = engine.Engine(rel_paths, a.workers, deadline, cal["cycles_per_ms"], limit)
    by_phase = run_queue(a, eng, jobs, outputs, started)
    for phase in a.phases:
        close_phase(phase, by_phase[phase], outputs[phase])
    print(f"== total wall {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
