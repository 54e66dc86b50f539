"""``mfsdp-hotfix selftest``: the same case without and with the hotfix, as a before/after table,
on two ranks and on one.

Why: a user can see, on their own installation and without a GPU, that the hotfix loads, what it
changes and that the gradients still match plain PyTorch.  Every run happens in fresh
subprocesses ("without" = ``MFSDP_HOTFIX=0``); nothing is patched in the caller's process.
The one-rank runs are there because a group of one rank (every one-GPU job) has defects of its
own that two ranks never show.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from mfsdp_hotfix.selftest.runner import run_case
from mfsdp_hotfix.selftest.spec import BY_COPY, CaseResult, CaseSpec
from mfsdp_hotfix.verdict_text import block, first_line

# Float32 sums in a different order (bucketed reduce-scatter vs one reference backward): a
# correct run differs from the reference by rounding only; a broken buffer differs by O(1).
GRAD_TOLERANCE = 1e-5


_MEANING = {
    "CRASH": "the run raised (for the double-buffer defect: 'No buffer found for bucket_id')",
    "WRONG GRADS": "gradients differ from a plain single-process PyTorch run of the same model",
    "UNORDERED": "a gradient buffer slot was reused by a stream that had not waited for the "
                 "reduce-scatter still reading it: harmless on CPU, silent corruption on GPU",
    "ok": "no crash, gradients equal the reference, every buffer reuse was ordered",
}


# The distribution whose top-level package a missing module belongs to.
_DISTRIBUTIONS = {"megatron": "megatron-core", "megatron_fsdp": "megatron-fsdp"}
_COPIES = {"core": "megatron-core's copy of Megatron-FSDP (--flavour core)",
           "standalone": "megatron-fsdp (--flavour standalone)",
           "auto": "a Megatron-FSDP copy"}


def verdict(result: CaseResult) -> str:
    if result.crashed:
        return "CRASH"
    if not result.grads_match(GRAD_TOLERANCE):
        return "WRONG GRADS"
    if result.ordering_violations:
        return "UNORDERED"
    return "ok"


WITHOUT, WITH = "without hotfix", "with hotfix"
ONE_RANK = ", one rank"  # the names of the one-rank runs end so


def conclusion(runs: list[tuple[str, CaseResult]]) -> tuple[bool, str]:
    """The selftest's verdict: PASS when every run with the hotfix is ``ok`` (two ranks, and one
    rank where it ran). Its first line, ``selftest: PASS: ...`` or ``selftest: FAIL: ...``, is
    the state in one glance (:mod:`..verdict_text`); what each run showed is indented below."""
    outcome = dict(runs)
    after, before = outcome[WITH], outcome.get(WITHOUT)
    alone, alone_before = outcome.get(WITH + ONE_RANK), outcome.get(WITHOUT + ONE_RANK)
    failed = [(where, result) for where, result in (("", after), (" at one rank", alone))
              if result is not None and verdict(result) != "ok"]
    disagree = [name for name, result in runs if result.spec.audit and not audit_agrees(result)]
    passed = not failed and not disagree
    release = after.release or (before.release if before else {}) or {}
    what = (f"{release.get('dist')} {release.get('version')}" if release.get("dist")
            else "Megatron-FSDP")
    shipped = ""
    if before is not None:
        shipped = f"without it: {verdict(before)}" + (f", at one rank {verdict(alone_before)}"
                                                       if alone_before is not None else "")
    details = []
    if not failed:
        state = f"with the hotfix, {what} gradients equal plain PyTorch"
        details.append(f"with the hotfix: no crash, gradients equal plain PyTorch, 0 unordered "
                       f"of {after.ordering_checks or 0} gradient-slot reuses"
                       + (", and at one rank gradients equal plain PyTorch too"
                          if alone is not None else ""))
    else:
        where, result = failed[0]
        state = f"with the hotfix, {what}{where}: {verdict(result)}"
        details.append(f"{verdict(result)}: {_MEANING[verdict(result)]}")
        if result.exception:
            details.append(f"the run raised: {result.exception.splitlines()[0][:200]}")
    if shipped:
        details.append(shipped)
    if disagree:
        details.append(f"the audit does not match the stand-in's counts in: "
                       f"{', '.join(disagree)} (see the audit lines above)")
    elif any(result.spec.audit for _, result in runs):
        details.append("the audit's counts equal the stand-in's")
    word = "PASS" if passed else "FAIL"
    todo = ("" if passed else "the audit disagrees: please report this" if not failed
            else "please report this, with the table above")
    head = f"selftest: {word}: {state}"
    shorter = (f"{head}; without it: {verdict(before)}",) if before is not None and passed else ()
    return passed, block(first_line(f"{head}; {shipped}" if shipped and passed else head, todo,
                                    (*shorter, head)), details)


def cannot_run(runs: list[tuple[str, CaseResult]]) -> str | None:
    """``selftest: CANNOT RUN: ...`` when the copy asked for cannot be imported as shipped (in
    the run without the hotfix): nothing was tested, which is neither a PASS nor a FAIL of the
    hotfix. (Importable as shipped but not with the hotfix is the hotfix's FAIL.)"""
    name, first = runs[0]
    missing = first.cannot_import
    if name != "without hotfix" or not missing:
        return None
    spec = first.spec
    module = missing["module"] or ""
    top = module.split(".")[0]
    dist = _DISTRIBUTIONS.get(top)
    if dist and module == top:
        why = f"{dist} is not installed" + (f" and not in --path {spec.path}" if spec.path
                                            else " here")
        todo = f"install {dist}"
    elif dist:
        why, todo = f"the {dist} found has no {module}", f"install a {dist} release that has it"
    elif module:
        why, todo = f"it needs {module}, which is not installed here", f"install {module}"
    else:
        why, todo = "no copy is importable here", "install megatron-fsdp or megatron-core"
    return block(first_line(f"selftest: CANNOT RUN: {why}", f"{todo}, or give --path a folder "
                            "that holds it"),
                 [f"{_COPIES[spec.flavour]} cannot be imported: {why} ({missing['error']})",
                  "nothing was tested"])


def audit_phase(name: str, result: CaseResult) -> dict[str, Any]:
    """One phase of ``selftest --audit``: the audit's counts next to the stand-in's."""
    return {"phase": name, "hotfix": result.spec.hotfix != "off", "ranks": result.spec.world,
            "verdict": verdict(result),
            "audit_reuses": result.audit_reuses, "audit_unordered": result.audit_unordered,
            "standin_reuses": result.ordering_checks,
            "standin_unordered": result.ordering_violations,
            "crashed": result.crashed, "audit_crashed": result.audit_crashed,
            "audit": result.audit_state, "audit_files": result.audit_files,
            "agree": audit_agrees(result)}


def audit_agrees(result: CaseResult) -> bool:
    """The audit ran on every rank and counted what the stand-in's checker counted."""
    return (result.audit_state == "on" and result.ordering_checks is not None
            and (result.audit_reuses, result.audit_unordered)
            == (result.ordering_checks, result.ordering_violations)
            and bool(result.audit_crashed) == _pool_crash(result))


def _pool_crash(result: CaseResult) -> bool:
    return result.crashed and "No buffer found" in (result.exception or "")


def format_audit(results: list[tuple[str, CaseResult]]) -> str:
    lines = []
    for name, r in results:
        lines.append(f"audit, {name}: {_cell(r.audit_unordered, 'd')} unordered of "
                     f"{_cell(r.audit_reuses, 'd')} gradient-slot reuses"
                     + (", crash recorded" if r.audit_crashed else "")
                     + f" (stand-in: {_cell(r.ordering_violations, 'd')} of "
                     f"{_cell(r.ordering_checks, 'd')}); audit {r.audit_state}: "
                     + ("agrees" if audit_agrees(r) else "DOES NOT AGREE"))
    return "\n".join(lines)


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(results: list[tuple[str, CaseResult]]) -> str:
    """A plain-text table: one row per run."""
    header = ("run", "result", "crash", "max |grad err|", "unordered/reuses", "time s")
    rows = [header]
    for name, r in results:
        ordering = (f"{_cell(r.ordering_violations, 'd')}/{_cell(r.ordering_checks, 'd')}")
        rows.append((name, verdict(r), "yes" if r.crashed else "no",
                     _cell(r.max_abs_grad_error, ".2e"), ordering, f"{r.wall_s:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for name, r in results:
        if r.exception:
            lines.append(f"{name}: {r.exception.splitlines()[0][:200]}")
    for word in dict.fromkeys(verdict(r) for _, r in results):
        lines.append(f"{word}: {_MEANING[word]}")
    return "\n".join(lines)


def run_selftest(path: str | None = None, flavour: str = "auto",
                 out: TextIO | None = None, progress: bool = True,
                 spec: CaseSpec | None = None,
                 runner: Callable[..., CaseResult] = run_case, audit: bool = False,
                 protocol: str | None = None) -> list[tuple[str, CaseResult]]:
    """Run the selftest case without and with the hotfix; print progress and a table.

    ``path``: a folder to put first on the workers' ``sys.path`` (for example an unpacked
    release); default: whatever Megatron-FSDP copy is importable here.  ``flavour``: "auto",
    "standalone" (``megatron_fsdp``) or "core" (megatron-core's vendored copy).  ``spec``: the
    case (model size, strategy, ...), default :class:`CaseSpec`'s.  ``runner``: how a case is
    run (tests pass a caching one).  ``audit``: run both with ``MFSDP_HOTFIX_AUDIT`` set and
    compare the audit's counts with the stand-in's. ``protocol``: how microbatches are driven
    (``protocol.PROTOCOLS``; default: the spec's, Megatron-LM's).
    Then the same at one rank (``world=1``): a size-one group, as in every one-GPU job.
    Returns ``[("without hotfix", result), ("with hotfix", result), ("without hotfix, one
    rank", result), ("with hotfix, one rank", result)]``, or only the first when the copy asked
    for cannot be imported (:func:`cannot_run`).
    """
    stream = out if out is not None else sys.stdout
    base = CaseSpec(**(spec if spec is not None else CaseSpec(grad_reduce=BY_COPY)).__dict__)
    base.path, base.flavour = path if path is not None else base.path, flavour
    base.audit = base.audit or audit
    if protocol is not None:
        base.protocol = protocol
    runs: list[tuple[str, CaseResult]] = []
    plan = [(name + suffix, mode, world) for suffix, world in (("", base.world), (ONE_RANK, 1))
            for name, mode in ((WITHOUT, "off"), (WITH, "on"))]
    if progress:
        stream.write(f"selftest: {len(plan)} runs on CPU, without and with the hotfix, at "
                     f"{base.world} ranks and at one\n"
                     f"  the case: {base.label(hotfix_state=False)}\n")
    for name, mode, world in plan:
        case = CaseSpec(**{**base.__dict__, "hotfix": mode, "world": world})
        tick = _ticker(stream, name) if progress else None
        if progress:
            stream.write(f"selftest: running {name} ...\n")
            stream.flush()
        result = runner(case, tick)
        runs.append((name, result))
        blocked = cannot_run(runs)
        if blocked:  # the copy asked for is not here: the run with the hotfix would not be either
            stream.write(blocked + "\n")
            stream.flush()
            return runs
        if progress:
            stream.write(f"selftest: {name}: {verdict(result)} in {result.wall_s:.1f}s\n")
            stream.flush()
    release = next((r.release for _, r in runs if r.release), {})
    if release:
        stream.write(f"Megatron-FSDP: {release.get('dist')} {release.get('version')} "
                     f"({release.get('flavour')}) at {release.get('path')}\n")
    if base.grad_reduce == BY_COPY and any(r.grad_reduce == "per-token" for _, r in runs):
        stream.write("gradients reduced per-token (calculate_per_token_loss=True): this copy "
                     "has sharded-grads-summed-unscaled, whose scale-then-sum reduction no fix "
                     "repairs (refused with the hotfix)\n")
    stream.write(format_table(runs) + "\n")
    if base.audit:
        stream.write(format_audit(runs) + "\n")
    stream.write(conclusion(runs)[1] + "\n")
    stream.flush()
    return runs


def _ticker(stream: TextIO, name: str) -> Callable[[float], None]:
    last = [time.monotonic()]

    def tick(elapsed: float) -> None:
        now = time.monotonic()
        if now - last[0] >= 10.0:
            last[0] = now
            stream.write(f"selftest:   {name}: still running, {elapsed:.0f}s elapsed\n")
            stream.flush()

    return tick
