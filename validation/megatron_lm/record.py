"""The raw record of one GPU call: the machine, the checkouts' checks, every run's record
(rewritten as runs end, so a call cut short keeps what it had), the serialized runs against each
other, and the summaries beside it."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from typing import Any

import comparison
import workdir

from .driver import Driver
from .launch import Paths
from .plan import REFERENCE_GROUPS, selected
from .stage import parse_checkouts, stage_sources
from .summary import reference_summary, summary


def serialized_pairs(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per configuration, the serialized runs of the hotfix and of the double buffer off against
    the serialized run as shipped: the hotfix changes no arithmetic of the double buffer, so at
    ZeRO-2/3 they are bit-identical (where a release defect outside the double buffer is repaired,
    e.g. ZeRO-1's lost microbatches, the hotfix's run differs from the shipped one)."""
    import torch

    truth = {(r["config"], r["variant"]): r.get("capture_file") for r in results
             if r.get("serialized") and r["group"] != "unit"}
    out = {}
    for (config, variant), path in sorted(truth.items()):
        shipped = truth.get((config, "shipped"))
        if variant == "shipped" or not (path and shipped):
            continue
        cmp = comparison.compare(torch.load(path), torch.load(shipped)).to_dict()
        out[f"{config}|{variant}"] = {k: cmp[k] for k in (
            "outcome", "rel_l2", "max_abs_diff", "first_bad_step", "differing")}
    return out


def env_info() -> dict[str, Any]:
    # TE's version is read from the runs' own lines (te_versions): here, at the start, TE's
    # setup may not have ended
    code = ("import json,torch\nprint(json.dumps({'torch': torch.__version__, "
            "'gpu': torch.cuda.get_device_name(0)}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except Exception:
        return {"error": (r.stdout + r.stderr)[-1500:]}


def run_call(a: argparse.Namespace) -> None:
    """One GPU call: the checkouts staged, the selected runs, the record and its summaries."""
    t0 = time.time()
    import release_wheels
    import run_matrix

    rel_dirs = {k: v for k, v in release_wheels.unpack_releases(a.wheels).items()
                if k in a.releases}
    checkouts = dict(parse_checkouts(a.megatron_lm, a.releases))
    os.makedirs(os.path.join(workdir.run_dir(), "cases"))
    src, checks = stage_sources(checkouts, rel_dirs)
    report: dict[str, Any] = {"argv": sys.argv, "releases": rel_dirs, "checkouts": checks,
                              "t_start": t0}
    report["env"] = env_info()
    report["calibration"] = run_matrix.calibrate()
    cases = selected(a.releases, a.groups, a.only)
    missing = {rel: check.get("unit_tests_missing", []) for rel, check in checks.items()}
    drv = Driver(Paths(rel_dirs, src, missing), report["calibration"]["cycles_per_ms"],
                 t0 + a.budget_s, a.workers, a.case_timeout, a.unit_timeout)
    report["results"] = []

    def progress(done: list[dict[str, Any]]) -> None:  # a run cut short keeps what it had
        report["results"] = done
        report["wall_s"] = round(time.time() - t0, 1)
        write(a.out, report)

    report["results"] = drv.run_all(cases, progress=progress)
    try:
        report["serialized_vs_shipped"] = serialized_pairs(report["results"])
    except Exception as e:  # the runs are the record; this is a reading of them
        report["serialized_vs_shipped"] = f"{type(e).__name__}: {e}"
    report["wall_s"] = round(time.time() - t0, 1)
    write(a.out, report)
    write(a.out.replace(".json", "-summary.json"), summary(report))
    if any(c["group"] in REFERENCE_GROUPS for c in cases):
        write(a.out.replace(".json", "-reference-summary.json"), reference_summary(report))
    print(f"wrote {a.out} ({report['wall_s']} s)")


def write(path: str, doc: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt") as f:
        json.dump(doc, f, indent=1, default=str)
