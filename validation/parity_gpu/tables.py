"""The tables of ``docs/PARITY.md`` from the records of GPU calls (``--report``): each case's
verdict, and the relative differences that the MATCH and MISMATCH cases measured (where the noise
floors of ``mfsdp_hotfix/parity/comparison.py`` must sit)."""

from __future__ import annotations

import math
from typing import Any

from .plan import GROUPS, RELEASES, plan

LAYERS = {"te": "TE", "local": "local"}
MODELS = {"gpt": "GPT", "moe": "MoE", "moe-opfuser": "MoE, TE op fuser"}


def joined(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every case once, in the plan's order: a later record's run of a case replaces an earlier
    one, unless the later one was not run."""
    by_id: dict[str, dict[str, Any]] = {}
    for rec in records:
        for r in rec["results"]:
            if r["id"] not in by_id or r.get("outcome") != "not run":
                by_id[r["id"]] = r
    order = {c["id"]: i for i, c in enumerate(plan(RELEASES, GROUPS))}
    return sorted(by_id.values(), key=lambda r: (order.get(r["id"], len(order)), r["id"]))


def number(x: Any) -> str:
    if not isinstance(x, (int, float)):
        return "–"
    return "0" if x == 0 else f"{x:.2g}" if math.isfinite(x) else str(x)


def verdict_cell(verdict: str | None, r: dict[str, Any]) -> str:
    if verdict:
        return f"**{verdict}**"
    why = str(r.get("error") or f"exit status {r.get('rc')}").split("\n")[0]
    return f"{r.get('outcome', '?')}: {why.replace('|', '/')[:80]}"


def variant_cell(r: dict[str, Any], shipped: bool) -> str:
    words = ["as shipped (`--with-shipped`)" if shipped else r["variant"]]
    if r["wgrad"] == "apart":
        words.append("wgrad apart")
    if r["dp"] == 2:
        words.append("2 ranks, fake group")
    return ", ".join(words)


def verdict_rows(results: list[dict[str, Any]]) -> list[str]:
    """One row per compared run: a ``--with-shipped`` check gives two (the hotfix's and the
    shipped run's), with the one time the check took."""
    out = ["| verdict | expected | release | layers | dtype | ZeRO | model | variant | "
           "first-iteration grad-norm rel. diff | parity check |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        runs = [(r.get("verdict"), r.get("expected"), r.get("first_grad_norm_rel"), False)]
        if r.get("shipped"):
            runs.append((r.get("shipped_verdict"), r.get("expected_shipped"),
                         (r.get("shipped_differences") or {}).get("first_grad_norm_rel"), True))
        took = f"{r['wall_s']:.0f} s" if isinstance(r.get("wall_s"), (int, float)) else "–"
        for verdict, expected, rel, shipped in runs:
            out.append(f"| {verdict_cell(verdict, r)} | {expected or 'recorded'} | "
                       f"{r['release']} | {LAYERS[r['impl']]} | {r['dtype']} | {r['zero']} | "
                       f"{MODELS[r['model']]} | {variant_cell(r, shipped)} | {number(rel)} | "
                       f"{took} |")
    return out


def compared(results: list[dict[str, Any]]):
    """(dtype, verdict, differences, name) of every compared run that has a verdict."""
    for r in results:
        if r.get("verdict"):
            yield r["dtype"], r["verdict"], r, r["id"]
        shipped = r.get("shipped_differences")
        if r.get("shipped_verdict") and shipped:
            yield r["dtype"], r["shipped_verdict"], shipped, r["id"] + " (shipped run)"


def largest(values: list[float]) -> float | None:
    finite = [v for v in values if isinstance(v, (int, float))]
    return max(finite) if finite else None


def floor_rows(results: list[dict[str, Any]]) -> list[str]:
    """Per dtype and verdict: how many runs, the largest relative difference of the first
    iteration (grad norm, and any metric) and of the later iterations, and for MISMATCH the
    smallest first-iteration grad-norm difference (the gap a floor must stay under)."""
    out = ["| dtype | verdict | runs | first iteration: grad norm, largest | first iteration: "
           "any metric, largest | later iterations: any metric, largest | first iteration: "
           "grad norm, smallest |", "|---|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for dtype, verdict, d, _ in compared(results):
        groups.setdefault((dtype, verdict), []).append(d)
    for (dtype, verdict), ds in sorted(groups.items()):
        grad = [d.get("first_grad_norm_rel") for d in ds]
        first = [v for d in ds for v in (d.get("first") or {}).values()]
        later = [v for d in ds for v in (d.get("later") or {}).values()]
        finite = [v for v in grad if isinstance(v, (int, float))]
        out.append(f"| {dtype} | {verdict} | {len(ds)} | {number(largest(grad))} | "
                   f"{number(largest(first))} | {number(largest(later))} | "
                   f"{number(min(finite) if finite else None)} |")
    return out


def report(records: list[dict[str, Any]]) -> str:
    """Table 1: the verdicts; table 2: the relative differences by dtype and verdict."""
    results = joined(records)
    return "\n".join(verdict_rows(results) + [""] + floor_rows(results))


def floor_violations(results: list[dict[str, Any]], floors: dict[str, Any]) -> list[str]:
    """Where the floors (``mfsdp_hotfix.parity.floors.FLOORS``: ``first`` and ``later`` per
    precision) disagree with the recorded verdicts: a MATCH run whose difference lies above its
    floor (the floor was lowered below the noise measured), or a MISMATCH run none of whose
    differences lies above it (the floor was raised over a defect measured)."""
    out = []
    for dtype, verdict, d, name in compared(results):
        floor = floors.get(dtype)
        if floor is None or verdict not in ("MATCH", "MISMATCH"):
            continue
        above = [f"{part} iteration(s), {metric}: {rel:.2g} > {limit:g}"
                 for part, limit in (("first", floor.first), ("later", floor.later))
                 for metric, rel in (d.get(part) or {}).items() if rel > limit]
        if verdict == "MATCH" and above:
            out.append(f"{name} ({dtype}): MATCH recorded, but " + "; ".join(above))
        if verdict == "MISMATCH" and not above:
            out.append(f"{name} ({dtype}): MISMATCH recorded, but no difference lies above the "
                       f"floors {floor.first:g} / {floor.later:g}")
    return out
