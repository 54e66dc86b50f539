"""Every rank must run the same patched code: a rank running unpatched Megatron-FSDP next to
patched ranks can hang a collective or corrupt a step.

Right after each ``MegatronFSDP`` is built on an initialised process group of more than one rank,
each rank publishes a short description of what the hotfix applied in the group's key-value
store and reads everybody else's. A rank whose hotfix is not loaded publishes nothing; waiting on
the store (with a timeout) rather than a collective means such a rank is named, not deadlocked on.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections import defaultdict
from datetime import timedelta
from typing import Any

from . import incidents
from .errors import RankMismatch as RankMismatch
from .settings import CROSS_RANK_CHECK, Settings

log = logging.getLogger("mfsdp_hotfix")

_builds = itertools.count()


def check(fingerprint: dict[str, Any], settings: Settings) -> None:
    """Compare ``fingerprint`` across ranks; raise or warn (per settings) when they differ."""
    if settings.cross_rank_check == "off" or incidents.disabled("cross-rank-check"):
        return
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    build = next(_builds)
    keys = [f"mfsdp_hotfix/check/{build}/{r}" for r in range(world)]
    store.set(keys[rank], json.dumps(fingerprint, sort_keys=True))
    try:
        store.wait(keys, timedelta(seconds=settings.cross_rank_timeout))
    except Exception:
        pass  # the ranks that did not answer are named below
    by_value: dict[str, list[int]] = defaultdict(list)
    for r, key in enumerate(keys):
        by_value[store.get(key).decode() if store.check([key]) else ""].append(r)
    if len(by_value) == 1:
        return
    mine = json.dumps(fingerprint, sort_keys=True)
    silent = f"no report within {settings.cross_rank_timeout:g} s (mfsdp_hotfix not loaded or " \
        "disabled there)"
    lines = [f"ranks {_ranges(ranks)}: " + (value or silent)
             + (" (this rank)" if value == mine else "")
             for value, ranks in sorted(by_value.items(), key=lambda item: item[1])]
    message = ("mfsdp_hotfix: ranks run differently patched Megatron-FSDP code, which can hang "
               "a collective or corrupt a step:\n  " + "\n  ".join(lines) + "\nInstall the same "
               "mfsdp-hotfix on every node and do not set MFSDP_HOTFIX=0 on some ranks only; "
               f"{CROSS_RANK_CHECK}=warn downgrades this error to a warning.")
    if settings.cross_rank_check == "warn":
        log.warning(message)
    else:
        raise RankMismatch(message)


def _ranges(ranks: list[int]) -> str:
    return ",".join(str(r) for r in ranks) if len(ranks) < 8 else f"{ranks[0]}..{ranks[-1]} " \
        f"({len(ranks)} ranks)"
