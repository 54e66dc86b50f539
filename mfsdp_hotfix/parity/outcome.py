"""From finished runs to the verdict: each run's log read back (``log_lines``), a run that
crashed, hung or printed no iteration turned into CANNOT COMPARE with its last lines, else the
candidate compared with the reference (``comparison``), and the shipped run, where there is
one, compared with the reference too, to show what the hotfix changes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .comparison import Comparison, Verdict, compare, precision_of
from .launch import Outcome
from .log_lines import RunLog, read_log
from .plan import CANDIDATE, REFERENCE, SHIPPED, Plan
from .verdict_text import as_json, render

SHOWN_LINES = 8  # of a run that crashed or hung


def _problem(name: str, outcome: Outcome, log: RunLog, first: int, last: int) -> str | None:
    """Why run ``name`` cannot be compared (None: it can), with its last lines."""
    numbers = {it.number for it in log.iterations}
    complete = set(range(first, last + 1)) <= numbers
    tail = "".join(f"\n    | {line}" for line in outcome.tail[-SHOWN_LINES:])
    if outcome.timed_out:
        return (f"the {name} run hung: no end within {outcome.elapsed:.0f} s (--timeout), "
                + (f"last iteration {outcome.last_iteration}" if outcome.last_iteration
                   is not None else "no iteration printed")
                + f"; raise --timeout if it is only slow. Its last lines ({outcome.log}):"
                + tail)
    if outcome.status != 0 and not complete:
        return (f"the {name} run crashed (exit status {outcome.status}) before iteration "
                f"{last}; fix what its last lines say ({outcome.log}):" + tail)
    if not numbers:
        return (f"the {name} run printed no iteration line: parity reads Megatron-LM's "
                f"training_log lines ('iteration N/ M | ...'); see {outcome.log}:" + tail)
    return None


def runs_info(plan: Plan, outcomes: Mapping[str, Outcome]) -> dict[str, Any]:
    """What the verdict says about the runs: each run's command, log, status and time, the
    iterations, what was changed, and --shrink."""
    return {
        "runs": {run.name: {"title": run.title, "command": run.command, "env": run.env,
                            "log": run.log, "status": outcomes[run.name].status,
                            "timed_out": outcomes[run.name].timed_out,
                            "seconds": round(outcomes[run.name].elapsed, 1)}
                 for run in plan.runs if run.name in outcomes},
        "iterations": [plan.first, plan.last],
        "every_run": plan.every_run,
        "reference_changes": plan.reference,
        "shrink": plan.shrink,
    }


def _judge_pair(plan: Plan, outcomes: Mapping[str, Outcome], logs: Mapping[str, RunLog],
                name: str, precision: str) -> Comparison:
    problems = [problem for run in (REFERENCE, name) for problem in [
        _problem(run, outcomes[run], logs[run], plan.first, plan.last)] if problem]
    if problems:
        return Comparison(Verdict.CANNOT_COMPARE, precision, None, [], None, problems)
    return compare(logs[REFERENCE], logs[name], precision)


def judge(plan: Plan, outcomes: Mapping[str, Outcome]) -> tuple[list[str], dict[str, Any]]:
    """The verdict's lines (the first at most 120 characters) and its JSON object."""
    logs = {}
    for run in plan.runs:
        with open(run.log, errors="replace") as f:
            logs[run.name] = read_log(f.read(), run.capture)
    candidate = next(run for run in plan.runs if run.name == CANDIDATE)
    precision = precision_of(candidate.command)
    info = runs_info(plan, outcomes)
    comparison = _judge_pair(plan, outcomes, logs, CANDIDATE, precision)
    lines, data = render(comparison, info), as_json(comparison, info)
    if SHIPPED in outcomes:
        shipped = _judge_pair(plan, outcomes, logs, SHIPPED, precision)
        lines.append(f"  as shipped (MFSDP_HOTFIX=0) against the reference: "
                     f"{render(shipped, info)[0]}")
        data["shipped"] = as_json(shipped, info)
    return lines, data
