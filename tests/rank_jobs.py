"""Jobs of several gloo ranks on real Megatron-FSDP: a job script's ``main`` and the tests' way
of starting its ranks and reading their reports.

A job script is run as ``python JOB.py CONFIG_JSON RANK WORLD STORE OUT`` with the release first
on ``PYTHONPATH`` and the repository and ``tests/`` after it; ``MFSDP_HOTFIX=0`` runs the
release as shipped. Its ``run(config, rank, world, store)`` returns the rank's report, written
to ``OUT/rank<R>.json`` (an exception becomes ``exception`` and ``traceback``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def main(run: Callable[[dict[str, Any], int, int, str], dict[str, Any]]) -> None:
    """A job script's entry point: one rank, its report written, then ``os._exit``."""
    config, rank, world, store, out = sys.argv[1:]
    try:
        report = run(json.loads(config), int(rank), int(world), store)
    except BaseException as exc:
        report = {"exception": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()[-4000:]}
    Path(out, f"rank{rank}.json").write_text(json.dumps(report, default=repr))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a peer stuck in a collective must not hang this rank


def run_ranks(job: Path, release: Path, config: dict[str, Any], world: int = 2,
              hotfix: bool = True, timeout: float = 280.0) -> tuple[list[dict[str, Any] | None],
                                                                     list[int], list[str]]:
    """Every rank of one run of ``job``: each rank's report (None where it wrote none: a rank
    killed by a signal, SIGSEGV is -11), the exit statuses and the end of each rank's stderr."""
    with tempfile.TemporaryDirectory(prefix=f"mfsdp-{job.stem}-") as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MFSDP_HOTFIX")}
        env.update(PYTHONPATH=os.pathsep.join([str(release), str(REPO), str(TESTS)]),
                   GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                   **({} if hotfix else {"MFSDP_HOTFIX": "0"}))
        procs = [subprocess.Popen([sys.executable, str(job), json.dumps(config), str(rank),
                                   str(world), f"{tmp}/store", tmp], env=env,
                                  stderr=subprocess.PIPE) for rank in range(world)]
        try:
            logs = [proc.communicate(timeout=timeout)[1].decode(errors="replace")[-4000:]
                    for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        reports = [Path(tmp, f"rank{rank}.json") for rank in range(world)]
        return ([json.loads(r.read_text()) if r.exists() else None for r in reports],
                [proc.returncode for proc in procs], logs)
