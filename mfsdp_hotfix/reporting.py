"""What the hotfix did and would do, in one vocabulary for the API, the CLI and the README.

Three questions, three words, never mixed:

* the process (``status()["hotfix"]``): ``off``, ``armed``, ``active`` or ``uninstalled``
  (``mfsdp-hotfix status`` speaks of a new process, which may also be ``not loaded``);
* each fix on each copy (``copies[].fixes[id].state``): ``applied`` (to that imported copy),
  ``would apply`` (once that copy is imported), ``not needed``, ``disabled``, ``failed``, ``off``;
* how ``mfsdp_hotfix`` came into the process (``loaded_via``): ``import``, ``pth`` or
  ``sitecustomize``.

A copy that is installed but not imported yet is read from its source file (no torch needed), so
``status()`` right after ``import mfsdp_hotfix`` already says what would apply. A copy the process
imported while the hotfix was off (or after ``uninstall()``) is read from its imported module and
reported ``imported``, with nothing applied.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from . import (
    coverage,
    detection,
    fix_catalogue,
    incidents,
    installer,
    registry,
    trigger,
    v2,
)
from . import settings as settings_module
from .__about__ import __version__
from .installer import CopyRecord
from .registry import Copy, Shape
from .release_defects import defects_of
from .states import FixState
from .verdict_text import first_line

HOTFIX_STATES = {
    "off": f"{settings_module.SWITCH}=0 switches every fix off",
    "armed": "loaded; the fixes are applied when Megatron-FSDP is imported",
    "active": "Megatron-FSDP is imported; each copy's fixes are applied as listed",
    "uninstalled": "mfsdp_hotfix.uninstall() restored the originals; install() applies the "
                   "fixes again",
    "not loaded": "mfsdp_hotfix is loaded only where a script imports it (no .pth or "
                  "sitecustomize bootstrap here; see `mfsdp-hotfix run`)",
}
FIX_STATES = {
    FixState.APPLIED: "applied to this imported copy",
    FixState.WOULD_APPLY: "applied as soon as this copy is imported",
    FixState.NOT_NEEDED: "this copy's code does not have the defect the fix repairs",
    FixState.DISABLED: f"listed in {settings_module.DISABLED_FIXES}",
    FixState.FAILED: "the fix raised inside the hotfix (while being installed, or later while "
                     "training) and was switched off for the rest of the process; the code runs "
                     "as shipped",
    FixState.UNVERIFIED: "this copy's code around the fix is not a shape the hotfix knows: not "
                         "applied, and building a model in a configuration it covers is refused",
    FixState.OFF: f"{settings_module.SWITCH}=0",
    FixState.REFUSED: "the copy is refused and this fix rests on code the hotfix does not "
                      "recognise there: not applied (see the copy's reason for the workaround)",
}
SHAPE_MEANING = ("each function is judged by its own code: 'as shipped in megatron-fsdp "
                 "0.4.0-0.5.1' means its text equals those releases', layout and comments aside "
                 "(the other distribution's releases with the same text follow); 'drains before "
                 "fetching' means a getter recognised by its structure")
# A fix's state that protects a job once the hotfix is loaded.
PROTECTING = (FixState.APPLIED, FixState.WOULD_APPLY)
# Process states (:data:`HOTFIX_STATES`) in which no fix can protect a job, in a few words.
UNPROTECTING = {"off": f"{settings_module.SWITCH}=0",
                "not loaded": "nothing loads the hotfix in a new process here (no .pth or "
                              "sitecustomize bootstrap; `mfsdp-hotfix run` or `import "
                              "mfsdp_hotfix` does)",
                "uninstalled": "mfsdp_hotfix.uninstall() restored the originals"}
# The same, in the fewest words, for the verdict's first line.
UNPROTECTING_SHORT = {"off": f"{settings_module.SWITCH}=0",
                      "not loaded": "hotfix not loaded",
                      "uninstalled": "hotfix uninstalled"}
# Every fix that repairs no release defect (:data:`.release_defects.RELEASE_DEFECTS`) repairs
# a defect of the double buffer, which fsdp_double_buffer=False avoids (README, "Who needs it").
DOUBLE_BUFFER_OFF = "fsdp_double_buffer=False"


def status() -> dict[str, Any]:
    """What was detected and applied, and why, as plain data (also ``mfsdp-hotfix status``)."""
    settings, installed, records = installer.view()
    settings = settings or settings_module.read(known_fixes=fix_catalogue.FIX_IDS)
    copies = [_record_dict(record) for record in records]
    unpatched = installer.imported_unpatched()
    copies += [judged_offline(found, settings, imported=True) for found in unpatched]
    seen = {r.detection.copy.package for r in records} | {f.copy.package for f in unpatched}
    for copy in registry.COPIES:
        if copy.package not in seen:
            copies.extend(_not_imported(copy, settings))
    state = _hotfix_state(settings, installed, records)
    data = {
        "mfsdp_hotfix": __version__,
        "hotfix": state,
        "hotfix_meaning": HOTFIX_STATES[state],
        "loaded_via": trigger.loaded_via,
        "settings": {"mode": settings.mode, "disabled_fixes": sorted(settings.disabled_fixes),
                     "cross_rank_check": settings.cross_rank_check,
                     "problems": list(settings.problems)},
        "copies": copies,
        "v2_copies": v2.present(),
        "failures": incidents.failures(),
    }
    data["verdict"] = verdict(data, state)
    return data


def _hotfix_state(settings: settings_module.Settings, installed: bool,
                  records: list[CopyRecord]) -> str:
    if not settings.enabled:
        return "off"
    if installed:
        return "active" if records else "armed"
    return "armed" if trigger.armed() else "uninstalled"


def _record_dict(record: CopyRecord) -> dict[str, Any]:
    return {**record.detection.as_dict(), "imported": True,
            "fixes": {k: {"state": s, "reason": r} for k, (s, r) in record.fixes.items()},
            "limits": coverage.limits(record.detection, record.fixes),
            "release_defects": release_defects(record.fixes, record.detection.shapes),
            "models_repaired": record.models_repaired}


def release_defects(fixes: dict[str, tuple[str, str]],
                    shapes: Mapping[str, Shape | None] | None = None) -> list[dict[str, Any]]:
    """The release defects (:data:`.release_defects.RELEASE_DEFECTS`) this copy's code has, each
    with what its fix's state means for the user: ``repaired`` (applied, or would apply) or not.
    A defect no fix repairs (``fix`` None) is never repaired; its ``carrier`` names the function
    whose shape (from ``shapes``) says the copy has it, or may have it (``shape`` None)."""
    states = {fix_id: state for fix_id, (state, _) in fixes.items()}
    found = []
    for defect in defects_of(states, shapes):
        fix_state = states[defect.fix] if defect.fix is not None else None
        carrier = None
        if defect.carrier is not None:
            shape = (shapes or {}).get(defect.carrier)
            carrier = {"function": defect.carrier, "shape": shape.name if shape else None}
        found.append({
            "name": defect.name, "fix": defect.fix, "fix_state": fix_state,
            "repaired": fix_state in PROTECTING, "carrier": carrier,
            "releases": dict(defect.releases), "git_trees": defect.git_trees,
            "configuration": defect.configuration, "symptom": defect.symptom,
            "workarounds": list(defect.workarounds), "upstream": defect.upstream,
            "not_covered": defect.not_covered, "refused_when_built": defect.refused_when_built})
    return found


def _not_imported(copy: Copy, settings: settings_module.Settings) -> list[dict[str, Any]]:
    """Offline detection of a copy that is installed but not imported (no torch needed)."""
    buffer_file = detection.find_installed(copy)
    if buffer_file is None:
        return []
    return [judged_offline(detection.detect_file(copy, buffer_file), settings)]


def judged_offline(found: detection.Detection, settings: settings_module.Settings,
                   imported: bool = False) -> dict[str, Any]:
    """A copy the hotfix has not handled, as ``status`` lists it (read from its source, or
    imported while the hotfix was off): what would apply, and why."""
    fixes: dict[str, dict[str, str]] = {}
    states: dict[str, tuple[str, str]] = {}
    for fix in fix_catalogue.FIXES:
        state, reason = states[fix.id] = installer.fix_state(fix, found, settings)
        fixes[fix.id] = {"state": state,
                         "reason": fix.summary if state == FixState.WOULD_APPLY else reason}
    return {**found.as_dict(), "imported": imported, "fixes": fixes,
            "limits": coverage.limits(found, states, enforced=settings.enabled),
            "release_defects": release_defects(states, found.shapes),
            "models_repaired": 0}


def verdict(data: dict[str, Any], hotfix: str | None) -> dict[str, Any]:
    """The answer ``status`` is run for, from ``data``'s copies (their fix states, refusals and
    release defects, whatever fixes and defects the registry holds) and its ``failures`` (a fix
    that failed at runtime protects nothing from then on, on every copy; a failed install leaves
    copies unpatched): is a copy affected, and is every affected one protected? ``hotfix``: the
    process state (:data:`HOTFIX_STATES`), or None for a folder read from disk (protected there
    means: repaired where the hotfix is loaded). Returns ``{"affected", "protected", "line",
    "details"}``: ``line`` is the state and the one thing to do (:mod:`.verdict_text`'s rule),
    ``details`` the lines below it: what applies, why not protected, what to use instead, and
    each configuration refused when a model is built."""
    failures = data.get("failures", {})
    copies = [copy for copy in data["copies"] if _affected(copy)]
    if not copies:
        found = [f"{name(copy)} needs none of the fixes" for copy in data["copies"]]
        line = (f"not affected: {found[0]}" if len(found) == 1 else
                f"not affected: none of {len(found)} Megatron-FSDP copies needs a fix" if found
                else "not affected: no Megatron-FSDP copy found")
        return {"affected": False, "protected": None, "line": first_line(line),
                "details": found if len(found) > 1 else []}
    refusals = _refusals(copies)
    reasons, short, remedies = _unprotected(copies, hotfix, failures)
    if not reasons:
        fixes = list(dict.fromkeys(fix for copy in copies
                                   for fix, (state, _) in fix_states(copy, failures).items()
                                   if state in PROTECTING))
        how = ("repaired where the hotfix is loaded" if hotfix is None else
               f"protected: the hotfix is {hotfix}")
        return {"affected": True, "protected": True, "line": _first(copies, [how]),
                "details": [f"applies {', '.join(fixes) or 'none'}", *refusals]}
    return {"affected": True, "protected": False,
            "line": _first(copies, [f"NOT protected: {', '.join(short)}",
                                    f"NOT protected: {short[0]} and more (below)",
                                    "NOT protected (why: below)"],
                           re.sub(r"^for \S+ (use )", r"\1", remedies[0]) if remedies else ""),
            "details": ([f"why: {reason}" for reason in reasons]
                        + [f"instead: {remedy}" for remedy in remedies] + refusals)}


def _first(copies: list[dict[str, Any]], states: list[str], todo: str = "") -> str:
    """``affected: <copies> — <state>; <todo>``, the copies named with their eras where that
    fits on the first line, else without, else counted (the lines below name them); ``states``:
    the state in ever fewer words."""
    def bare(copy: dict[str, Any]) -> str:
        return " ".join(filter(None, [copy["copy"], copy["version"],
                                      "(not recognised)" if copy["refused"] else None]))
    heads = [", ".join(name(copy) for copy in copies), ", ".join(map(bare, copies)),
             f"{len(copies)} Megatron-FSDP copies" if len(copies) > 1 else
             bare({**copies[0], "version": None})]
    lines = [f"affected: {head} — {state}" for state in states for head in dict.fromkeys(heads)]
    return first_line(lines[0], todo, tuple(lines[1:]))


def fix_states(copy: dict[str, Any], failures: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Each fix's (state, reason) on ``copy``, where a fix that failed in this process
    (``failures``, from :func:`incidents.failures`) is ``failed``, with where and why: the
    fixes switch themselves off process-wide when they fail."""
    states = {}
    for fix, state in copy["fixes"].items():
        failed = fix in failures and state["state"] in (*PROTECTING, FixState.FAILED)
        states[fix] = ((FixState.FAILED, failures[fix]) if failed else
                       (state["state"], state["reason"]))
    return states


def _affected(copy: dict[str, Any]) -> bool:
    return bool(copy["refused"] or copy.get("release_defects") or any(
        state["state"] != FixState.NOT_NEEDED for state in copy["fixes"].values())
        or any(not limit["covered"] for limit in copy.get("limits", [])))


def _refusals(copies: list[dict[str, Any]]) -> list[str]:
    """The configurations no fix makes right, refused when a model is built (:mod:`.coverage`),
    a line per workaround: a job in another configuration is not refused."""
    refused: dict[str, dict[str, None]] = {}
    for copy in copies:
        for limit in copy.get("limits", []):
            if limit.get("refused_at_model_construction"):
                refused.setdefault(limit["workaround"], {})[limit["configuration"]] = None
    return [f"refused at model construction, if you build: {', '.join(configurations)} (no "
            "fix makes it right): " + ("" if workaround.startswith("set ") else "use ")
            + workaround for workaround, configurations in refused.items()]


def name(copy: dict[str, Any]) -> str:
    """``megatron-fsdp 0.6.1 (era C)``, ``megatron-fsdp (no version metadata, era none)``,
    ``... (not recognised)`` for a refused copy."""
    what = "not recognised" if copy["refused"] else f"era {copy['era']}"
    if copy["version"]:
        return f"{copy['copy']} {copy['version']} ({what})"
    return f"{copy['copy']} (no version metadata, {what})"


def _unprotected(copies: list[dict[str, Any]], hotfix: str | None,
                 failures: Mapping[str, str]) -> tuple[list[str], list[str], list[str]]:
    """Why the affected ``copies`` are not protected (nothing when they are), the same in a
    few words each for the first line, and what to use instead: fsdp_double_buffer=False for a
    refused copy or a double-buffer fix that does not protect, and the first workaround of each
    release defect left unrepaired. A refused copy is told with the fixes it keeps and those
    left as shipped."""
    reasons: list[str] = []
    short: list[str] = []
    remedies: list[str] = []
    for copy in copies:
        defects = copy.get("release_defects", [])
        named = f"{name(copy)}: " if len(copies) > 1 else ""
        states = fix_states(copy, failures)
        gaps = {fix: state for fix, (state, _) in states.items()
                if state != FixState.NOT_NEEDED
                and (hotfix in UNPROTECTING or state not in PROTECTING)}
        by_state: dict[str, list[str]] = {}
        for fix, state in gaps.items():
            by_state.setdefault(state, []).append(fix)
            if fix not in {defect["fix"] for defect in defects}:
                remedies.append(f"use {DOUBLE_BUFFER_OFF}")
        defects = [defect for defect in defects if not refused_when_built(defect, copy)]
        remedies += [f"for {defect['name']} use {defect['workarounds'][0]}" for defect in defects
                     if defect["fix"] in gaps or not defect["repaired"]]
        told: list[str] = []
        if copy["refused"]:
            remedies.append(f"use {DOUBLE_BUFFER_OFF}")
            refused = by_state.pop(FixState.REFUSED, [])
            told.append((f"{', '.join(refused)} " if refused else "")
                        + f"left as shipped ({copy['reason']})")
            short.append("left as shipped")
            kept = [fix for fix, (state, _) in states.items() if state in PROTECTING]
            if kept and hotfix not in UNPROTECTING:
                told.append(f"the hotfix still applies {', '.join(kept)}")
        if hotfix not in UNPROTECTING:
            for state, fixes in by_state.items():
                told += ([f"{fix} failed ({states[fix][1]})" for fix in fixes]
                         if state == FixState.FAILED else [f"{', '.join(fixes)} {state}"])
                short.append(f"{', '.join(fixes)} {state}")
        unrepaired = [defect for defect in defects if defect["fix"] is None]
        told += [_unrepaired(defect, copy) for defect in unrepaired]
        if unrepaired:  # named in the details
            short.append(f"{len(unrepaired)} defect{'s' if len(unrepaired) > 1 else ''} not "
                         "repaired")
        if told:
            reasons.append(named + "; ".join(told))
    if installer.INSTALL_FAILURE in failures:
        reasons.append(f"installing the hotfix failed ({failures[installer.INSTALL_FAILURE]})")
        short.append("installing the hotfix failed")
        remedies.append(f"use {DOUBLE_BUFFER_OFF}")
    if hotfix in UNPROTECTING and any(remedies):
        reasons.insert(0, UNPROTECTING[hotfix])
        short = [UNPROTECTING_SHORT[hotfix]]
    # each once, the one that covers most first
    remedies = sorted(dict.fromkeys(remedies), key=lambda r: r != f"use {DOUBLE_BUFFER_OFF}")
    return reasons, list(dict.fromkeys(short)), remedies


def refused_when_built(defect: dict[str, Any], copy: dict[str, Any]) -> bool:
    """Whether ``defect`` (no fix repairs it) is refused wherever it hits, in this process: the
    verdict names it among the refusals (:func:`_refusals`), not as unprotected."""
    return bool(defect.get("refused_when_built")) and all(
        limit.get("refused_at_model_construction") for limit in copy.get("limits", [])
        if limit.get("defect") == defect["name"])


def remedies(copy: dict[str, Any], hotfix: str | None) -> list[str]:
    """What to use instead for what ``copy`` leaves unprotected: the verdict's advice for it."""
    return _unprotected([copy], hotfix, {})[2]


def _unrepaired(defect: dict[str, Any], copy: dict[str, Any]) -> str:
    """A release defect no fix repairs, in the verdict's words, with the configurations it hits
    (its entry in the copy's ``limits``)."""
    carrier = defect["carrier"]
    hits = next((f" (it hits {limit['configuration']})" for limit in copy.get("limits", [])
                 if limit.get("defect") == defect["name"]), "")
    if carrier["shape"] is None:
        return (f"{defect['name']} not ruled out ({registry.short_name(carrier['function'])} "
                f"has a code shape the hotfix does not know) and not repaired by the "
                f"hotfix{hits}")
    return f"{defect['name']} is not repaired by the hotfix{hits}"
