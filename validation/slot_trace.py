"""Which pool slot each bucket's allocation lands in (spec ``trace_slots``): the double buffer's
``FixedPoolAllocator`` patched once per process to log its new allocations, summarized per case.
"""

from __future__ import annotations

from typing import Any


def install(allocator: Any) -> list[tuple[str, int, Any]]:
    """Patch ``allocator.allocate`` to log ``(pool name, bucket, slot)`` of every allocation of a
    bucket that held none; the log the patch appends to."""
    log: list[tuple[str, int, Any]] = []
    orig = allocator.allocate

    def allocate(pool: Any, bucket_id: int, *args: Any, **kw: Any) -> Any:
        had = bucket_id in pool.using_buffer
        out = orig(pool, bucket_id, *args, **kw)
        if not had and bucket_id in pool.using_buffer:
            log.append((pool.name, bucket_id, pool.using_buffer[bucket_id][0]))
        return out

    allocator.allocate = allocate
    return log


def summarize(log: list[tuple[str, int, Any]]) -> dict[str, Any]:
    """Per allocator: how often a bucket's new allocation lands in a different pool slot than its
    previous allocation (0.6.x pins each bucket to one slot; earlier releases take the first idle)."""
    out: dict[str, Any] = {}
    last: dict[Any, Any] = {}
    for name, bucket, slot in log:
        o = out.setdefault(name, {"allocations": 0, "slot_changed": 0, "first": []})
        o["allocations"] += 1
        key = (name, bucket)
        if key in last and last[key] != slot:
            o["slot_changed"] += 1
        last[key] = slot
        if len(o["first"]) < 24:
            o["first"].append([bucket, slot])
    return out
