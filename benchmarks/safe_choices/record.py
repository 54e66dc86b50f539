"""The one JSON of a GPU call: the wheels unpacked, a worker process per variant started, the
groups driven, and the record written after every turn, so a call cut short still returns what
it measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from release_wheels import unpack_releases  # stdlib-only at import

from . import PACKAGE
from .driver import drive
from .plan import VARIANTS
from .report import compact_table
from .summary import summarize
from .worker import Worker, worker_env


def gpu_state():
    """Clocks, temperature and power as nvidia-smi reads them (settings are left alone)."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,"
                               "clocks.max.sm,temperature.gpu,power.draw,memory.used",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"nvidia-smi unavailable: {e}"


def run_call(a, mode, size, reps, groups):
    """Measure ``groups`` as the command line ``a`` says; write the JSON to ``a.out``, print the
    compact table; 0 if every turn measured."""
    t0 = time.time()
    rel_paths = unpack_releases(a.wheels)
    missing = sorted({g["release"] for g in groups} - set(rel_paths))
    if missing:
        raise SystemExit(f"no wheel for {missing} in {a.wheels}")
    logdir = "/tmp/safe_choices_logs"  # not under $OUT, which keeps only the results
    os.makedirs(logdir, exist_ok=True)

    def start_worker(spec):
        name = f"{spec['release']}_z{spec['zero']}_{spec['variant']}"
        return Worker([sys.executable, PACKAGE, "--serve", json.dumps(spec)],
                      worker_env(spec, rel_paths), os.path.join(logdir, name + ".log"),
                      a.ready_timeout_s, a.turn_timeout_s)

    doc = dict(date_utc=time.strftime("%Y-%m-%d %H:%M", time.gmtime()), mode=mode, size=size,
               reps=reps, groups=[g["group"] for g in groups], budget_s=a.budget_s,
               hard_limit_s=a.hard_limit_s, gpu_before=gpu_state(), variants=VARIANTS)

    def write(records, started, skipped, final=False):
        """Written after every turn, so a call cut short still returns what it measured."""
        doc.update(records=records, workers=started, skipped=skipped,
                   summary=summarize(records), complete=final,
                   wall_s=round(time.time() - t0, 1))
        if final:
            doc["gpu_after"] = gpu_state()
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1, default=str)

    records, started, skipped = drive(groups, start_worker, a.budget_s, a.hard_limit_s,
                                      after_each=write)
    write(records, started, skipped, final=True)
    print(compact_table(doc))
    ok = sum(1 for r in records if r["result"].get("ok"))
    print(f"wall {doc['wall_s']} s; {ok} of {len(records)} turns ok; JSON: {a.out}")
    return 0 if records and ok == len(records) else 1
