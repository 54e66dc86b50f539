"""What a case's ``mfsdp-hotfix parity --json`` said: its verdict, each compared run's values of
the first iteration, the relative differences of the first and of the later iterations (the
noise floors are tied to these), the hotfix's state in each run, and the output tails where the
case did not end as expected."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

TAIL = 4000
RUN_TAIL = 2500
RUN_TAILS = 6
RUNS = ("reference", "candidate", "shipped")  # the command's runs, by its names


def parsed_json(stdout: str) -> dict[str, Any] | None:
    """The command's JSON document: the whole of stdout, or else its last line that is one."""
    text = stdout.strip()
    candidates = [text] + [line for line in reversed(text.splitlines()) if line.startswith("{")]
    for candidate in candidates:
        try:
            doc = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(doc, dict):
            return doc
    return None


def verdict_of(doc: dict[str, Any] | None) -> str | None:
    """``MATCH``, ``MISMATCH`` or ``CANNOT COMPARE`` as the document names it."""
    if not doc or not doc.get("verdict"):
        return None
    return str(doc["verdict"]).replace("_", " ").upper()


def rows_of(comparison: dict[str, Any]) -> list[dict[str, Any]]:
    """A comparison's per-iteration rows, each ``iteration``, ``metric``, ``reference``,
    ``candidate``, ``relative``."""
    return [r for r in comparison.get("rows") or [] if isinstance(r, dict)]


def is_grad_norm(metric: str) -> bool:
    return metric.replace("_", " ").lower() == "grad norm"


def differences(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The first iteration's grad-norm relative difference, the largest relative difference of
    the first iteration and of the later ones (by metric), and the first iteration's values."""
    if not rows:
        return {}
    first = min(r["iteration"] for r in rows)
    out: dict[str, Any] = {"first_iteration": first, "first": {}, "later": {},
                           "reference_first": {}, "candidate_first": {}}
    for r in rows:
        if r["iteration"] == first:
            out["reference_first"][r["metric"]] = r.get("reference")
            out["candidate_first"][r["metric"]] = r.get("candidate")
        rel = r.get("relative")
        if not isinstance(rel, (int, float)):  # a count, or a value one run lacks
            continue
        part = out["first"] if r["iteration"] == first else out["later"]
        part[r["metric"]] = max(part.get(r["metric"], 0.0), float(rel))
    out["sources"] = sorted({str(r.get("source")) for r in rows if r.get("source")})
    out["first_grad_norm_rel"] = next((v for k, v in out["first"].items() if is_grad_norm(k)),
                                      None)
    return out


def run_tails(folder: str) -> dict[str, str]:
    """The ends of the text files the command kept of its runs (their full output)."""
    found = []
    for dirpath, _, names in os.walk(folder):
        for name in sorted(names):
            path = os.path.join(dirpath, name)
            if name.endswith((".log", ".txt", ".out", ".err")) and os.path.getsize(path):
                found.append(path)
    tails = {}
    for path in found[:RUN_TAILS]:
        with open(path, errors="replace") as f:
            f.seek(max(0, os.path.getsize(path) - RUN_TAIL))
            tails[os.path.relpath(path, folder)] = f.read()
    return tails


def runs_read(doc: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Each run's log (and capture) read back by the command's own reader: the hotfix's state
    the capture saw, the release family of the lines, the first iteration's values and where
    they come from, the iterations, the run's exit status and seconds."""
    from mfsdp_hotfix.parity.log_lines import read_log

    out = {}
    for name, info in ((doc or {}).get("runs") or {}).items():
        if name not in RUNS:
            continue  # the check's own facts ("check": iterations, folder)
        entry = {"status": info.get("exit status"), "seconds": info.get("seconds")}
        log = info.get("output") or ""
        if os.path.isfile(log):
            capture = os.path.join(os.path.dirname(log), "capture")
            with open(log, errors="replace") as f:
                run = read_log(f.read(), capture if os.path.isdir(capture) else None)
            first = run.iterations[0] if run.iterations else None
            entry.update(hotfix=run.hotfix, fixes=fixes_seen(capture), family=run.family,
                         capture_note=run.capture_note,
                         iterations=[it.number for it in run.iterations],
                         first=None if first is None else {
                             "grad_norm": first.grad_norm, "losses": first.losses,
                             "source": first.source})
        out[name] = entry
    return out


def fixes_seen(capture: str) -> dict[str, Any] | None:
    """The fixes the capture saw applied and disabled in the process that printed (the last
    rank's file: its ``process`` record)."""
    from mfsdp_hotfix.parity.log_lines import CAPTURE_PREFIX

    files = sorted(glob.glob(os.path.join(capture, f"{CAPTURE_PREFIX}*.jsonl")))
    for path in files[-1:]:
        with open(path, errors="replace") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and record.get("kind") == "process":
                    return {k: record.get(k) for k in ("fixes_applied", "disabled_fixes")}
    return None


def hotfix_problem(runs: dict[str, dict[str, Any]], disabled: list[str]) -> str | None:
    """A run whose hotfix is not what its role says is the harness's failure, never a result:
    the candidate runs with the hotfix (and without the fixes the case disables), the reference
    and the shipped run without."""
    states = {name: run.get("hotfix") for name, run in runs.items()}
    wrong = [f"{name}: {states[name]}" for name, want in (("candidate", True),
                                                          ("reference", False),
                                                          ("shipped", False))
             if states.get(name) is not None and (states[name] == "active") != want]
    seen = (runs.get("candidate") or {}).get("fixes") or {}
    wrong += [f"candidate: {fix} not disabled" for fix in disabled
              if seen and fix not in (seen.get("disabled_fixes") or [])]
    return "hotfix unlike the run's role (" + "; ".join(wrong) + ")" if wrong else None


def documented_status(verdict: str | None) -> int | None:
    """The exit status the command documents for a verdict."""
    from mfsdp_hotfix.commands.parity import VERDICT_STATUS

    return VERDICT_STATUS.get(verdict or "")


def case_result(r: dict[str, Any], stdout: str, stderr: str) -> dict[str, Any]:
    """The case's record from its exit status and output (``r``: the case with ``rc``,
    ``wall_s``, ``cwd``)."""
    doc = parsed_json(stdout)
    r["json"] = doc
    r["verdict"] = verdict_of(doc)
    r.update(differences(rows_of(doc or {})))
    shipped = (doc or {}).get("shipped")
    if r["shipped"] and isinstance(shipped, dict):
        r["shipped_verdict"] = verdict_of(shipped)
        r["shipped_differences"] = differences(rows_of(shipped))
    r["runs_read"] = runs_read(doc)
    r["hotfix"] = {name: run.get("hotfix") for name, run in r["runs_read"].items()}
    r["harness_problem"] = hotfix_problem(r["runs_read"], r["disabled"])
    r["rc_as_documented"] = documented_status(r["verdict"]) == r["rc"]
    if r["rc"] == "timeout":
        r["outcome"] = "cut by the budget" if r.get("cut") else "timeout"
    else:
        r["outcome"] = "verdict" if r["verdict"] else "no verdict"
    r["as_expected"] = bool(r["verdict"]) and not r["harness_problem"] and (not r["expected"] or r["verdict"] == r["expected"]) \
        and (not r["expected_shipped"] or r.get("shipped_verdict") == r["expected_shipped"])
    if not r["as_expected"] or r["verdict"] != "MATCH":
        r["stdout_tail"] = stdout[-TAIL:]
        r["stderr_tail"] = stderr[-2 * TAIL:]
        r["run_tails"] = run_tails(os.path.join(r["cwd"], "parity"))
    return r
