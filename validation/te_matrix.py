#!/usr/bin/env python3
"""Real-TransformerEngine matrix : TE layers inside Megatron-FSDP with the
double buffer, every era, fusion on and off, delayed wgrad, ZeRO-2/3, reduce-scatter delay 0 and
20 ms, fp32 and bf16, as shipped and with the hotfix, each compared bit for bit with its own
serialized run, with the audit's counts beside each row.

Shipped rows import the hotfix with ``MFSDP_HOTFIX=0`` so that the audit (``MFSDP_HOTFIX_AUDIT``)
diagnoses the shipped code; hotfix rows have it on (the audit verifies). ``plan()`` gives the
jobs (run by gpu_phases.py); the order puts the rows that matter most first, so that a call cut
by its time budget still has whole rows.
"""

from __future__ import annotations

import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import engine  # noqa: E402
from workdir import truth_path  # noqa: E402

# (layer, fuse, delay_wgrad), most important first
LAYERS = [("te-linear", True, False), ("te-linear", False, False),
          ("te-layernorm-mlp", True, False), ("te-layernorm-mlp", False, False),
          ("te-layernorm-linear", True, False), ("te-layernorm-linear", False, False),
          ("te-linear", True, True), ("te-linear", False, True),
          ("te-layernorm-mlp", True, True), ("te-layernorm-mlp", False, True),
          ("te-grouped-linear", True, False), ("te-grouped-linear", False, False)]
SIZE = dict(hidden=1024, units=4, ffn=2048, tokens=2048, microbatches=2, steps=2)
DELAYS = (0, 20)
# MaxPoolAllocator: the releases that have it, the layers that matter most
MAXPOOL_RELEASES = ("fsdp-0.6.1", "core-0.19.2")
MAXPOOL_LAYERS = LAYERS[:4]
# N-slot pools (NVIDIA PR #6316, fsdp_buffer_count): the emulated contract and the TE layers
# that matter most, with a pool of three slots
NSLOT_RELEASES = ("pr6316", "pr6316-rebuilt")
NSLOT_LAYERS = [("emulated", True, False)] + LAYERS[:4]
NSLOT_COUNT = 3
NSLOT_UNITS = 6  # twice the pool: every slot is recycled within a backward
# The change proposed upstream (upstream/): NVIDIA main patched (pool of 2) and PR #6316 patched
# (pool of NSLOT_COUNT), run as shipped only (MFSDP_HOTFIX=0): the change alone must be exact
UPSTREAM_TREES = {"upstream-main": {"units": NSLOT_UNITS},
                  "upstream-pr6316": {"buffer_count": NSLOT_COUNT, "units": NSLOT_UNITS}}
VARIANTS = {"shipped": "shipped-audit", "hotfix": "hotfix-audit"}


def row_id(release: str, layer: str, fuse: bool, dw: bool, zero: int, dtype: str) -> str:
    return f"{release}|{layer}|fuse{int(fuse)}|dw{int(dw)}|z{zero}|{dtype}"


def plan(releases: list[str], layers: list[tuple[str, bool, bool]] | None = None,
         zeros: tuple[int, ...] = (2, 3), dtypes: tuple[str, ...] = ("fp32", "bf16"),
         delays: tuple[int, ...] = DELAYS, phase: str = "te", size: dict[str, Any] | None = None,
         per_job: int = 24, variants: tuple[str, ...] = tuple(VARIANTS)
         ) -> list[dict[str, Any]]:
    """Per (release, variant): the rows in LAYERS order (``size`` may add spec keys, such as
    ``maxpool``), cut in chunks of ``per_job`` serialized
    cases; the queue holds chunk k's serialized jobs of every release and variant, then the
    asynchronous jobs that compare with them (every delay), then chunk k+1 ..."""
    size = dict(SIZE, **(size or {}))
    layers = LAYERS if layers is None else layers
    chunks: list[list[dict[str, Any]]] = []
    for release in releases:
        for variant in variants:
            proc_variant = VARIANTS[variant]
            truths, runs = [], []
            for layer, fuse, dw in layers:
                for zero in zeros:
                    for dtype in dtypes:
                        rid = row_id(release, layer, fuse, dw, zero, dtype)
                        path = truth_path(phase, release, variant, rid.replace("|", "_"))
                        base = dict(size, layer=layer, fuse=fuse, delay_wgrad=dw, zero=zero,
                                    dtype=dtype, db=True, row=rid, phase=phase,
                                    te_variant=variant)
                        truths.append(dict(base, id=f"{rid}|{variant}|serialized",
                                           truth={"mode": "save", "path": path}))
                        # the last delay's run deletes the truth (TE truths are large)
                        runs.append([dict(base, id=f"{rid}|{variant}|d{d}", delay_ms=d,
                                          faults={"seed": 0, "rs": {"fixed_ms": d}} if d else None,
                                          truth={"mode": "compare", "path": path,
                                                 "delete": d == delays[-1]})
                                     for d in delays])
            truth_v = "shipped-off" if variant == "shipped" else "hotfix"
            for n, k in enumerate(range(0, len(truths), per_job)):
                tag = f"{phase}/{release}/{variant}/{n}"
                while len(chunks) <= n:
                    chunks.append([])
                chunks[n].append(engine.job(tag + "/serialized", release, truth_v,
                                            truths[k:k + per_job], serialized=True, te=True))
                rows = runs[k:k + per_job]
                step = max(1, per_job // max(1, len(delays)))  # a row's delays in one job
                for m in range(0, len(rows), step):
                    chunks[n].append(engine.job(f"{tag}/{m // step}", release, proc_variant,
                                                [r for rs in rows[m:m + step] for r in rs],
                                                te=True))
    jobs = []
    for chunk in chunks:
        jobs += [j for j in chunk if j["serialized"]] + [j for j in chunk if not j["serialized"]]
    return jobs
