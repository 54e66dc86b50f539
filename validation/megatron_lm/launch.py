"""One run's process: the exact command line and environment of a case (``pretrain_gpt.py``
under the injected ``sitecustomize``, through ``mfsdp-hotfix run``/``audit`` for those variants),
run in a folder of its own under a time limit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from typing import Any

import workdir

from .arguments import determinism_env, pretrain_args
from .outcome import case_record
from .plan import AUDITS, needs_te

VALIDATION = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(VALIDATION)
if REPO not in sys.path:  # mfsdp_hotfix.processes, where the package is not installed
    sys.path.append(REPO)
INJECT = os.path.join(VALIDATION, "mlm_inject")


class Paths:
    """Where the release, the scripts and this run's folders are."""

    def __init__(self, rel_dirs: dict[str, str], src_dirs: dict[str, str],
                 unit_tests_missing: dict[str, list[str]] | None = None) -> None:
        self.rel = rel_dirs
        self.src = src_dirs
        self.unit_tests_missing = unit_tests_missing or {}


def command(c: dict[str, Any], paths: Paths, folder: str, cycles_per_ms: float
            ) -> tuple[list[str], dict[str, str]]:
    """The exact command line and environment of a case."""
    py = sys.executable
    script = os.path.join(paths.src[c["release"]], "pretrain_gpt.py")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    env["PYTHONPATH"] = os.pathsep.join(
        [INJECT, paths.rel[c["release"]], REPO] + te_paths(c, env))
    env.update(CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               MFSDP_VAL_MLM_CAPTURE=folder)
    # NVTE_*_ATTN: --attention-backend sets them; GPTModel refuses values set beside it
    for k in ("MFSDP_HOTFIX", "MFSDP_HOTFIX_AUDIT", "MFSDP_HOTFIX_DISABLED_FIXES",
              "CUDA_LAUNCH_BLOCKING", "NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        env.pop(k, None)
    if c["serialized"]:
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    env.update(determinism_env(c))
    if c["launcher"] == "fake":
        # FakeStore has neither set nor get: the hotfix's cross-rank check cannot run there
        env.update(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()), MFSDP_VAL_MLM_FAKE_NCCL="1",
                   MFSDP_HOTFIX_CROSS_RANK_CHECK="off",
                   MFSDP_VAL_MLM_RS_DELAY_CYCLES=str(int(round(c["delay_ms"] * cycles_per_ms))))
        job = [py, script]
    else:
        job = torchrun() + ["--nproc-per-node", "1", "--master-port", str(free_port()), script]
    job += pretrain_args(c)
    hotfix_cli = [py, "-m", "mfsdp_hotfix"]
    if c["variant"] == "hotfix":
        job = hotfix_cli + ["run", "--"] + job
        if c.get("disabled_fix"):
            env["MFSDP_HOTFIX_DISABLED_FIXES"] = c["disabled_fix"]
    elif c["variant"] in AUDITS:
        if c["variant"] == "audit-shipped":
            env["MFSDP_HOTFIX"] = "0"
        job = hotfix_cli + ["audit", "--out", os.path.join(folder, "audit", "run"), "--"] + job
    return job, env



def te_paths(c: dict[str, Any], env: dict[str, str]) -> list[str]:
    """The ``PYTHONPATH`` tail of a case; a TE case also gets what TE's setup exported (its
    site folder, library path), when TE was set up by ``megatron_lm_call.sh``."""
    import engine

    tail = [p for p in [env.get("PYTHONPATH")] if p]
    if not needs_te(c):
        return tail
    te = engine.te_env()
    if te.get("LD_LIBRARY_PATH"):
        env["LD_LIBRARY_PATH"] = te["LD_LIBRARY_PATH"]
    return [p for p in [te.get("PYTHONPATH")] if p] + tail


def torchrun() -> list[str]:
    found = shutil.which("torchrun")
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_case(c: dict[str, Any], paths: Paths, cycles_per_ms: float, timeout: float
             ) -> dict[str, Any]:
    """A case's run in its own folder, and its record (``outcome``)."""
    folder = os.path.join(workdir.run_dir(), "cases", c["id"].replace("|", "_"))
    os.makedirs(folder)
    argv, env = command(c, paths, folder, cycles_per_ms)
    t0 = time.time()
    rc, log = run_process(argv, env, folder, timeout)
    return case_record(dict(c, argv=argv, rc=rc, proc_s=round(time.time() - t0, 1)), log, folder)


def run_process(argv: list[str], env: dict[str, str], cwd: str, timeout: float
                ) -> tuple[Any, str]:
    """(exit status or "timeout", the output so far, stdout and stderr as they came). A run past
    ``timeout`` is killed with every process under it (``torchrun``'s workers, in sessions of
    their own, would hold the GPU, and the output's pipe, past the kill)."""
    with subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace") as p:
        try:
            out = p.communicate(timeout=timeout)[0]
            return p.returncode, out
        except subprocess.TimeoutExpired:
            from mfsdp_hotfix.processes import kill_tree

            kill_tree(p.pid)
            return "timeout", p.communicate()[0]
