"""A phase's records, as gpu_phases.py collects them: written to the phase's raw file while they
come in (a run cut short leaves what it had), and summarized in one console line at its end.
"""

from __future__ import annotations

import gzip
import json
import os
import time
from typing import Any


class Output:
    """One gzip'd JSON per phase, rewritten (at most every 20 s) as records come in."""

    def __init__(self, out: str, phase: str, meta: dict[str, Any]) -> None:
        self.path = os.path.join(out, f"{phase}.json.gz")
        self.doc = dict(meta, phase=phase, records=[], complete=False)
        self.last = 0.0

    def add(self, recs: list[dict[str, Any]]) -> None:
        self.doc["records"] += [slim(r) for r in recs]
        if time.time() - self.last > 20:
            self.write()

    def write(self, complete: bool = False) -> None:
        self.doc["complete"] = complete
        self.doc["written_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        tmp = self.path + ".tmp"
        with gzip.open(tmp, "wt") as f:
            json.dump(self.doc, f, default=str)
        os.replace(tmp, self.path)
        self.last = time.time()


def slim(rec: dict[str, Any]) -> dict[str, Any]:
    """Drop what makes the raw file big and says nothing (the full hotfix status per case)."""
    r = dict(rec)
    st = r.pop("hotfix_status", None)
    if isinstance(st, dict):
        r["hotfix_summary"] = {k: st.get(k) for k in ("mfsdp_hotfix", "hotfix", "failures")}
        r["hotfix_fixes"] = [{"package": c.get("package"), "era": c.get("era"),
                              "fixes": {name: f.get("state") for name, f in
                                        (c.get("fixes") or {}).items()}}
                             for c in st.get("copies", [])][:3]
    return r


def summarize(recs: list[dict[str, Any]]) -> str:
    counts: dict[tuple[str, str], dict[str, int]] = {}
    for r in recs:
        s = r.get("spec") or {}
        if (s.get("truth") or {}).get("mode") == "save":
            key = ("serialized", "crash" if r.get("crashed") else
                   ("skipped" if r.get("skipped") else "saved"))
        elif s.get("oracle") == "sanitizer":
            key = ("sanitizer:" + str(s.get("variant")),
                   "race reported" if r.get("error_type") == "CUDASanitizerErrors" else
                   ("crash" if r.get("crashed") else ("skipped" if r.get("skipped") else "clean")))
        else:
            v = s.get("te_variant") or s.get("oracle_variant") or s.get("variant")
            key = (str(v), r.get("skipped") and "skipped" or
                   (r.get("comparison") or {}).get("outcome", "crash" if r.get("crashed")
                                                   else "?"))
        d = counts.setdefault((key[0], ""), {})
        d[key[1]] = d.get(key[1], 0) + 1
    return "; ".join(f"{k[0]}: " + ", ".join(f"{n} {o}" for o, n in sorted(v.items()))
                     for k, v in sorted(counts.items()))
