"""The record of one GPU call: the machine, the installed package, the checkouts' checks, and
every case's result, rewritten as each case ends (a call cut short, or a case that fails, keeps
every other case's record)."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from typing import Any

import engine
import release_wheels
import workdir
from megatron_lm.record import env_info
from megatron_lm.stage import parse_checkouts, stage_sources

from .command import parity_cli
from .driver import Driver
from .plan import selected

SCRIPT = "pretrain_gpt.py"


def installed() -> dict[str, Any]:
    """Where the package the cases run is installed, and which version (``pip install``'s)."""
    code = ("import json, os, mfsdp_hotfix, mfsdp_hotfix.__about__ as a\n"
            "print(json.dumps({'version': a.__version__, 'file': mfsdp_hotfix.__file__}))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MFSDP_HOTFIX")}
    r = subprocess.run(["python3", "-c", code], capture_output=True, text=True, env=env,
                       cwd="/")
    out: dict[str, Any] = {"cli": parity_cli()}
    try:
        out.update(json.loads(r.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        out["error"] = (r.stdout + r.stderr)[-1500:]
    return out


def te_version() -> str | None:
    """TransformerEngine's version where the cases ran (after its setup ended)."""
    te = engine.te_env()
    env = dict(os.environ, **te)
    r = subprocess.run(["python3", "-c", "import torch, transformer_engine as t; "
                        "print(t.__version__)"], capture_output=True, text=True, env=env)
    return r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else None


def run_call(a: argparse.Namespace) -> None:
    """One GPU call: the releases and checkouts staged, the selected cases, the record."""
    t0 = time.time()
    rel_dirs = {k: v for k, v in release_wheels.unpack_releases(a.wheels).items()
                if k in a.releases}
    checkouts = dict(parse_checkouts(a.megatron_lm, a.releases))
    src, checks = stage_sources(checkouts, rel_dirs)
    cases = selected(a.releases, a.groups, a.only)
    report: dict[str, Any] = {"argv": sys.argv, "t_start": t0, "releases": sorted(rel_dirs),
                              "checkouts": checks, "installed": installed(), "env": env_info(),
                              "planned": [c["id"] for c in cases], "results": []}
    write(a.out, report)
    folder = os.path.join(workdir.run_dir(), "cases")
    os.makedirs(folder)
    drv = Driver({rel: os.path.join(d, SCRIPT) for rel, d in src.items()}, rel_dirs, folder,
                 t0 + a.budget_s, a.workers)

    def progress(done: list[dict[str, Any]]) -> None:
        report["results"] = done
        report["wall_s"] = round(time.time() - t0, 1)
        write(a.out, report)

    report["results"] = drv.run_all(cases, progress=progress)
    report["te"] = {"state": engine.te_state(), "version": te_version()}
    report["wall_s"] = round(time.time() - t0, 1)
    write(a.out, report)
    print(f"wrote {a.out} ({report['wall_s']} s)")


def write(path: str, doc: dict[str, Any]) -> None:
    """The record, replaced whole (a reader never sees half of it)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path + ".tmp", "wt") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def read(path: str) -> dict[str, Any]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        doc: dict[str, Any] = json.load(f)
    return doc
