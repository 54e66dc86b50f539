"""This package installed the way users install it, once per test session (tests/test_routes.py).

A fresh virtual environment (no ``--system-site-packages``), holding what a training image holds
(``pip install torch==2.13.0 megatron-fsdp==0.5.1 numpy``, the release from its index as users get
it), then this package from the checkout with the README's own line, ``pip install .``: a built
wheel in site-packages, with its ``.pth`` and its ``mfsdp-hotfix`` script, not an editable
install. Commands run through ``bash`` in a scratch folder, with the environment's ``bin`` first
on ``PATH`` and none of the test process' ``PYTHONPATH``, ``VIRTUAL_ENV`` or ``MFSDP_HOTFIX*``,
so that nothing of the source tree can stand in for the installed package.

``torch==2.13.0`` is the pin ``.ci/run`` installs, so in CI pip takes it from its cache; where a
local CPU wheel is configured (``PIP_FIND_LINKS``) it is that one. ``MFSDP_TEST_ROUTES_PIP``
adds pip options to the environment's installs (an index or a wheel folder, for offline use).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# What a training image holds before this package: torch, the release, numpy (torch.distributed's
# object collectives, which Megatron-FSDP calls, need it).
IMAGE = ("torch==2.13.0", "megatron-fsdp==0.5.1", "numpy")


@dataclass
class Installed:
    root: Path  # the virtual environment
    work: Path  # an empty scratch folder: the working directory of every command
    env: dict[str, str]
    setup_s: float  # seconds to build the environment (reported, see test_routes)

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def sh(self, command: str, env: dict[str, str] | None = None, timeout: float = 600,
           cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``command`` as a user types it, in bash, in this environment."""
        return subprocess.run(["bash", "-c", command], cwd=cwd or self.work,
                              env={**self.env, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout)


def user_env(venv: Path) -> dict[str, str]:
    """The test process' environment as a user's shell in ``venv`` would have it."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MFSDP_HOTFIX", "PYTHON", "VIRTUAL_ENV", "PYTEST", "COV_"))}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    env["VIRTUAL_ENV"] = str(venv)
    env["GLOO_SOCKET_IFNAME"] = "lo"  # CPU machines without a routable hostname
    env["OMP_NUM_THREADS"] = "1"
    return env


def _pip(venv: Path, *args: str, cwd: Path) -> None:
    extra = shlex.split(os.environ.get("MFSDP_TEST_ROUTES_PIP", ""))
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                           *extra, *args], cwd=cwd, env=user_env(venv), capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, f"pip install {' '.join(args)}:\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="session")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    started = time.monotonic()
    base = tmp_path_factory.mktemp("installed")
    venv, work = base / "venv", base / "work"
    work.mkdir()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300,
                   env=user_env(venv))
    _pip(venv, *IMAGE, cwd=work)
    _pip(venv, ".", cwd=REPO)  # the README's line, from the checkout
    done = Installed(venv, work, user_env(venv), time.monotonic() - started)
    where = done.sh("python -c 'import mfsdp_hotfix; print(mfsdp_hotfix.__file__)'")
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout  # not the checkout
    return done
