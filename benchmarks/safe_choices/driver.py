"""The driver: groups one after another under the time budget, each group's workers started in
parallel and then given turns one at a time, one record per turn, a line of progress each."""

from __future__ import annotations

import time

from .plan import turns

IDENTITY = ("gpu", "torch", "te", "release_version", "n_params")  # copied into each turn


def drive(groups, start_worker, budget_s, hard_limit_s, after_each=None, clock=time.monotonic):
    """Measure every group: start its workers (one process per variant, built once, in
    parallel; nothing is timed then), then give them turns one at a time, and stop them.

    A group starts only if it fits in what is left of ``budget_s`` at the longest group time
    seen so far (the first group always runs); no turn starts that could end past
    ``hard_limit_s``. Returns one record per turn, the workers' start-up reports, and what was
    not run, with why."""
    t0 = clock()
    records, started, skipped, group_s, turn_s = [], [], [], [], [0.0]
    for group in groups:
        left = budget_s - (clock() - t0)
        if records and max(group_s, default=0.0) > left:
            skipped.append(dict(group=group["group"], turns=len(turns(group)),
                                reason=f"a group took {max(group_s):.0f} s; {left:.0f} s were "
                                       f"left of --budget-s {budget_s:.0f}"))
            continue
        g0 = clock()
        workers = [start_worker(spec) for spec in group["workers"]]
        try:
            ready = [w.ready() for w in workers]
            started.extend(ready)
            for spec, info in zip(group["workers"], ready, strict=True):
                print(short_start(spec, info), flush=True)
            for n, (rep, i) in enumerate(turns(group)):
                spec = group["workers"][i]
                if clock() - t0 + max(turn_s) > hard_limit_s:
                    skipped.append(dict(group=group["group"], turns=len(turns(group)) - n,
                                        reason=f"stopped before rep{rep} {spec['variant']}: "
                                               f"--hard-limit-s {hard_limit_s:.0f}"))
                    break
                if ready[i].get("ok"):
                    start = clock()
                    result = dict(workers[i].turn(rep))
                    turn_s.append(clock() - start)
                    result["turn_s"] = round(turn_s[-1], 2)
                else:
                    why = ready[i].get("error") or ready[i].get("invalid") or "?"
                    result = dict(ok=False, error=f"start-up failed: {why}")
                rec = dict(group=group["group"], release=group["release"], zero=group["zero"],
                           variant=spec["variant"], rep=rep,
                           result={**{k: ready[i].get(k) for k in IDENTITY}, **result})
                records.append(rec)
                print(short(rec), flush=True)
                if after_each is not None:
                    after_each(records, started, skipped)
        finally:
            for w in workers:
                w.close()
        group_s.append(clock() - g0)
    return records, started, skipped



def short(rec):
    res = rec["result"]
    head = f"{rec['group']} rep{rec['rep']} {rec['variant']:<8}"
    if res.get("ok"):
        return (f"ok   {head} median {res['step_ms_median']:.2f} ms [p10 {res['step_ms_p10']:.2f}"
                f" p90 {res['step_ms_p90']:.2f}] {res.get('gemm_tflops')} TFLOP/s peak "
                f"{res['peak_mem_mb']:.0f} MB turn {res.get('turn_s')} s")
    return f"FAIL {head}: {res.get('error')}"


def short_start(spec, info):
    head = f"{spec['group']} {spec['variant']:<8}"
    if info.get("ok"):
        return (f"up   {head} in {info.get('start_s')} s {info.get('phases_s')} "
                f"hotfix {info.get('hotfix_state', 'not loaded')} {info.get('hotfix_applied', '')}")
    return f"DOWN {head}: {info.get('error') or info.get('invalid')}"
