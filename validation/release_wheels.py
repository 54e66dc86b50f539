"""The one table of releases the GPU validation runs, and their wheels unpacked on the machine.

Every release gets its own folder under ``workdir.PARENT`` (never two Megatron-FSDP copies on one
path); a worker process puts the folder of its case's release on ``PYTHONPATH``.
"""

from __future__ import annotations

import glob
import os
import zipfile

import workdir

CORE_PKG = "megatron.core.distributed.fsdp.src.megatron_fsdp"
RELEASES = [  # (short name, wheel glob, import path)
    ("fsdp-0.4.0", "megatron_fsdp-0.4.0-*.whl", "megatron_fsdp"),
    ("fsdp-0.5.1", "megatron_fsdp-0.5.1-*.whl", "megatron_fsdp"),
    ("fsdp-0.6.1", "megatron_fsdp-0.6.1-*.whl", "megatron_fsdp"),
    ("core-0.18.2", "megatron_core-0.18.2-*.whl", CORE_PKG),
    ("core-0.19.2", "megatron_core-0.19.2-*.whl", CORE_PKG),
    # NVIDIA PR #6316 (fsdp_buffer_count, N-slot pools), not released: its megatron_fsdp folder
    # zipped from a Megatron-LM clone by `validation/pack_tree.py pull-request/6316`
    ("pr6316", "megatron_fsdp-pr6316-*.zip", "megatron_fsdp"),
    # the same code shape rebuilt from the megatron-fsdp 0.6.1 wheel, as CI tests it, with
    # fsdp_buffer_count=3 as its default: `python tests/snapshots.py build pr6316 DIR
    # --buffer-count 3`, then DIR's contents zipped as megatron_fsdp-pr6316rebuilt-n3.zip
    ("pr6316-rebuilt", "megatron_fsdp-pr6316rebuilt-*.zip", "megatron_fsdp"),
    # the change proposed upstream (upstream/), applied to NVIDIA main and to PR #6316:
    # `validation/pack_tree.py main --patch upstream/main.patch --name upstreammain` and
    # `validation/pack_tree.py pull-request/6316 --patch upstream/pr6316.patch --name upstreampr6316`
    ("upstream-main", "megatron_fsdp-upstreammain-*.zip", "megatron_fsdp"),
    ("upstream-pr6316", "megatron_fsdp-upstreampr6316-*.zip", "megatron_fsdp"),
]
# the phases' default release list: what users can install
RELEASED = [r[0] for r in RELEASES if not r[0].startswith(("pr", "upstream"))]
REL = {r[0]: r for r in RELEASES}


def unpack_releases(wheel_dir):
    paths = {}
    for name, pattern, _ in RELEASES:
        found = sorted(glob.glob(os.path.join(wheel_dir, pattern)))
        if not found:
            continue
        dest = os.path.join(workdir.PARENT, "rel", name)  # shared by runs: wheels never change
        if not os.path.exists(os.path.join(dest, ".done")):
            os.makedirs(dest, exist_ok=True)
            with zipfile.ZipFile(found[0]) as z:
                z.extractall(dest)
            open(os.path.join(dest, ".done"), "w").close()
        paths[name] = dest
    return paths
