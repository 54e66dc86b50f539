#!/usr/bin/env python3
"""Summaries and markdown tables from the raw files gpu_phases.py writes (``<phase>.json.gz``).

    python3 validation/gpu_report.py [RAW ...] [--write] [--include-smoke]

RAW defaults to ``docs/validation/gpu-*.json.gz``. ``--write`` writes
``docs/validation/fuzz-summary.json`` (``{release, seed, variant, outcome, max_abs_diff}``),
``te-summary.json`` (``{release, layer, fuse, zero, delay_ms, dtype, variant, te_version,
outcome, rel_l2}`` plus the audit's counts and ``delay_wgrad``), ``long-summary.json``,
``oracles-summary.json``, ``maxpool-summary.json``, ``nslot-summary.json`` and
``upstream-summary.json``. Outcomes:
``exact`` = every gradient, loss and parameter bit-identical to the serialized run of the same
variant (mfsdp_hotfix/compare.py); ``wrong`` = it ran and
something differs; ``crash`` = the run or its serialized run raised; ``unsupported`` = the harness
refused a configuration the release cannot run, before the first step. Cases a call did not reach are left out (and counted).
Nothing is recomputed: every number is copied from a case record written on the GPU.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import statistics
from collections import defaultdict
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
DOCS = os.path.join(os.path.dirname(HERE), "docs", "validation")
RELS = ["fsdp-0.4.0", "fsdp-0.5.1", "fsdp-0.6.1", "core-0.18.2", "core-0.19.2", "pr6316",
        "pr6316-rebuilt"]
FUZZ_KEYS = ("release", "seed", "variant", "outcome", "max_abs_diff")
# the harness's refusal of a configuration the release cannot run (te_layers.UnsupportedByRelease)
UNSUPPORTED = "not supported by this release"
TE_KEYS = ("release", "layer", "fuse", "zero", "delay_ms", "dtype", "variant", "te_version",
           "outcome", "rel_l2")


def load(paths: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every case record by phase and id (a phase's ids repeat in another phase: the maxpool
    phase runs the te phase's rows; a record that ran wins over a later 'not run' of the same
    case)."""
    by_id: dict[tuple[str, str], dict[str, Any]] = {}
    meta: dict[str, Any] = {}
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            doc = json.load(f)
        meta[os.path.basename(path)] = {k: doc.get(k) for k in (
            "phase", "date_utc", "complete", "phase_wall_s", "workers", "calibration",
            "te_state_at_start", "te_state_at_end")}
        for r in doc["records"]:
            r["_file"] = os.path.basename(path)
            key = (_phase(r), r.get("id"))
            old = by_id.get(key)
            if old is not None and r.get("skipped") and not old.get("skipped"):
                continue
            by_id[key] = r
    return list(by_id.values()), meta


def outcome(rec: dict[str, Any]) -> str | None:
    """exact | wrong | crash | unsupported; None when the case did not run (or is not a
    comparison). Records written before the harness flagged refusals carry the refusal as their
    error; an old record that claims exact with non-finite gradients is wrong."""
    if rec.get("skipped"):
        return None
    c = rec.get("comparison")
    if rec.get("unsupported") or UNSUPPORTED in (rec.get("error") or ""):
        return "unsupported"
    if rec.get("crashed") or (c or {}).get("outcome") == "crash":
        return "crash"
    if c is None:
        return None
    if c.get("outcome") == "exact" and rec.get("nonfinite_grads"):
        return "wrong"
    return c.get("outcome")


def _phase(rec: dict[str, Any]) -> str:
    return str((rec.get("spec") or {}).get("phase", ""))


def _is_run(rec: dict[str, Any]) -> bool:
    """An asynchronous run compared with a serialized truth."""
    return ((rec.get("spec") or {}).get("truth") or {}).get("mode") == "compare"


def _in(rec: dict[str, Any], phase: str, smoke: bool) -> bool:
    p = _phase(rec)
    return p == phase or (smoke and p == f"smoke-{phase}")


def _num(c: dict[str, Any] | None, key: str, o: str | None) -> float | None:
    if o not in ("exact", "wrong") or not c:
        return None
    v = c.get(key)
    return None if v is None else float(v)


def fuzz_summary(recs: list[dict[str, Any]], smoke: bool = False) -> list[dict[str, Any]]:
    out = []
    for r in recs:
        s = r.get("spec") or {}
        o = outcome(r)
        if not (_in(r, "fuzz", smoke) and _is_run(r)) or o is None:
            continue
        out.append({"release": s["release"], "seed": int(s["seed"]), "variant": s["variant"],
                    "outcome": o, "max_abs_diff": _num(r.get("comparison"), "max_abs_diff", o)})
    return sorted(out, key=lambda d: (_rel_index(d["release"]), d["seed"], d["variant"]))


def te_version_of(recs: list[dict[str, Any]]) -> str | None:
    return next((r["te_version"] for r in recs if r.get("te_version")), None)


def te_summary(recs: list[dict[str, Any]], smoke: bool = False, phase: str = "te"
               ) -> list[dict[str, Any]]:
    """The real-TE rows of ``phase`` ("te"; "maxpool": the same rows on MaxPoolAllocator;
    "nslot": the N-slot pool of NVIDIA PR #6316; "upstream": the change proposed upstream,
    applied to NVIDIA main and to PR #6316, without the hotfix)."""
    version = te_version_of(recs)
    out = []
    for r in recs:
        s = r.get("spec") or {}
        o = outcome(r)
        if not (_in(r, phase, smoke) and _is_run(r)) or o is None:
            continue
        audit = r.get("audit") or {}
        out.append({"release": s["release"], "layer": s["layer"], "fuse": bool(s["fuse"]),
                    "zero": int(s["zero"]), "delay_ms": s.get("delay_ms", 0), "dtype": s["dtype"],
                    "variant": s["te_variant"], "te_version": r.get("te_version") or version,
                    "outcome": o, "rel_l2": _num(r.get("comparison"), "rel_l2", o),
                    "delay_wgrad": bool(s.get("delay_wgrad")),
                    "audit_reuses": audit.get("reuses"), "audit_unordered": audit.get("unordered"),
                    "audit_unseen": audit.get("unseen"), "audit_crash": audit.get("crash"),
                    "error": (r.get("error") or "")[:200] if o in ("crash", "unsupported")
                    else None})
    return sorted(out, key=lambda d: (_rel_index(d["release"]), d["layer"], d["delay_wgrad"],
                                      not d["fuse"], d["zero"], d["dtype"], d["variant"],
                                      d["delay_ms"]))


def long_summary(recs: list[dict[str, Any]], smoke: bool = False) -> list[dict[str, Any]]:
    out = []
    for r in recs:
        s = r.get("spec") or {}
        o = outcome(r)
        if not (_in(r, "long", smoke) and _is_run(r)) or o is None:
            continue
        c = r.get("comparison") or {}
        out.append({"release": s["release"], "zero": int(s["zero"]), "variant": s["variant"],
                    "fault": bool(s.get("fault")), "steps": s.get("steps"),
                    "microbatches": s.get("microbatches"), "outcome": o,
                    "losses_exact": c.get("losses_exact"), "params_exact": c.get("params_exact"),
                    "max_abs_diff": _num(c, "max_abs_diff", o),
                    "delays": (r.get("faults") or {}).get("delayed"),
                    "error": (r.get("error") or "")[:200] if o in ("crash", "unsupported")
                    else None})
    return sorted(out, key=lambda d: (_rel_index(d["release"]), d["zero"], d["variant"],
                                      d["fault"]))


def sanitizer_verdict(rec: dict[str, Any]) -> str | None:
    if rec.get("skipped"):
        return None
    if rec.get("error_type") == "CUDASanitizerErrors":
        return "race reported"
    if rec.get("crashed"):
        return "crash: " + (rec.get("error") or "")[:80]
    return "nothing reported"


def oracle_summary(recs: list[dict[str, Any]], smoke: bool = False) -> list[dict[str, Any]]:
    rows: dict[tuple[str, int, str], dict[str, Any]] = {}
    for r in recs:
        s = r.get("spec") or {}
        if not _in(r, "oracles", smoke) or s.get("oracle") not in ("audit", "sanitizer"):
            continue
        key = (s["release"], int(s["seed"]), s["oracle_variant"])
        row = rows.setdefault(key, {"release": key[0], "seed": key[1], "variant": key[2],
                                    "layer": s.get("layer"), "outcome": None,
                                    "max_abs_diff": None, "audit_reuses": None,
                                    "audit_unordered": None, "audit_crash": None,
                                    "sanitizer": None})
        if s["oracle"] == "audit":
            o = outcome(r)
            audit = r.get("audit") or {}
            row.update(outcome=o, max_abs_diff=_num(r.get("comparison"), "max_abs_diff", o),
                       audit_reuses=audit.get("reuses"), audit_unordered=audit.get("unordered"),
                       audit_crash=audit.get("crash"))
        else:
            row["sanitizer"] = sanitizer_verdict(r)
    return sorted(rows.values(), key=lambda d: (_rel_index(d["release"]), d["seed"],
                                               d["variant"]))


def not_run(recs: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for r in recs:
        if r.get("skipped"):
            out[f"{_phase(r)}: {r['skipped']}"] += 1
    return dict(out)


def _rel_index(rel: str) -> int:
    return RELS.index(rel) if rel in RELS else len(RELS)


# ---------------------------------------------------------------------------- markdown
def _fmt(v: float | None) -> str:
    return "–" if v is None else f"{v:.3g}"


def fuzz_table(rows: list[dict[str, Any]], recs: list[dict[str, Any]]) -> str:
    kind = {}
    for r in recs:
        s = r.get("spec") or {}
        if s.get("seed") is not None and s.get("layer"):
            kind[(s.get("release"), int(s["seed"]))] = "TE" if s["layer"] != "emulated" else "emulated"
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for d in rows:
        groups[(d["release"], d["variant"], kind.get((d["release"], d["seed"]), "?"))].append(d)
    out = ["| release | variant | layers | seeds | exact | wrong | crash | largest max abs diff "
           "| median max abs diff of the wrong ones |", "|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(groups, key=lambda k: (_rel_index(k[0]), k[1], k[2])):
        g = groups[key]
        n = {o: sum(d["outcome"] == o for d in g) for o in ("exact", "wrong", "crash")}
        wrong = [d["max_abs_diff"] for d in g if d["outcome"] == "wrong"]
        diffs = [d["max_abs_diff"] for d in g if d["max_abs_diff"] is not None]
        out.append(f"| {key[0]} | {key[1]} | {key[2]} | {len(g)} | {n['exact']} | "
                   f"{n['wrong']} | {n['crash']} | {_fmt(max(diffs) if diffs else None)} | "
                   f"{_fmt(statistics.median(wrong) if wrong else None)} |")
    return "\n".join(out)


def fuzz_factor_table(rows: list[dict[str, Any]], recs: list[dict[str, Any]]) -> str:
    """How often the shipped code is wrong or crashes, by configuration factor (all eras)."""
    spec_of = {(r["spec"]["release"], int(r["spec"]["seed"]), r["spec"]["variant"]): r["spec"]
               for r in recs if _in(r, "fuzz", True) and _is_run(r) and "seed" in r["spec"]}
    factors = {
        "ZeRO": lambda s: s["zero"], "dtype": lambda s: s["dtype"],
        "microbatches": lambda s: s["microbatches"],
        "unit with a non-fused layer": lambda s: any(u["norm"] for u in s["units"]),
        "RS delays declared (p > 0)": lambda s: (s["faults"].get("rs") or {}).get("p", 0) > 0,
        "AG delays declared (p > 0)": lambda s: (s["faults"].get("ag") or {}).get("p", 0) > 0,
        "compute delays declared (p > 0)": lambda s: (s["faults"].get("compute") or {}).get("p", 0) > 0,
    }
    out = ["| factor | value | variant | runs | wrong | crash |", "|---|---|---|---|---|---|"]
    for name, f in factors.items():
        groups: dict[tuple[str, str], list[str]] = defaultdict(list)
        for d in rows:
            s = spec_of.get((d["release"], d["seed"], d["variant"]))
            if s is not None:
                groups[(str(f(s)), d["variant"])].append(d["outcome"])
        for (value, variant), outs in sorted(groups.items()):
            out.append(f"| {name} | {value} | {variant} | {len(outs)} | "
                       f"{outs.count('wrong')} | {outs.count('crash')} |")
    return "\n".join(out)


def _cell(o: str | None, value: float | None, error: str | None = None) -> str:
    if o is None:
        return "not run"
    if o == "exact":
        return "0 (bit-identical)"
    if o == "crash":
        return "**crash**" + (f": {error.split('|')[0][:50]}" if error else "")
    if o == "unsupported":
        return "unsupported by the release"
    return f"**{_fmt(value)}**"


def te_table(rows: list[dict[str, Any]]) -> str:
    cells: dict[tuple[Any, ...], dict[tuple[str, Any], dict[str, Any]]] = defaultdict(dict)
    for d in rows:
        key = (d["release"], d["layer"], d["fuse"], d["delay_wgrad"], d["zero"], d["dtype"])
        cells[key][(d["variant"], d["delay_ms"])] = d
    out = ["| release | layer | fused wgrad | delayed wgrad | ZeRO | dtype | shipped, 0 ms | "
           "shipped, 20 ms | hotfix, 0 ms | hotfix, 20 ms | audit, shipped 20 ms: unordered / "
           "reuses | audit, hotfix 20 ms |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(cells, key=lambda k: (_rel_index(k[0]), *k[1:])):
        row = cells[key]
        vals = []
        for variant in ("shipped", "hotfix"):
            for delay in (0, 20):
                d = row.get((variant, delay))
                vals.append(_cell(d["outcome"], d["rel_l2"], d.get("error")) if d else "not run")
        for variant in ("shipped", "hotfix"):
            d = row.get((variant, 20))
            if d is None or d["audit_reuses"] is None:
                vals.append("–")
            else:
                vals.append(f"{d['audit_unordered']} / {d['audit_reuses']}" +
                            (" (crash seen)" if d["audit_crash"] else ""))
        rel, layer, fuse, dw, zero, dtype = key
        out.append(f"| {rel} | {layer} | {'on' if fuse else 'off'} | {'yes' if dw else 'no'} | "
                   f"{zero} | {dtype} | " + " | ".join(vals) + " |")
    return "\n".join(out)


def long_table(rows: list[dict[str, Any]]) -> str:
    out = ["| release | ZeRO | variant | fault | outcome | losses bit-identical | final params "
           "bit-identical | max abs grad diff |", "|---|---|---|---|---|---|---|---|"]
    for d in rows:
        out.append(f"| {d['release']} | {d['zero']} | {d['variant']} | "
                   f"{'yes' if d['fault'] else 'no'} | {_cell(d['outcome'], d['max_abs_diff'], d['error'])} | "
                   f"{d['losses_exact']} | {d['params_exact']} | {_fmt(d['max_abs_diff'])} |")
    return "\n".join(out)


def oracle_table(rows: list[dict[str, Any]]) -> str:
    out = ["| release | seed | layers | variant | gradients vs serialized (max abs diff) | "
           "audit: unordered / reuses | CUDA stream sanitizer |", "|---|---|---|---|---|---|---|"]
    for d in rows:
        audit = ("–" if d["audit_reuses"] is None else
                 f"{d['audit_unordered']} / {d['audit_reuses']}" +
                 (" (crash seen)" if d["audit_crash"] else ""))
        out.append(f"| {d['release']} | {d['seed']} | {d['layer']} | {d['variant']} | "
                   f"{_cell(d['outcome'], d['max_abs_diff'])} | {audit} | "
                   f"{d['sanitizer'] or 'not run'} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("raw", nargs="*")
    ap.add_argument("--write", action="store_true", help="write the summaries to docs/validation")
    ap.add_argument("--include-smoke", action="store_true")
    ap.add_argument("--docs", default=DOCS)
    a = ap.parse_args()
    paths = a.raw or sorted(glob.glob(os.path.join(DOCS, "gpu-*.json.gz")))
    recs, meta = load(paths)
    smoke = a.include_smoke
    summaries = {"fuzz": fuzz_summary(recs, smoke), "te": te_summary(recs, smoke),
                 "long": long_summary(recs, smoke), "oracles": oracle_summary(recs, smoke),
                 "maxpool": te_summary(recs, smoke, phase="maxpool"),
                 "nslot": te_summary(recs, smoke, phase="nslot"),
                 "upstream": te_summary(recs, smoke, phase="upstream")}
    if a.write:
        for name, rows in summaries.items():
            if rows:
                with open(os.path.join(a.docs, f"{name}-summary.json"), "w") as f:
                    json.dump(rows, f, indent=1)
                    f.write("\n")
    print("## Schedule fuzzer\n")
    print(fuzz_table(summaries["fuzz"], recs))
    print("\n## Schedule fuzzer: by configuration factor\n")
    print(fuzz_factor_table(summaries["fuzz"], recs))
    bad = [d for d in summaries["fuzz"] if d["variant"] == "hotfix" and d["outcome"] != "exact"]
    print("\nHotfix seeds not bit-identical: " +
          (", ".join(f"{d['release']} seed {d['seed']} ({d['outcome']})" for d in bad) or "none"))
    print("\n## Long runs\n")
    print(long_table(summaries["long"]))
    print("\n## Oracles\n")
    print(oracle_table(summaries["oracles"]))
    print("\n## Real TransformerEngine\n")
    print(te_table(summaries["te"]))
    if summaries["maxpool"]:
        print("\n## Real TransformerEngine on MaxPoolAllocator\n")
        print(te_table(summaries["maxpool"]))
    if summaries["nslot"]:
        print("\n## Real TransformerEngine on an N-slot pool (fsdp_buffer_count)\n")
        print(te_table(summaries["nslot"]))
    if summaries["upstream"]:
        print("\n## Real TransformerEngine on the change proposed upstream (MFSDP_HOTFIX=0)\n")
        print(te_table(summaries["upstream"]))
    skipped = not_run(recs)
    if skipped:
        print("\nNot run: " + "; ".join(f"{n} × {k}" for k, n in sorted(skipped.items())))
    print("\nRaw files: " + ", ".join(f"{k} ({v.get('phase')}, {v.get('date_utc')}, "
                                      f"complete={v.get('complete')})" for k, v in meta.items()))


if __name__ == "__main__":
    main()
