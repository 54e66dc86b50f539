#!/usr/bin/env python3
"""Print the markdown tables of docs/VALIDATION.md from the raw JSON in docs/validation/.

    python3 validation/report.py [docs/validation]

Every number printed comes from a case record written on the GPU by harness.py; nothing is
recomputed except medians over repeated runs and the ratios in the performance table.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = os.path.join(os.path.dirname(HERE), "docs", "validation")
RELS = ["fsdp-0.4.0", "fsdp-0.5.1", "fsdp-0.6.1", "core-0.18.2", "core-0.19.2"]


def load(folder):
    cases = {}
    for path in sorted(glob.glob(os.path.join(folder, "call*.json"))):
        with open(path) as f:
            doc = json.load(f)
        for c in doc["cases"]:
            c["_file"] = os.path.basename(path)
            if c.get("skipped") and c["label"] in cases:
                continue  # keep a run over a later skip of the same label
            if c["label"] in cases and not cases[c["label"]].get("skipped") and "smoke" in path:
                continue
            cases[c["label"]] = c
    return cases


def esc(label):
    return label.replace("|", "\\|")


def cell(c):
    if c is None:
        return "not run"
    if c.get("skipped"):
        if "no truth file" in c["skipped"]:
            return "not run (its serialized truth crashed)"
        return "skipped (" + c["skipped"].split("(")[0].strip() + ")"
    r = c.get("result") or {}
    if not r:
        return f"harness failure rc={c.get('rc')}"
    if r.get("crashed"):
        err = r.get("error") or ""
        return "**crash**: " + (err.split("|")[0][:60])
    rel, mx = r.get("rel_l2"), r.get("max_abs")
    verdict = r.get("comparison")  # mfsdp_hotfix/compare.py's, in newer records
    if verdict is not None:
        if verdict["outcome"] == "exact":
            return "0 (bit-identical)"
        if rel is None:
            return "**wrong**: " + (verdict.get("not_exact_because") or ["?"])[0][:60]
    elif rel is None:
        return "ran (no comparison)"
    elif not rel and not mx:
        # recorded before the bit comparison: no difference in value (a NaN or Inf would have
        # made rel_l2 NaN), so only a sign of zero could differ unseen
        return "0 (equal values)"
    return f"**{rel:.3g}** ({mx:.2g})"


def correctness_table(cases, unit, zero=2, pg="fake", delays=(0, 5, 20, 50),
                      variants=("nodb", "db", "db+hotfix")):
    names = {"nodb": "no double buffer", "db": "double buffer, as shipped",
             "db+hotfix": "double buffer + `import mfsdp_hotfix`", "db+ref": "double buffer + validation/refpatch"}
    out = ["| release | run | truth run | " + " | ".join(f"RS delay {d} ms" for d in delays) + " |",
           "|---|---|---|" + "---|" * len(delays)]
    for rel in RELS:
        for v in variants:
            t = cases.get(f"{rel}|z{zero}|{unit}|truth:{v}")
            tcell = "not run" if t is None else (
                "**crash**" if (t.get("result") or {}).get("crashed") else
                ("ok" if t.get("result") else cell(t)))
            row = [rel, names[v], tcell]
            for d in delays:
                row.append(cell(cases.get(f"{rel}|z{zero}|{unit}|{pg}|{v}|d{d}")))
            out.append("| " + " | ".join(row) + " |")
    return "\n".join(out)


def listing(cases, labels):
    out = ["| case | steps | result: rel. L2 (max abs) vs serialized truth | first step that "
           "differs | peak MB | raw file |", "|---|---|---|---|---|---|"]
    for lab in labels:
        c = cases.get(lab)
        r = (c or {}).get("result") or {}
        fb = r.get("first_bad_step")
        steps = r.get("steps_done", "")
        out.append(f"| `{esc(lab)}` | {steps} | {cell(c)} | {'' if fb is None else fb} | "
                   f"{r.get('peak_mem_mb', '')} | {(c or {}).get('_file', '')} |")
    return "\n".join(out)


def peak_table(cases):
    out = ["| release | unit | no double buffer | double buffer, as shipped | "
           "double buffer + hotfix |", "|---|---|---|---|---|"]
    for unit in ("fused", "norm"):
        for rel in RELS:
            row = [rel, unit]
            for v in ("nodb", "db", "db+hotfix"):
                c = cases.get(f"{rel}|z2|{unit}|fake|{v}|d0") or {}
                r = c.get("result") or {}
                if r.get("peak_mem_mb") is None:
                    t = (cases.get(f"{rel}|z2|{unit}|truth:{v}") or {}).get("result") or {}
                    row.append("crash" if t.get("crashed") else "–")
                else:
                    row.append(f"{r['peak_mem_mb']:.0f}")
            out.append("| " + " | ".join(row) + " |")
    return "\n".join(out)


def slot_table(cases, labels):
    out = ["| case | weight-pool allocations | reallocations into another slot | "
           "grad-pool allocations | reallocations into another slot |", "|---|---|---|---|---|"]
    for lab in labels:
        r = (cases.get(lab) or {}).get("result") or {}
        st = r.get("slot_trace") or {}
        p, g = st.get("fsdp_params", {}), st.get("fsdp_grads", {})
        out.append(f"| `{esc(lab)}` | {p.get('allocations', '')} | {p.get('slot_changed', '')} | "
                   f"{g.get('allocations', '')} | {g.get('slot_changed', '')} |")
    return "\n".join(out)


def perf_table(cases):
    rows = {}
    for lab, c in cases.items():
        if "|perf|" not in lab or c.get("skipped"):
            continue
        r = c.get("result") or {}
        if not r.get("step_ms_median"):
            continue
        rel, _, _, v, d, rep = lab.split("|")
        rows.setdefault((rel, d, v), []).append(r)
    base = {}
    for (rel, d, v), rs in rows.items():
        if v == "db":
            base[(rel, d)] = statistics.median(r["step_ms_median"] for r in rs)
    out = ["| release | RS delay | run | runs | median step ms per run | p10–p90 of steps (each run) "
           "| min–max | peak allocated MB | median / upstream-as-shipped median |",
           "|---|---|---|---|---|---|---|---|---|"]
    order = {"db": 0, "db+hotfix": 1, "nodb": 2}
    for key in sorted(rows, key=lambda k: (RELS.index(k[0]), k[1], order.get(k[2], 9))):
        rel, d, v = key
        rs = rows[key]
        med = statistics.median(r["step_ms_median"] for r in rs)
        ratio = ""
        if (rel, d) in base and rel in ("fsdp-0.6.1", "core-0.19.2"):
            ratio = f"{med / base[(rel, d)]:.3f}"
        out.append("| " + " | ".join([
            rel, d.replace("d", "") + " ms", v, str(len(rs)),
            ", ".join(f"{r['step_ms_median']:.2f}" for r in rs),
            ", ".join(f"{r['step_ms_p10']:.1f}–{r['step_ms_p90']:.1f}" for r in rs),
            ", ".join(f"{r['step_ms_min']:.1f}–{r['step_ms_max']:.1f}" for r in rs),
            ", ".join(f"{r['peak_mem_mb']:.0f}" for r in rs), ratio]) + " |")
    return "\n".join(out)


def main():
    folder = sys.argv[1] if len(sys.argv) > 1 else DEFAULT
    cases = load(folder)
    print("## ZeRO-2 (`optim_grads`), fused-wgrad units only\n")
    print(correctness_table(cases, "fused"))
    print("\n## ZeRO-2, units that also hold a LayerNorm (non-fused params)\n")
    print(correctness_table(cases, "norm"))
    print("\n## Peak allocated memory at the correctness size (MB, RS delay 0)\n")
    print(peak_table(cases))
    print("\n## Controls\n")
    print(listing(cases, [
        "fsdp-0.5.1|z2|fused|nccl_sem|db|d20", "fsdp-0.5.1|z2|fused|nccl_sem|db+hotfix|d20",
        "fsdp-0.6.1|z2|fused|nccl_sem|db|d20", "fsdp-0.6.1|z2|fused|nccl_sem|db+hotfix|d20",
        "fsdp-0.5.1|z2|fused|fake|db+hotfix(MFSDP_HOTFIX=0)|d20",
        "fsdp-0.5.1|z2|fused|fake|db+ref|d20"]))
    print("\n## ZeRO-3 (`optim_grads_params`), 8 units 2048->4096->2048, 4096 tokens, "
          "8 cases in parallel on the GPU\n")
    big = [lab for lab in cases if lab.endswith("|big") and "truth" not in lab]
    print(listing(cases, big))
    print("\n## ZeRO-3, 16384 tokens, one case at a time\n")
    k16 = [lab for lab in cases if ("|16k" in lab) and "truth" not in lab]
    print(listing(cases, k16))
    print("\n## Pool-slot trace (ZeRO-3, double buffer)\n")
    print(slot_table(cases, [lab for lab in big + k16 if "head" not in lab][:12]))
    print("\n## Performance (bf16, 8 units 4096->16384->4096, 4096 tokens x 2 microbatches, "
          "ZeRO-2, 30 timed steps after 5 warm-up)\n")
    print(perf_table(cases))


if __name__ == "__main__":
    main()
