#!/usr/bin/env python3
"""Print the tables of docs/VALIDATION.md's audit section from the raw JSON in docs/validation/.

    python3 validation/audit_report.py [docs/validation]

Reads ``audit-call4-matrix.json`` and ``audit-call4-perf.json``, the fourth GPU run of 2026-12-03
(written by ``run_matrix.py --phase audit auditperf``; the earlier runs' files, of earlier commits,
are kept as they were written). Every audit count comes from the rank file the audit itself wrote when the case's process
exited (``audit_file`` in each record); grads are compared with the case's serialized truth.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

from report import DEFAULT, RELS, cell

SHIPPED, FIXED = "db+audit", "db+hotfix+audit"
FILES = ("audit-call4-matrix.json", "audit-call4-perf.json")


def load(folder):
    cases = {}
    for name in FILES:
        path = os.path.join(folder, name)
        with open(path) as f:
            doc = json.load(f)
        for c in doc["cases"]:
            c["_file"] = os.path.basename(path)
            cases[c["label"]] = c
    return cases


def audit_cell(c):
    if c is None:
        return "not run"
    if c.get("skipped"):
        return f"skipped ({c['skipped']})"
    f = c.get("audit_file")
    if not f:
        return "**no rank file**"
    copies = f.get("copies", [])
    crash = [x["crash"] for x in copies if x.get("crashed")]
    if crash:
        return f"**crash recorded** (`{crash[0]['error'][:60]}`)"
    unordered = sum(x["unordered"] for x in copies)
    text = f"{unordered} of {sum(x['reuses'] for x in copies)}"
    return f"**{text}**" if unordered else text


def main_table(cases):
    out = ["| release | run | RS delay 0 ms: unordered of reuses | grads vs serialized truth | "
           "RS delay 20 ms: unordered of reuses | grads vs serialized truth |",
           "|---|---|---|---|---|---|"]
    names = {SHIPPED: "as shipped (`MFSDP_HOTFIX=0`)", FIXED: "with the hotfix"}
    for rel in RELS:
        for v in (SHIPPED, FIXED):
            row = [rel, names[v]]
            for d in (0, 20):
                c = cases.get(f"{rel}|z2|fused|nccl_sem|{v}|d{d}")
                grads = cell(c) if c and (c.get("result") or {}).get("rel_l2") is not None \
                    else ("not compared (its serialized run crashes)" if c else "not run")
                row += [audit_cell(c), grads]
            out.append("| " + " | ".join(row) + " |")
    return "\n".join(out)


def sweep_table(cases):
    out = ["| release | ZeRO | microbatches | double buffer, as shipped | double buffer + hotfix |",
           "|---|---|---|---|---|"]
    for rel in RELS:
        for zero in (1, 2, 3):
            for mb in (1, 2):
                row = [rel, str(zero), str(mb)]
                for v in (SHIPPED, FIXED):
                    row.append(audit_cell(cases.get(f"{rel}|z{zero}|mb{mb}|nccl_sem|{v}|d0|sweep")))
                out.append("| " + " | ".join(row) + " |")
        row = [rel, "2", "2 (no double buffer)"]
        for v in ("nodb+audit", "nodb+hotfix+audit"):
            row.append(audit_cell(cases.get(f"{rel}|z2|mb2|nccl_sem|{v}|d0|sweep")))
        out.append("| " + " | ".join(row) + " |")
    return "\n".join(out)


def perf_table(cases):
    rows = {}
    for lab, c in cases.items():
        r = c.get("result") or {}
        if "|perf|" not in lab or not r.get("step_ms_median"):
            continue
        rel, _, _, v, _, _ = lab.split("|")
        rows.setdefault((rel, v), []).append((r, c.get("audit_file")))
    out = ["| release | run | runs | median step ms per run | p10–p90 of steps (each run) | "
           "min–max | audit: unordered of reuses (each run) | median of medians / audit off |",
           "|---|---|---|---|---|---|---|---|"]
    for rel in RELS:
        off = rows.get((rel, "db+hotfix"))
        for v in ("db+hotfix", "db+hotfix+audit"):
            rs = rows.get((rel, v))
            if not rs:
                continue
            med = statistics.median(r["step_ms_median"] for r, _ in rs)
            base = statistics.median(r["step_ms_median"] for r, _ in off) if off else None
            audits = ", ".join(
                f"{sum(x['unordered'] for x in f['copies'])} of "
                f"{sum(x['reuses'] for x in f['copies'])}" if f else "–" for _, f in rs)
            out.append("| " + " | ".join([
                rel, "hotfix, audit " + ("on" if v.endswith("+audit") else "off"), str(len(rs)),
                ", ".join(f"{r['step_ms_median']:.2f}" for r, _ in rs),
                ", ".join(f"{r['step_ms_p10']:.1f}–{r['step_ms_p90']:.1f}" for r, _ in rs),
                ", ".join(f"{r['step_ms_min']:.1f}–{r['step_ms_max']:.1f}" for r, _ in rs),
                audits if v.endswith("+audit") else "", f"{med / base:.3f}" if base else ""])
                + " |")
    return "\n".join(out)


def main():
    folder = sys.argv[1] if len(sys.argv) > 1 else DEFAULT
    cases = load(folder)
    print("### As shipped and with the hotfix (ZeRO-2, 2 microbatches)\n")
    print(main_table(cases))
    print("\n### No false positives: ZeRO-1/2/3, 1 and 2 microbatches, no double buffer "
          "(RS delay 0)\n")
    print(sweep_table(cases))
    print("\n### Cost (LARGE: bf16, 8 units 4096->16384->4096, 4096 tokens x 2 microbatches, "
          "ZeRO-2, 30 timed steps after 5 warm-up, one case at a time)\n")
    print(perf_table(cases))


if __name__ == "__main__":
    main()
