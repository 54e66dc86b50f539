"""A summary's markdown tables, as the docs hold them: ``--report`` (each run against its
serialized run, the routes, the unit tests) and ``--reference-report`` (each run against its
reference); both list the runs a later call replaced."""

from __future__ import annotations

import math
from typing import Any

import mlm_verdict

from .plan import AUDITS


def _values(xs: list[float | None] | None) -> str:
    return " / ".join("–" if x is None else f"{x:.4g}" for x in xs) if xs else "–"


def _verdict_cell(r: dict[str, Any]) -> str:
    o = r["outcome"]
    if o in ("wrong", "float noise"):
        return f"{o} ({r['max_rel']:.2g}, {r['worst'] or '?'})" if r["max_rel"] is not None \
            and math.isfinite(r["max_rel"]) else f"{o} ({r['worst'] or '?'} not finite)"
    if o in mlm_verdict.VERDICTS + ("ok",):
        return o
    why = (r.get("error") or "").split("\n")[0].replace("|", "/")[:90]
    return f"{o}: {why}" if why else o


def _model(r: dict[str, Any]) -> str:
    if not r["moe"]:
        return "GPT"
    return "MoE, TE op fuser" if r.get("op_fuser") else "MoE"


def _variant(r: dict[str, Any]) -> str:
    return f"{r['variant']} without {r['disabled_fix']}" if r.get("disabled_fix") \
        else r["variant"]


def reference_tables(doc: dict[str, Any]) -> str:
    """Markdown tables of a reference summary (``--reference-report``): world size 1 against
    DDP; two ranks fused against unfused; then, where there are any, the references that did
    not run through, and the runs a later call replaced."""
    rows = doc["rows"]
    out = ["| release | layers | model | ZeRO | wgrad | variant | verdict (max. relative "
           "difference, where) | grad norm per iteration | DDP's | status says |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["dp"] != 1 or r["layout"] == "DDP":
            continue
        said = (r.get("status") or "").split(" — ")[-1].split(":")[0] or "–"
        out.append(f"| {r['release']} | {r['layers']} | {_model(r)} | "
                   f"{r['layout'].split('-')[1]} | {'fused' if r['fusion'] else 'apart'} | "
                   f"{_variant(r)} | {_verdict_cell(r)} | {_values(r['grad_norm'])} | "
                   f"{_values(r['reference_grad_norm'])} | {said} |")
    out += ["", "| release | layers | model | ZeRO | variant | verdict (max. relative difference, "
            "where) | grad norm per iteration, fused | apart | reduced gradient, rel. L2 per "
            "iteration |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["dp"] != 2 or not r["fusion"]:
            continue
        l2 = _values(r["grad_rel_l2"]) if r["grad_rel_l2"] else "–"
        out.append(f"| {r['release']} | {r['layers']} | {_model(r)} | "
                   f"{r['layout'].split('-')[1]} | {_variant(r)} | {_verdict_cell(r)} | "
                   f"{_values(r['grad_norm'])} | {_values(r['reference_grad_norm'])} | {l2} |")
    refs = [r for r in rows if (r["layout"] == "DDP" or (r["dp"] == 2 and not r["fusion"]))
            and r["outcome"] != "ok"]
    if refs:
        out += ["", "| reference | outcome |", "|---|---|"]
        out += [f"| {r['id'].replace('|', ' ')} | {_verdict_cell(r)} |" for r in refs]
    out += replaced_table(doc.get("replaced"))
    return "\n".join(out)


def replaced_table(replaced: list[dict[str, Any]] | None) -> list[str]:
    """The runs a later call's run of the same case replaced (``summary.joined``), if any."""
    if not replaced:
        return []
    out = ["", "| run | in record | its outcome there | replaced by the run in |",
           "|---|---|---|---|"]
    for r in replaced:
        why = f": {r['error'][:80]}" if r.get("error") else ""
        out.append(f"| {r['id'].replace('|', ' ')} | {r['record']} | "
                   f"{r['outcome']}{why.replace('|', '/')} | {r['by_record']} |")
    return out


def cell(r: dict[str, Any]) -> str:
    """One run's outcome as a table cell."""
    o = r["outcome"]
    if o == "wrong":
        return f"wrong (rel. L2 {r['rel_l2']:.2g})" if r["rel_l2"] is not None else "wrong"
    if o in ("crash", "unsupported", "not run"):
        why = (r.get("error") or "").split("\n")[0].replace("|", "/")[:80]
        return f"{o}: {why}" if why else o
    return o


def report_tables(doc: dict[str, Any]) -> str:
    """Markdown tables of a summary (``--report``): DP=2 runs (one row per configuration and
    variant: its serialized run and each delay, each against the serialized run), the DP=1 and
    audit routes, and the unit tests."""
    rows = doc["rows"]
    out = ["| release | layers | ZeRO | dtype | also | variant | serialized | 0 ms | 20 ms |",
           "|---|---|---|---|---|---|---|---|---|"]
    seen: dict[tuple, dict[str, str]] = {}
    for r in rows:
        if r["group"] == "unit" or r["dp"] != 2 or r["variant"] in AUDITS:
            continue
        also = ", ".join(x for x, on in (("recompute", r["recompute"]), ("MoE", r["moe"]),
                                         ("no overlap", not r["overlap_grad_reduce"])) if on)
        layers = "local" if "|local|" in r["id"] else "TE"
        key = (r["release"], layers, r["zero"], r["dtype"], also or "–", r["variant"])
        col = "serialized" if r["serialized"] else f"{r['delay_ms']:g} ms"
        seen.setdefault(key, {})[col] = cell(r)
    not_run: dict[tuple, str] = {}
    for key, cols in seen.items():
        if all(v.startswith("not run") for v in cols.values()):
            reason = cols.get("serialized") or next(iter(cols.values()))
            not_run.setdefault(key[:5], reason.split(": ", 1)[-1])
            continue
        out.append("| " + " | ".join(str(k) for k in key) + " | " + " | ".join(
            cols.get(c, "–") for c in ("serialized", "0 ms", "20 ms")) + " |")
    if not_run:
        out += ["", "| release | layers | ZeRO | dtype | also | not run (every variant) |",
                "|---|---|---|---|---|---|"]
        out += ["| " + " | ".join(str(k) for k in key) + f" | {why} |"
                for key, why in not_run.items()]
    out += ["", "| release | layers | world size | ZeRO | route | variant | delay ms | outcome | "
            "gradient-pool allocations (pool) | audit verdict |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["group"] == "unit" or (r["dp"] == 2 and r["variant"] not in AUDITS):
            continue
        route = "torchrun, NCCL" if r["launcher"] == "torchrun" else "--fake-process-group"
        run = "serialized" if r["serialized"] else f"{r['delay_ms']:g}"
        pools = r.get("grad_pool") or "–"
        if r["grad_pool_allocations"] is not None:
            pools = f"{r['grad_pool_allocations']} ({pools})"
        layers = "local" if "|local|" in r["id"] else "TE"
        out.append(f"| {r['release']} | {layers} | {r['dp']} | {r['zero']} | {route} | "
                   f"{r['variant']} | {run} | "
                   f"{cell(r)} | {pools} | {r['audit'] or '–'} |")
    pairs = doc.get("serialized_vs_shipped")
    if isinstance(pairs, dict) and pairs:
        out += ["", "| configuration | serialized run | against the serialized run as shipped |",
                "|---|---|---|"]
        for key, p in pairs.items():
            config, variant = key.rsplit("|", 1)
            # not "wrong": neither serialized run is the truth of the other (a fix of a release
            # defect outside the double buffer changes the arithmetic on purpose)
            said = "exact" if p["outcome"] == "exact" else "differs"
            rel = "" if p["rel_l2"] is None or said == "exact" else \
                f" (rel. L2 {p['rel_l2']:.2g}, from iteration {p['first_bad_step']})"
            out.append(f"| {config.replace('|', ' ')} | {variant} | {said}{rel} |")
    out += replaced_table(doc.get("replaced"))
    out += unit_test_tables(doc.get("unit_tests") or {})
    return "\n".join(out)


ENDS = ("passed", "failed", "skipped", "xfail", "xpass", "error")


def unit_test_tables(units: dict[str, Any]) -> list[str]:
    """The unit tests, three tables: each run's count of each end (and of the collected tests
    it did not end), with the probe's word on the hotfix; the tests that neither passed nor
    skipped, by test function and end; the skipped ones, by reason."""
    if not units:
        return []
    out = ["", "| release | variant | the hotfix in the tests' process | collected | "
           + " | ".join(ENDS) + " | not ended | ends unlike as shipped | ended in one run only |",
           "|---|---|---|---|" + "---|" * len(ENDS) + "---|---|---|"]
    for rel, both in units.items():
        for variant in ("shipped", "hotfix"):
            tests = both.get(variant) or {}
            probe = (both.get("probe") or {}).get(variant) or {}
            seen = ("not loaded" if probe.get("loaded") is False else
                    f"{probe['state']}: {probe.get('verdict', '')}" if probe else "not seen")
            ends = [sum(e.split(":")[0] == end for e in tests.values()) for end in ENDS]
            collected = (both.get("collected") or {}).get(variant)
            apart = ("–", "–") if variant == "shipped" else (
                str(len(both["differ"])), str(len(both["one_run_only"])))
            out.append(f"| {rel} | {variant} | {seen.replace('|', '/')} | {collected} | "
                       + " | ".join(map(str, ends)) + f" | {(collected or 0) - len(tests)} | "
                       + " | ".join(apart) + " |")

    def grouped(keep) -> dict[tuple, int]:
        found: dict[tuple, int] = {}
        for rel, both in units.items():
            shipped, hotfix = both.get("shipped") or {}, both.get("hotfix") or {}
            for test in sorted(set(shipped) | set(hotfix)):
                ends = (shipped.get(test, "–"), hotfix.get(test, "–"))
                if keep(ends):
                    key = (rel, test.split("::")[-1].split("[")[0]) + ends
                    found[key] = found.get(key, 0) + 1
        return found

    def cell(end: str) -> str:
        return end.replace("|", "/")[:160]

    out += ["", "| release | test | cases | as shipped | with the hotfix |", "|---|---|---|---|---|"]
    out += [f"| {rel} | {test} | {n} | {cell(s)} | {cell(h)} |" for (rel, test, s, h), n in
            grouped(lambda e: any(x.split(":")[0] not in ("passed", "skipped")
                                  for x in e)).items()]
    reasons: dict[tuple, list[int]] = {}
    for (rel, _, s, h), n in grouped(lambda e: any(x.startswith("skipped") for x in e)).items():
        for i, end in enumerate((s, h)):
            if end.startswith("skipped"):
                reasons.setdefault((rel, end.split(":", 1)[1].strip()), [0, 0])[i] += n
    out += ["", "| release | skipped because | as shipped | with the hotfix |", "|---|---|---|---|"]
    out += [f"| {rel} | {cell(why)} | {n[0]} | {n[1]} |"
            for (rel, why), n in sorted(reasons.items(),
                                        key=lambda kv: (list(units).index(kv[0][0]), -kv[1][0]))]
    return out
