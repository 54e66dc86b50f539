"""The tables of docs/ACCUMULATION.md and docs/RELEASE_DEFECTS.md, printed from the record
docs/accumulation.json (``tests/claims.py`` checks that the docs hold exactly these rows).

Reads the record only (no torch, no release): ``python tests/real_library/accumulation_report.py``.
Each row pairs a configuration as shipped with the same configuration with the hotfix; a cell is
``exact``, ``wrong`` with its max abs error and causes, ``refused`` (the hotfix raised before
training) or ``cannot run`` (the release lacks an option the configuration needs).
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path
from typing import Any

RECORD = Path(__file__).resolve().parents[2] / "docs" / "accumulation.json"
HOTFIX_ON = "/hotfix-on"


def cell(got: dict[str, Any] | None) -> str:
    if got is None:
        return "-"
    if got["outcome"] == "wrong":
        return f"wrong {got['max_abs_grad_error']:g} ({', '.join(got['cause'])})"
    return {"exact": "exact", "refused": "refused",
            "cannot-run": "cannot run"}.get(got["outcome"], got["outcome"])


def configuration(case: dict[str, Any]) -> list[str]:
    return [case["release"].replace("git:main", "NVIDIA main"), case["layout"], case["protocol"],
            case["linear"], case["grad_reduce"], str(case["microbatches"]),
            "on" if case["overlap_grad_reduce"] else "off"]


HEADER = ["release", "layout", "protocol", "linear", "grad reduce", "microbatches", "overlap",
          "as shipped", "with the hotfix"]


def paired(record: dict[str, Any], keep: Any) -> list[list[str]]:
    """One row per configuration of ``keep(case)``, as shipped and with the hotfix."""
    rows = []
    for key, got in sorted(record.items()):
        if key.endswith(HOTFIX_ON) or not keep(got["case"]):
            continue
        rows.append(configuration(got["case"]) + [cell(got), cell(record.get(key + HOTFIX_ON))])
    for key, got in sorted(record.items()):  # rows run with the hotfix only
        if key.endswith(HOTFIX_ON) and key[:-len(HOTFIX_ON)] not in record and keep(got["case"]):
            rows.append(configuration(got["case"]) + ["-", cell(got)])
    return rows


def by_cause(record: dict[str, Any]) -> list[list[str]]:
    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for got in record.values():
        for cause in got["cause"]:
            counts[cause][got["case"]["hotfix"]] += 1
    outcomes = collections.Counter((got["case"]["hotfix"], got["outcome"])
                                   for got in record.values())
    rows = [[cause, str(c["off"]), str(c["on"])] for cause, c in sorted(counts.items())]
    rows += [[f"({outcome})", str(outcomes["off", outcome]), str(outcomes["on", outcome])]
             for outcome in ("exact", "wrong", "refused", "cannot-run")]
    return rows


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def main() -> int:
    record = json.loads(RECORD.read_text())
    print("Rows by cause (a row can have two), and by outcome:\n")
    print(table(["cause", "rows as shipped", "rows with the hotfix"], by_cause(record)))
    print("\nGroups of one rank (one rank in all, or an expert layer's data-parallel group):\n")
    print(table(HEADER, paired(record, lambda c: c["layout"].endswith(("-world1", "-expert")))))
    print("\nHSDP (DP-Outer 2 x DP-Shard 2), each inner strategy:\n")
    print(table(HEADER, paired(record, lambda c: c["layout"].startswith("hsdp"))))
    print("\nThe other rows, two ranks:\n")
    print(table(HEADER, paired(record, lambda c: not c["layout"].startswith("hsdp")
                               and not c["layout"].endswith(("-world1", "-expert")))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
