"""Step times of a case from CUDA events: the median and spread that the performance tables show."""

from __future__ import annotations

from typing import Any


def pct(sorted_vals: list[float], q: float) -> float:
    if len(sorted_vals) == 1:
        return sorted_vals[0]
    k = (len(sorted_vals) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (k - lo)


def step_times(events: list[tuple[Any, Any]]) -> dict[str, Any]:
    """Every timed step's milliseconds (``(start, end)`` CUDA events, synchronized), then their
    median, minimum, maximum, 10th and 90th percentiles."""
    times = sorted(a.elapsed_time(b) for a, b in events)
    out: dict[str, Any] = {"step_ms_all": [round(a.elapsed_time(b), 3) for a, b in events]}
    if times:
        out.update(step_ms_median=round(pct(times, 50), 3), step_ms_min=round(times[0], 3),
                   step_ms_max=round(times[-1], 3), step_ms_p10=round(pct(times, 10), 3),
                   step_ms_p90=round(pct(times, 90), 3))
    return out
