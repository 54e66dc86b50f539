"""Runs cases side by side in threads, each case's process on the one GPU, in queue order.

A case that others are compared with (a serialized truth, a reference) must be known to them
before they start: its future is handed to ``register`` as it is submitted, and a later case
waits on it (no wave barrier: the GPU stays busy). Each result is logged as it arrives; the
results come back in the cases' order.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from typing import Any

Case = dict[str, Any]


def run_side_by_side(cases: list[Case], run: Callable[[Case], Case], workers: int,
                     register: Callable[[Case, cf.Future], None], log: Callable[[Case], None],
                     key: str, progress: Callable[[list[Case]], None] | None = None
                     ) -> list[Case]:
    """``run`` each case on at most ``workers`` threads; ``key`` names the field that is the same
    in a case and its result (the order they come back in)."""
    out: list[Case] = []
    with cf.ThreadPoolExecutor(workers) as ex:
        futures = []
        for c in cases:
            f = ex.submit(run, c)
            futures.append(f)
            register(c, f)
        for f in cf.as_completed(futures):
            out.append(f.result())
            log(out[-1])
            if progress is not None:
                progress(out)
    order = {c[key]: i for i, c in enumerate(cases)}
    return sorted(out, key=lambda r: order[r[key]])
