"""Shared fixtures: the repository on sys.path, and subprocess helpers for the permutation tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def run_python(code: str, *path: Path | str, env: dict[str, str] | None = None,
               python: str = sys.executable, repo: bool = True, args: tuple[str, ...] = (),
               timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (or, when ``args`` are given, ``python *args``) in a fresh interpreter with
    ``path`` first on PYTHONPATH, then the repository unless ``repo`` is False."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MFSDP_HOTFIX")}
    full_env["PYTHONPATH"] = os.pathsep.join([str(p) for p in path] + ([str(REPO)] if repo
                                                                        else []))
    full_env["PYTHONWARNINGS"] = "ignore"
    full_env.update(env or {})
    command = [python, *args] if args else [python, "-c", code]
    return subprocess.run(command, capture_output=True, text=True, env=full_env, timeout=timeout)


@pytest.fixture(scope="session")
def fsdp_release():
    """``fsdp_release("0.5.1")`` → folder holding that megatron-fsdp release, for PYTHONPATH."""
    import releases

    return lambda version: releases.unpacked("megatron-fsdp", version)
