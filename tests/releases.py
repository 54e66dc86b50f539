"""Real Megatron-FSDP releases for the tests: downloaded once, cached, unpacked per release.

Each release is unpacked (not pip-installed) into its own folder, dist-info included, so that a
subprocess with that folder first on ``sys.path`` imports exactly that release and
``importlib.metadata`` reports its version, while the test venv itself stays free of megatron.
The cache lives in ``$MFSDP_TEST_CACHE`` (default ``<repo>/.cache/releases``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("MFSDP_TEST_CACHE", REPO / ".cache" / "releases"))

MEGATRON_FSDP = ["0.1.0", "0.2.0", "0.2.1", "0.2.2", "0.2.3", "0.3.0", "0.3.1", "0.4.0",
                 "0.5.0", "0.5.1", "0.6.0", "0.6.1"]
# 0.18.1 and 0.19.1 are yanked on PyPI; pip still serves them when pinned exactly.
MEGATRON_CORE = ["0.13.0", "0.13.1", "0.14.0", "0.15.0", "0.15.1", "0.15.2", "0.15.3", "0.16.0",
                 "0.16.1", "0.17.0", "0.17.1", "0.18.0", "0.18.1", "0.18.2", "0.19.0", "0.19.1",
                 "0.19.2"]
# megatron-core ships CPython-specific wheels; the code we read is pure Python either way.
_CORE_PYTHON = {"0.13.0": "3.11", "0.13.1": "3.11"}


def wheel(dist: str, version: str) -> Path:
    """Path of the cached wheel of ``dist==version``, downloaded on first use."""
    folder = CACHE / "wheels"
    prefix = f"{dist.replace('-', '_')}-{version}-"
    found = sorted(folder.glob(prefix + "*.whl")) if folder.exists() else []
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(folder),
           f"{dist}=={version}"]
    if dist == "megatron-core":
        cmd += ["--only-binary=:all:", "--python-version",
                _CORE_PYTHON.get(version, "3.12" if version >= "0.17" else "3.11")]
    subprocess.run(cmd, check=True)
    found = sorted(folder.glob(prefix + "*.whl"))
    if not found:
        raise FileNotFoundError(f"pip downloaded no wheel for {dist}=={version} into {folder}")
    return found[0]


def unpacked(dist: str, version: str) -> Path:
    """Folder holding the unpacked release (package and dist-info), ready for ``sys.path``."""
    target = CACHE / "unpacked" / f"{dist}-{version}"
    done = target / ".complete"
    if not done.exists():
        target.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel(dist, version)) as archive:
            archive.extractall(target)
        done.touch()
    return target


# NVIDIA/Megatron-LM refs not released as wheels: the Megatron-FSDP source of a git ref, taken
# from a local clone (``MFSDP_TEST_MEGATRON_LM``, a git dir) and laid out as the standalone
# ``megatron_fsdp`` package (which is how the megatron-fsdp wheel is built from that folder).
MEGATRON_LM_GIT = (Path(os.environ["MFSDP_TEST_MEGATRON_LM"])
                   if os.environ.get("MFSDP_TEST_MEGATRON_LM") else None)
_FSDP_SRC = "megatron/core/distributed/fsdp/src/megatron_fsdp"


def git_tree(ref: str) -> Path | None:
    """Folder holding ``megatron_fsdp`` as of ``ref`` (a branch of the clone, e.g. ``main`` or
    ``pull-request/6316``, or a full ref such as ``refs/pull/6317/head``); None when it is not
    cached and there is no clone with that ref."""

    def as_standalone(target: Path) -> None:
        (target / _FSDP_SRC).rename(target / "megatron_fsdp")
        shutil.rmtree(target / "megatron")  # empty now; it would shadow a real megatron package

    return _cached_extract(ref, _FSDP_SRC, CACHE / "git", as_standalone)


def _cached_extract(ref: str, folder: str, cache: Path,
                    arrange: Callable[[Path], None] = lambda target: None) -> Path | None:
    """``folder`` of the clone's ``ref``, extracted once into ``cache`` and laid out by
    ``arrange``; a folder left half-made by an interrupted run is made again."""
    target = cache / ref.replace("/", "-")
    if (target / ".complete").exists():
        return target
    shutil.rmtree(target, ignore_errors=True)
    if not _extract(ref, folder, target):
        return None
    arrange(target)
    (target / ".complete").touch()
    return target


def _extract(ref: str, folder: str, target: Path) -> bool:
    """Unpack ``folder`` of the clone's ``ref`` into ``target`` (its commit in ``.commit``);
    False when there is no clone or no such ref."""
    if MEGATRON_LM_GIT is None or not MEGATRON_LM_GIT.exists():
        return False
    git = ["git", "--git-dir", str(MEGATRON_LM_GIT)]
    full = ref if ref.startswith("refs/") else f"refs/heads/{ref}"
    found = subprocess.run(git + ["rev-parse", "--verify", "--quiet", full],
                           capture_output=True, text=True)
    if found.returncode != 0:
        return False
    target.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(git + ["archive", full, folder], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    (target / ".commit").write_text(found.stdout.strip())
    return True


def git_commit(ref: str) -> str | None:
    tree = git_tree(ref)
    return (tree / ".commit").read_text()[:10] if tree is not None else None


def git_core_tree(ref: str) -> Path | None:
    """Folder holding megatron-core's ``megatron/core`` as of ``ref`` (a ``sys.path`` folder,
    its ``megatron`` a namespace package); None when it is not cached and there is no clone
    with that ref."""
    return _cached_extract(ref, "megatron/core", CACHE / "git-core")
