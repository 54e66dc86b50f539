"""The hotfix audit's counts of one harness case (``MFSDP_HOTFIX_AUDIT``), read in-process.

The audit keeps its rule state per process and a worker runs many cases, so each case starts
the counts afresh and reads them back at its end. Nothing here imports the package: with the
audit off (or the package not imported) there is nothing to reset and nothing to read.
"""

from __future__ import annotations

import sys
from typing import Any


def _audit_obj() -> Any:
    mod = sys.modules.get("mfsdp_hotfix.audit")
    return getattr(mod, "_audit", None) if mod is not None else None


def reset() -> None:
    """Start the audit's counts afresh for this case (its rule state is per process)."""
    audit = _audit_obj()
    if audit is None:
        return
    audit.steps = 0
    for copy in audit.copies.values():
        rule = copy.rule
        if rule is None:
            continue
        rule.reuses = rule.unseen = rule.unordered_count = 0
        rule.unordered.clear()
        rule.crash = None
        rule._bucket_rs.clear()
        rule._slot_reader.clear()


def read() -> dict[str, Any] | None:
    mod = sys.modules.get("mfsdp_hotfix.audit")
    snap = mod.snapshot() if mod is not None else None
    if snap is None:
        return None
    copies = [c for c in snap.get("copies", []) if c.get("audited") or c.get("note")]
    crash = next((c["crash"] for c in copies if c.get("crashed")), None)
    return {"audit": snap.get("audit"), "reuses": sum(c.get("reuses", 0) for c in copies),
            "unordered": sum(c.get("unordered", 0) for c in copies),
            "unseen": sum(c.get("unseen", 0) for c in copies), "crash": crash,
            "fixes": sorted({f for c in copies for f in c.get("fixes", [])}),
            "first_unordered": next((c.get("first_unordered") for c in copies
                                     if c.get("first_unordered")), None)}
