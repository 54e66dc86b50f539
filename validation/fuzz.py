#!/usr/bin/env python3
"""Seeded schedule fuzzer: every seed draws a configuration and a fault schedule; each seed runs
as shipped and with the hotfix, each compared bit for bit with its own serialized run
(``CUDA_LAUNCH_BLOCKING=1``, same variant), with NCCL work semantics on the fake group.

A seed is everything: ``draw(seed)`` depends on nothing else (not on the release, not on the
machine), so a failing seed is reproduced with

    python validation/fuzz.py --release fsdp-0.6.1 --seed 17 [--wheels validation/wheels]

which runs that seed's four processes (shipped, hotfix, and their serialized truths) on the GPU
and prints the comparison. ``plan()`` gives the jobs for many seeds (used by gpu_phases.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import engine  # noqa: E402
from workdir import truth_path  # noqa: E402

TE_FAMILIES = ("te-linear", "te-layernorm-linear", "te-layernorm-mlp")
HIDDEN = 256
FFNS = (256, 512, 768, 1024, 1536)
TOKENS = (512, 1024)


def draw(seed: int, te_share: float = 0.25) -> dict[str, Any]:
    """The configuration and fault schedule of ``seed`` (a harness spec without process keys)."""
    rng = random.Random(seed)
    n_units = rng.randint(3, 10)
    # Megatron-FSDP pools only the largest group of units of equal size: most units share one
    # size (at least 3), the others get other sizes and take the release's non-pool path
    main = rng.choice(FFNS)
    units = [{"ffn": main if rng.random() < 0.7 else rng.choice(FFNS), "norm": False}
             for _ in range(n_units)]
    for u in units:
        if sum(v["ffn"] == main for v in units) >= 3:
            break
        u["ffn"] = main
    if rng.random() < 0.5:  # a unit ending in a non-fused layer
        units[rng.randrange(n_units)]["norm"] = True
    te_draw = rng.random()
    layer = "emulated"
    fuse = True
    if te_draw < te_share:
        layer = rng.choice(TE_FAMILIES)
        fuse = rng.random() < 0.5
    spec = {"zero": rng.choice((2, 3)), "hidden": HIDDEN, "units": units,
            "microbatches": rng.randint(1, 4), "dtype": rng.choice(("fp32", "bf16")),
            "tokens": rng.choice(TOKENS), "steps": 2, "layer": layer, "fuse": fuse, "db": True}
    faults: dict[str, Any] = {"seed": seed, "budget_ms": 250.0}
    for stream, top in (("rs", 20.0), ("ag", 10.0), ("compute", 10.0)):
        if rng.random() < 0.25:
            faults[stream] = {"p": 0.0}  # this stream undisturbed (delay 0)
        else:
            faults[stream] = {"p": round(rng.uniform(0.1, 0.8), 3), "min_ms": 0.0,
                              "max_ms": round(rng.uniform(1.0, top), 3)}
    faults["compute_units"] = sorted(rng.sample(range(n_units), rng.randint(1, n_units)))
    faults["compute_phases"] = rng.choice((["fwd"], ["bwd"], ["fwd", "bwd"]))
    spec["faults"] = faults
    return spec


def seed_specs(phase: str, release: str, variant: str, seed: int, spec: dict[str, Any]
               ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(truth spec, async spec) of one seed in one variant."""
    path = truth_path(phase, release, variant, f"s{seed}")
    base = dict(spec, seed=seed, phase=phase)
    truth = dict(base, id=f"{release}|s{seed}|{variant}|serialized",
                 truth={"mode": "save", "path": path})
    run = dict(base, id=f"{release}|s{seed}|{variant}",
               truth={"mode": "compare", "path": path, "delete": True})
    return truth, run


def plan(releases: list[str], seeds: list[int], te_available: bool, phase: str = "fuzz",
         block: int = 25, variants: tuple[str, ...] = ("shipped", "hotfix"),
         te_share: float = 0.25, db: bool = True) -> list[dict[str, Any]]:
    """Jobs: for each block of seeds, for each release and variant, the serialized job first,
    then the asynchronous one; TE seeds in their own jobs (TE imported only there)."""
    jobs = []
    for b in range(0, len(seeds), block):
        chunk = seeds[b:b + block]
        for release in releases:
            for variant in variants:
                for te in (False, True):
                    if te and not te_available:
                        continue
                    truths, runs = [], []
                    for seed in chunk:
                        spec = dict(draw(seed, te_share), db=db)
                        if (spec["layer"] != "emulated") != te:
                            continue
                        t, r = seed_specs(phase, release, variant, seed, spec)
                        truths.append(t)
                        runs.append(r)
                    if not runs:
                        continue
                    tag = f"{phase}/{release}/{variant}/{'te' if te else 'emu'}/b{b}"
                    jobs.append(engine.job(tag + "/serialized", release, variant, truths,
                                           serialized=True, te=te))
                    jobs.append(engine.job(tag, release, variant, runs, te=te))
    return jobs


def te_seeds_skipped(seeds: list[int], te_share: float = 0.25) -> list[int]:
    return [s for s in seeds if draw(s, te_share)["layer"] != "emulated"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--release", required=True, choices=sorted(engine.RELEASES))
    ap.add_argument("--seed", type=int, required=True, nargs="+")
    ap.add_argument("--wheels", default=os.path.join(HERE, "wheels"))
    ap.add_argument("--te-share", type=float, default=0.25)
    ap.add_argument("--show", action="store_true", help="print the seed's draw and exit (no GPU)")
    ap.add_argument("--out", default="")
    ap.add_argument("--cpu", action="store_true", help="test mode (see gpu_phases.py --cpu)")
    ap.add_argument("--no-double-buffer", action="store_true",
                    help="the same seed with fsdp_double_buffer=False: is a failure the "
                         "release's own defect, outside the double buffer?")
    a = ap.parse_args()
    if a.show:
        for s in a.seed:
            print(json.dumps({"seed": s, **draw(s, a.te_share)}, indent=1))
        return
    import release_wheels

    rel_paths = release_wheels.unpack_releases(a.wheels)
    if a.cpu:
        os.environ["MFSDP_VAL_CPU"] = "1"
        cpm = 0.0
    else:
        cpm = engine.calibrate()["cycles_per_ms"]
    te = engine.te_state() == "ready"
    jobs = plan([a.release], list(a.seed), te, phase="repro", block=len(a.seed),
                te_share=a.te_share, db=not a.no_double_buffer)
    eng = engine.Engine(rel_paths, workers=4, deadline=time.time() + 3600, cycles_per_ms=cpm)
    recs = eng.run(jobs)
    for r in recs:
        c = r.get("comparison") or {}
        what = c.get("outcome") or ("serialized run saved" if r.get("truth_saved") else "")
        print(f"{r.get('id')}: {what} max_abs_diff={c.get('max_abs_diff')} "
              f"{r.get('skipped') or r.get('error') or ''}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(recs, f, default=str)


if __name__ == "__main__":
    main()
