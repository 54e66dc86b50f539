"""A case's exact command line and environment: ``mfsdp-hotfix parity`` (the console script
``pip install`` made) around the launch a user would type, and the process run under a time
limit with its whole tree ended past it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

from megatron_lm.arguments import pretrain_args
from megatron_lm.launch import INJECT, free_port, te_paths, torchrun

from .plan import RUN_TIMEOUT_S


def parity_cli() -> list[str]:
    """The installed console script (the user's route); where the package is not installed (a
    dry run here), the module."""
    found = shutil.which("mfsdp-hotfix")
    return [found] if found else [sys.executable, "-m", "mfsdp_hotfix"]


def launch(c: dict[str, Any], script: str) -> list[str]:
    """The job as the user launches it: ``torchrun`` on one GPU, or, for two ranks in one
    process, ``python3 pretrain_gpt.py --fake-process-group`` with ``WORLD_SIZE=2``."""
    if c["dp"] == 2:
        return ["python3", script] + pretrain_args(c)
    return torchrun() + ["--nproc-per-node", "1", "--master-port", str(free_port()),
                         script] + pretrain_args(c)


def command(c: dict[str, Any], script: str, release_dir: str, out: str
            ) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """(argv, the whole environment, what the case adds to the caller's environment)."""
    argv = parity_cli() + ["parity", "--json", "--out", out, "--iters", str(c["iterations"]),
                           "--timeout", f"{RUN_TIMEOUT_S:g}"]
    if c["shipped"]:
        argv.append("--with-shipped")
    argv += ["--"] + launch(c, script)
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_DEVICE_MAX_CONNECTIONS", "MFSDP_HOTFIX", "MFSDP_HOTFIX_AUDIT",
                        "MFSDP_HOTFIX_DISABLED_FIXES", "CUDA_LAUNCH_BLOCKING",
                        "NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")}
    added = {"MFSDP_VAL_MLM_INJECT": "1", "PYTHONUNBUFFERED": "1"}
    # the release and TE as a user's environment has them installed; the injection first
    added["PYTHONPATH"] = os.pathsep.join([INJECT, release_dir] + te_paths(c, env))
    if c["disabled"]:
        added["MFSDP_HOTFIX_DISABLED_FIXES"] = ",".join(c["disabled"])
    if c["dp"] == 2:
        # FakeStore has neither set nor get: the hotfix's cross-rank check cannot run there
        added.update(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port()), MFSDP_VAL_MLM_FAKE_NCCL="1",
                     MFSDP_HOTFIX_CROSS_RANK_CHECK="off")
    if "LD_LIBRARY_PATH" in env and env.get("LD_LIBRARY_PATH") != os.environ.get(
            "LD_LIBRARY_PATH"):
        added["LD_LIBRARY_PATH"] = env["LD_LIBRARY_PATH"]  # TE's setup's, from te_paths
    env.update(added)
    return argv, env, added


def run(argv: list[str], env: dict[str, str], cwd: str, timeout: float
        ) -> tuple[int | str, str, str]:
    """(exit status or ``"timeout"``, stdout, stderr); both streams go to files in ``cwd`` as
    they come, so a killed check keeps what it printed. Past ``timeout`` the process and every
    process under it are ended (``torchrun``'s workers would hold the GPU)."""
    paths = [os.path.join(cwd, name) for name in ("stdout.txt", "stderr.txt")]
    with open(paths[0], "w") as out, open(paths[1], "w") as err:
        p = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=err,
                             start_new_session=True)
        try:
            rc: int | str = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            from mfsdp_hotfix.processes import kill_tree

            kill_tree(p.pid)
            p.wait()
            rc = "timeout"
    texts = []
    for path in paths:
        with open(path, errors="replace") as f:
            texts.append(f.read())
    return rc, texts[0], texts[1]
