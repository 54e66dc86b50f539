#!/usr/bin/env python3
"""Zip the ``megatron_fsdp`` package of an unreleased NVIDIA/Megatron-LM ref for the GPU phases.

    python3 validation/pack_tree.py REF [--git-dir DIR] [--name NAME] [--out validation/wheels]

REF is a ref of a local clone (``pull-request/6316``, ``refs/pull/6316/head``, ``main``); the clone
is ``--git-dir`` or ``$MFSDP_TEST_MEGATRON_LM`` (a git dir). The zip holds the vendored
``megatron/core/distributed/fsdp/src/megatron_fsdp`` folder laid out as the standalone
``megatron_fsdp`` package, which is how the megatron-fsdp wheel is built from it, and no
dist-info: a worker imports it as a source checkout on PYTHONPATH. ``release_wheels.RELEASES``
finds it by the name ``megatron_fsdp-NAME-COMMIT.zip``. ``--patch FILE`` applies a patch made against
Megatron-LM (``upstream/main.patch``) with ``git apply`` before zipping; it must apply cleanly.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile

SRC = "megatron/core/distributed/fsdp/src/megatron_fsdp/"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ref")
    p.add_argument("--git-dir", default=os.environ.get("MFSDP_TEST_MEGATRON_LM"),
                   help="the clone's git dir (default: $MFSDP_TEST_MEGATRON_LM)")
    p.add_argument("--name", default="pr6316", help="the release's short name in run_matrix")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "wheels"))
    p.add_argument("--patch", help="a patch against Megatron-LM to apply first (git apply)")
    a = p.parse_args()
    if not a.git_dir:
        p.error("no clone: pass --git-dir or set MFSDP_TEST_MEGATRON_LM")
    git = ["git", "--git-dir", a.git_dir]
    commit = subprocess.run(git + ["rev-parse", "--verify", a.ref + "^{commit}"],
                            capture_output=True, text=True)
    if commit.returncode != 0:
        p.error(f"{a.ref!r} is not a ref of {a.git_dir}")
    sha = commit.stdout.strip()
    archive = subprocess.run(git + ["archive", "--format=tar", sha, SRC], capture_output=True,
                             check=True).stdout
    if a.patch:
        archive = patched(archive, os.path.abspath(a.patch))
    os.makedirs(a.out, exist_ok=True)
    target = os.path.join(a.out, f"megatron_fsdp-{a.name}-{sha[:10]}.zip")
    files = 0
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar, \
            zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as z:
        for member in tar.getmembers():
            if member.isfile():
                data = tar.extractfile(member).read()  # type: ignore[union-attr]
                z.writestr("megatron_fsdp/" + member.name[len(SRC):], data)
                files += 1
    print(f"{target}: {files} files of {a.ref} @ {sha[:10]}", file=sys.stderr)
    return 0


def patched(archive: bytes, patch: str) -> bytes:
    """The tar ``archive`` with ``patch`` applied (``git apply``, no fuzz; raises if it does not
    apply)."""
    with tempfile.TemporaryDirectory() as tree:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tree, filter="data")
        subprocess.run(["git", "apply", "--verbose", patch], cwd=tree, check=True)
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w") as tar:
            tar.add(os.path.join(tree, SRC), arcname=SRC)
        return out.getvalue()


if __name__ == "__main__":
    raise SystemExit(main())
