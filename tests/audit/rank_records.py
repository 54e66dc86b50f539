"""Rank-file records for the audit's tests: one Megatron-FSDP copy's counts, and one rank's
file holding it."""

from __future__ import annotations

from typing import Any


def copy_record(**fields: Any) -> dict[str, Any]:
    base = {"package": "megatron_fsdp", "version": "0.5.1", "era": "B", "fixes": [],
            "audited": True, "reuses": 18, "unordered": 0, "first_unordered": None,
            "crashed": False, "crash": None, "note": None}
    return {**base, **fields}


def rank_record(rank: int, world: int = 2, **fields: Any) -> dict[str, Any]:
    return {"rank": rank, "world_size": world, "final": True, "audit": "on",
            "copies": [copy_record(**fields)]}


POOLS = {"fsdp_grads (MaxPoolAllocator)": 18}
