"""The summary: per group and variant, every repetition's numbers and the ratios to the hotfix
taken within each repetition; and the step-time statistics of one run."""

from __future__ import annotations

import itertools
import statistics

from step_timing import pct  # stdlib-only at import

from .plan import REFERENCE, VARIANTS


def step_stats(step_ms):
    s = sorted(step_ms)
    if not s:
        return {}
    return dict(step_ms_median=round(pct(s, 50), 3), step_ms_p10=round(pct(s, 10), 3),
                step_ms_p90=round(pct(s, 90), 3), step_ms_min=s[0], step_ms_max=s[-1])



def summarize(records):
    """Per group and variant: every repetition's numbers, and the ratios to the hotfix taken
    within each repetition, summarized over repetitions."""
    out = []
    for group, items in itertools.groupby(records, key=lambda r: r["group"]):
        items = list(items)
        good = {(r["variant"], r["rep"]): r["result"] for r in items
                if (r.get("result") or {}).get("ok")}
        rows = []
        for v in VARIANTS:
            runs, time_ratios, mem_ratios = [], [], []
            for r in items:
                if r["variant"] != v["key"]:
                    continue
                res = r.get("result") or {}
                run = dict(rep=r["rep"], ok=bool(res.get("ok")), turn_s=res.get("turn_s"))
                if run["ok"]:
                    run.update({k: res[k] for k in ("step_ms_median", "step_ms_p10",
                                                    "step_ms_p90", "peak_mem_mb")})
                    ref = good.get((REFERENCE, r["rep"]))
                    if ref is not None:
                        time_ratios.append(res["step_ms_median"] / ref["step_ms_median"])
                        mem_ratios.append(res["peak_mem_mb"] / ref["peak_mem_mb"])
                else:
                    run["error"] = res.get("error") or "?"
                runs.append(run)
            ok = [run for run in runs if run["ok"]]
            all_steps = sorted(s for r in items if r["variant"] == v["key"]
                               for s in (r.get("result") or {}).get("step_ms", [])
                               if (r.get("result") or {}).get("ok"))
            rows.append(dict(variant=v["key"], title=v["title"], runs=runs, n_ok=len(ok),
                             pooled=step_stats(all_steps),
                             time_ratio=spread(time_ratios), mem_ratio=spread(mem_ratios)))
        release, zero = group.split(":")
        out.append(dict(group=group, release=release, zero=int(zero), rows=rows))
    return out


def spread(values):
    if not values:
        return None
    return dict(median=round(statistics.median(values), 4), min=round(min(values), 4),
                max=round(max(values), 4), n=len(values))
