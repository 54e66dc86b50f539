"""A call's raw records as summaries: several records joined into one (a later call's run of a
case replaces an earlier one), then one row per run without machine paths, the unit tests'
ends side by side, and the runs judged against a reference (``REFERENCE_GROUPS``) apart."""

from __future__ import annotations

import gzip
import json
import re
from typing import Any

import mlm_verdict

from .plan import ITERS, MICROBATCHES, REFERENCE_GROUPS, SIZE

ROW_KEYS = ("id", "group", "release", "dp", "launcher", "zero", "dtype", "overlap_grad_reduce",
            "overlap_param_gather", "recompute", "moe", "variant", "delay_ms", "serialized",
            "outcome", "rel_l2", "max_abs", "first_bad_step", "iterations", "grad_pool",
            "grad_pool_allocations", "audit", "error")


def row(r: dict[str, Any]) -> dict[str, Any]:
    """One summary row (``ROW_KEYS``) of a run's record."""
    cmp = r.get("comparison") or {}
    cap = r.get("capture") or {}
    pools = cap.get("pool_allocations") or {}
    grad_pools = [v for k, v in pools.items() if k.endswith("main_grad_alloc")]
    unit = r["group"] == "unit"
    return {"id": r["id"], "group": r["group"], "release": r["release"],
            "dp": None if unit else r["dp"], "launcher": None if unit else r["launcher"],
            "zero": None if unit else r["zero"], "dtype": None if unit else r["dtype"],
            "overlap_grad_reduce": None if unit else r["overlap_grad_reduce"],
            "overlap_param_gather": None if unit else r["overlap_param_gather"],
            "recompute": None if unit else r["recompute"], "moe": None if unit else r["moe"],
            "variant": r["variant"], "delay_ms": None if unit else r["delay_ms"],
            "serialized": r["serialized"], "outcome": r["outcome"],
            "rel_l2": cmp.get("rel_l2"), "max_abs": cmp.get("max_abs_diff"),
            "first_bad_step": cmp.get("first_bad_step"),
            "iterations": None if unit else cap.get("iterations", 0),
            # no gradient pool built (the release's own choice: no FSDP unit) is not the same as
            # a pool that never handed a slot out (one data-parallel rank)
            "grad_pool": None if unit or not pools else
            (grad_pools[0]["class"] if grad_pools else "none built"),
            "grad_pool_allocations": None if unit or not grad_pools else
            sum(v["calls"] for v in grad_pools),
            "audit": r.get("audit"),
            "error": None if r["outcome"] in ("exact", "ok") else (r.get("error") or "")[:300]}


def unit_test_table(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per release: each test's end as shipped and with the hotfix, the tests whose ends differ
    (of those that ended in both runs), those that ended in one run only (one run was cut, or
    its process died), which run was cut, and what the probe saw of the hotfix in each run's
    process."""
    out: dict[str, Any] = {}
    for r in results:
        if r["group"] != "unit" or not r.get("tests"):
            continue
        out.setdefault(r["release"], {})[r["variant"]] = r["tests"]
        out[r["release"]].setdefault("probe", {})[r["variant"]] = r.get("hotfix")
        out[r["release"]].setdefault("cut", {})[r["variant"]] = r.get("error") if r.get(
            "cut") else None
        out[r["release"]].setdefault("collected", {})[r["variant"]] = r.get("collected")
    for both in out.values():
        s, h = both.get("shipped") or {}, both.get("hotfix") or {}
        both["differ"] = sorted(t for t in set(s) & set(h)
                                if s[t].split(":")[0] != h[t].split(":")[0])
        both["one_run_only"] = sorted(set(s) ^ set(h))
    return out


def summary(report: dict[str, Any]) -> dict[str, Any]:
    results = report["results"]
    return {"gpu": report.get("env", {}).get("gpu"), "torch": report.get("env", {}).get("torch"),
            "te": te_versions(results), "checkouts": checkouts(report),
            "iterations": ITERS, "microbatches": MICROBATCHES, "size": SIZE,
            "rows": [row(r) for r in results], "unit_tests": unit_test_table(results),
            "serialized_vs_shipped": report.get("serialized_vs_shipped"),
            "replaced": report.get("replaced", [])}


def checkouts(report: dict[str, Any]) -> dict[str, Any]:
    """The record's checks of the checkouts, without the folders they were in (a summary holds
    no path of the machine it ran on)."""
    return {rel: {k: v for k, v in check.items() if k != "checkout"}
            for rel, check in (report.get("checkouts") or {}).items()}


REFERENCE_ROW_KEYS = ("id", "group", "release", "dp", "layers", "layout", "fusion", "moe",
                      "op_fuser", "variant", "disabled_fix", "reference", "outcome",
                      "iterations", "loss", "grad_norm",
                      "reference_loss", "reference_grad_norm", "grad_rel_l2", "max_rel", "worst",
                      "first_off", "status", "protected", "error")
LOSS = "loss/lm loss"


def reference_row(r: dict[str, Any], by_id: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One summary row (``REFERENCE_ROW_KEYS``) of a run of ``REFERENCE_GROUPS``: what it and
    its reference reported each iteration, and the verdict (``mlm_verdict``)."""
    verdict = r.get("verdict") or {}
    mine = r.get("reported") or {}
    # the reference's values as the verdict read them (its own call's reference), else as the
    # summary's reference run reported them
    theirs = {name: [it.get(name, [None, None])[1] for it in verdict["iterations"]]
              for name in (LOSS, "grad_norm")} if verdict.get("iterations") else \
        by_id.get(r.get("judge") or "", {}).get("reported") or {}
    cap = r.get("capture") or {}
    said = cap.get("hotfix_status") if isinstance(cap.get("hotfix_status"), dict) else {}
    status = (said.get("verdict") or {}) if said else {}
    outcome = r["outcome"]
    if outcome == "ran, no truth":
        outcome = "no reference"
    return {"id": r["id"], "group": r["group"], "release": r["release"], "dp": r["dp"],
            "layers": "local" if r["impl"] == "local" else "TE",
            "layout": f"ZeRO-{r['zero']}" if r["fsdp"] else "DDP", "fusion": r["fusion"],
            "moe": r["moe"], "op_fuser": r.get("op_fuser", False), "variant": r["variant"],
            "disabled_fix": r.get("disabled_fix", ""), "reference": r.get("judge"),
            "outcome": outcome, "iterations": cap.get("iterations", 0),
            "loss": mine.get(LOSS), "grad_norm": mine.get("grad_norm"),
            "reference_loss": theirs.get(LOSS), "reference_grad_norm": theirs.get("grad_norm"),
            "grad_rel_l2": [it.get("grad_rel_l2") for it in verdict["iterations"]]
            if verdict and r["dp"] == 2 else None,
            "max_rel": verdict.get("max_rel"), "worst": verdict.get("worst"),
            "first_off": verdict.get("first_off"),
            "status": status.get("line"), "protected": status.get("protected"),
            "error": None if outcome in mlm_verdict.VERDICTS + ("ok",) else
            (r.get("error") or r.get("no_truth") or "")[:300]}


def reference_summary(report: dict[str, Any]) -> dict[str, Any]:
    """The summary of the ``REFERENCE_GROUPS`` runs of a record (``--reference-summary``)."""
    results = [r for r in report["results"] if r.get("group") in REFERENCE_GROUPS]
    by_id = {r["id"]: r for r in results}
    return {"gpu": report.get("env", {}).get("gpu"), "torch": report.get("env", {}).get("torch"),
            "te": te_versions(results), "iterations": ITERS, "microbatches": MICROBATCHES,
            "size": SIZE, "float_noise": mlm_verdict.FLOAT_NOISE,
            "checkouts": checkouts(report),
            "rows": [reference_row(r, by_id) for r in results],
            "replaced": report.get("replaced", [])}


TE_VERSION = re.compile(r"Transformer Engine version \.* ?(\S+)")


def te_versions(results: list[dict[str, Any]]) -> list[str]:
    """The TransformerEngine versions the runs with TE layers printed (Megatron's own
    ``Transformer Engine version`` line): what they ran, where the driver's environment probe,
    taken before TE's setup ends, cannot tell."""
    return sorted({m.group(1) for r in results if r.get("impl", "te") == "te"
                   for line in r.get("log_head_versions") or [] for m in [TE_VERSION.search(line)]
                   if m})


def joined(reports: list[dict[str, Any]], names: list[str] | None = None) -> dict[str, Any]:
    """Several raw records (one GPU call each, on one kind of machine) as one: their results in
    the order they first appear, each case once. A later call's run of a case replaces an
    earlier call's: a case a call did not start (``not run``), or one run again after a harness
    fix or so that its configuration's runs share one call (a run is compared only with a
    serialized run of its own call); of two ``not run``, the later reason stands. Each
    replaced run that did run is listed under ``replaced``, with its record's name (``names``,
    else its place in ``reports``); ``gpu`` and ``torch`` must be the same in every record."""
    names = names or [str(i + 1) for i in range(len(reports))]
    first = dict(reports[0])
    for report in reports[1:]:
        for key in ("gpu", "torch"):
            if report.get("env", {}).get(key) != first.get("env", {}).get(key):
                raise ValueError(f"records of different machines: {key} "
                                 f"{report.get('env', {}).get(key)} != {first['env'].get(key)}")
    results: dict[str, dict[str, Any]] = {}
    replaced = []
    for call, report in enumerate(reports):
        for r in report["results"]:
            before = results.get(r["id"])
            if before is not None and before["outcome"] != "not run":
                if r["outcome"] == "not run":
                    continue
                replaced.append({"id": r["id"], "record": names[before["_call"]],
                                 "outcome": before["outcome"], "by_record": names[call],
                                 "error": (before.get("error") or "")[:300] or None})
            results[r["id"]] = dict(r, _call=call)  # in its first place in the order
    first["results"] = [{k: v for k, v in r.items() if k != "_call"} for r in results.values()]
    first["replaced"] = replaced
    for key in ("checkouts", "serialized_vs_shipped"):
        first[key] = {name: value for report in reports
                      for name, value in (report.get(key) or {}).items()}
    return first


def read(path: str) -> dict[str, Any]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)
