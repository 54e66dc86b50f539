"""From finished runs to the verdict: each run's log read back (``log_lines``); a run that
crashed or hung before its last iteration makes the verdict CANNOT COMPARE, with its last lines
shown; else the candidate is compared with the reference (``comparison``), and the shipped run,
where there is one, with the reference too, to show what the hotfix changes."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from ..verdict_text import INDENT
from .comparison import Comparison, Problem, Verdict, compare, compare_logs, precision_of
from .floors import FLOORS
from .launch import Outcome
from .log_lines import RunLog, read_log
from .plan import CANDIDATE, REFERENCE, SHIPPED, Plan, describe
from .verdict_text import as_json, render

SHOWN_LINES = 8  # of a run that crashed or hung
CRASHED, HUNG = "crashed", "hung"


def _problem(name: str, outcome: Outcome, log: RunLog, last: int) -> Problem | None:
    """Why run ``name`` cannot be compared (None: it can): it hung, or it crashed before its
    last iteration (one that fails on its way out after it is still compared)."""
    printed = outcome.last_iteration
    if outcome.timed_out:
        return Problem(HUNG, f"the {name} run hung: no end within {outcome.elapsed:.0f} s, "
                             + (f"last iteration {printed}" if printed is not None else
                                "no iteration printed")
                             + "; if it is only slow, raise --timeout")
    if outcome.status != 0 and last not in {it.number for it in log.iterations}:
        return Problem(CRASHED, f"the {name} run crashed (exit status {outcome.status}) "
                                + (f"after iteration {printed}" if printed is not None else
                                   "before its first iteration")
                                + f" of {last}")
    return None


def _last_lines(name: str, outcome: Outcome) -> list[str]:
    return [f"{INDENT}last lines of the {name} run ({outcome.log}):"] + [
        f"{INDENT * 2}| {line}" for line in outcome.tail[-SHOWN_LINES:]]


def runs_info(plan: Plan, outcomes: Mapping[str, Outcome]) -> dict[str, dict[str, Any]]:
    """What the verdict says of each run, and of the check (iterations, --shrink)."""
    info: dict[str, dict[str, Any]] = {
        run.name: {"what": run.title, "exit status": outcomes[run.name].status,
                   "seconds": round(outcomes[run.name].elapsed, 1), "output": run.log}
        for run in plan.runs if run.name in outcomes}
    info["check"] = {
        "iterations": f"{plan.first}-{plan.last}",
        "layers": (f"{plan.shrink} on every run (--shrink), not the job's own"
                   if plan.shrink else None),
        "folder": os.path.dirname(plan.runs[0].folder)}
    return info


def _judge_pair(outcomes: Mapping[str, Outcome], logs: Mapping[str, RunLog], name: str,
                last: int, precision: str) -> tuple[Comparison, list[str]]:
    """The comparison of run ``name`` with the reference, and the last lines of those that
    crashed or hung."""
    problems, shown = [], []
    for run in (REFERENCE, name):
        problem = _problem(run, outcomes[run], logs[run], last)
        if problem:
            problems.append(problem)
            shown += _last_lines(run, outcomes[run])
    if problems:
        return Comparison(Verdict.CANNOT_COMPARE, precision, FLOORS.get(precision), [], None,
                          problems), shown
    return compare(logs[REFERENCE], logs[name], precision), shown


def judge(plan: Plan, outcomes: Mapping[str, Outcome]) -> tuple[list[str], dict[str, Any]]:
    """The verdict's lines (the first at most 120 characters) and its JSON object."""
    logs = {}
    for run in plan.runs:
        with open(run.log, errors="replace") as f:
            logs[run.name] = read_log(f.read(), run.capture)
    candidate = next(run for run in plan.runs if run.name == CANDIDATE)
    precision = precision_of(candidate.command)
    info = runs_info(plan, outcomes)
    comparison, shown = _judge_pair(outcomes, logs, CANDIDATE, plan.last, precision)
    lines, data = render(comparison, info) + shown, as_json(comparison, info)
    data["plan"] = {"every run": plan.every_run, "reference": plan.reference,
                    "commands": {run.name: describe(run) for run in plan.runs}}
    if SHIPPED in outcomes:
        shipped, _ = _judge_pair(outcomes, logs, SHIPPED, plan.last, precision)
        lines.append(f"{INDENT}as shipped (MFSDP_HOTFIX=0) against the reference: "
                     f"{render(shipped, {})[0]}")
        data["shipped"] = as_json(shipped, {})
    return lines, data


def precision_in_log(text: str) -> str | None:
    """The precision a Megatron-LM log's argument dump (``  bf16 ....... True``) shows, None
    where the log has none."""
    values = dict(re.findall(r"^\W*\s*(bf16|fp16|fp8_format|fp8|fp4)\s+\.{3,}\s+(\S+)\s*$", text,
                             re.M))
    if not values:
        return None
    argv = [f"--{name.replace('_format', '')}-format" if name in ("fp8", "fp8_format", "fp4")
            else f"--{name}" for name, value in values.items()
            if value not in ("False", "None")]
    return precision_of(argv)


def judge_logs(reference: str, candidate: str, precision: str | None
               ) -> tuple[list[str], dict[str, Any]]:
    """``parity --compare``: two finished logs; the precision given, else read from the logs'
    argument dumps (they must agree), else CANNOT COMPARE saying to give --precision."""
    if precision is None:
        found = []
        for path in (reference, candidate):
            with open(path, errors="replace") as f:
                found.append(precision_in_log(f.read()) or "unknown")
        if len(set(found)) != 1 or "unknown" in found:
            text = ("the logs' precision is not known: give --precision" if "unknown" in found
                    else f"the logs were trained in different precisions ({', '.join(found)})")
            comparison = Comparison(Verdict.CANNOT_COMPARE, "unknown", None, [], None,
                                    [Problem("precision", text)])
            info = {"logs": {"reference": reference, "candidate": candidate}}
            return render(comparison, info), as_json(comparison, info)
        precision = found[0]
    comparison = compare_logs(reference, candidate, precision)
    info = {"logs": {"reference": reference, "candidate": candidate, "precision": precision}}
    return render(comparison, info), as_json(comparison, info)
