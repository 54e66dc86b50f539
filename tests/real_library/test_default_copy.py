"""Which Megatron-FSDP copy ``mfsdp-hotfix selftest`` picks by default (nothing is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import releases

REPO = Path(__file__).resolve().parents[2]


def _resolve(*path: Path) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*map(str, path), str(REPO)]))
    code = ("from mfsdp_hotfix.selftest.worker import resolve_flavour\n"
            "print(resolve_flavour('auto'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_standalone_when_only_megatron_fsdp_is_importable() -> None:
    assert _resolve(releases.unpacked("megatron-fsdp", "0.4.0")) == "standalone"


@pytest.mark.slow
def test_vendored_copy_when_megatron_core_is_importable() -> None:
    core = releases.unpacked("megatron-core", "0.16.1")
    assert _resolve(core) == "core"
    assert _resolve(core, releases.unpacked("megatron-fsdp", "0.4.0")) == "core"
