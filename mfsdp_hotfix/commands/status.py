"""``mfsdp-hotfix status``: whether a copy is affected and protected, then each copy found, for a
new process of this environment or (``--path``) for a folder read from disk; needs no torch.
Its text, ``--verbose`` and ``--json`` renderings of :mod:`..reporting`'s data are all here."""

from __future__ import annotations

import argparse
import json
import os
import re
import site
import sys
from typing import Any

from .. import bootstrap, registry, reporting, settings, tree, variables
from ..states import FixState
from ..verdict_text import block
from .exits import CHECK_OK, CHECK_UNFIXED
from .output import emit

NAME = "status"
HELP = "affected? protected? then each copy found and its fixes"
USAGE: str | None = None
DESCRIPTION = ("For a new Python process of this environment: first one line, whether a "
               "Megatron-FSDP copy is affected and whether it is protected (or what to use "
               "instead), then one line per copy found and how the hotfix is loaded. Warnings "
               "go to stderr. Needs no torch.")


def add_arguments(show: argparse.ArgumentParser) -> None:
    show.add_argument("--json", action="store_true", help="one JSON object on stdout")
    show.add_argument("--verbose", action="store_true",
                      help="also each copy's code shapes, fix reasons and release defects")
    show.add_argument("--check", action="store_true",
                      help=f"exit {CHECK_UNFIXED} if an affected copy would be left unfixed "
                           "(the first line then says NOT protected)")
    show.add_argument("--path", metavar="DIR",
                      help="judge the copies in DIR instead (an unpacked release or wheel, a "
                           "site-packages folder, a Megatron-LM checkout), read from their source "
                           f"without importing them; exit {tree.NOT_A_FOLDER} if DIR is not a "
                           f"readable folder, {tree.NOTHING_FOUND} if it holds no copy")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.path is not None:
        return _folder_status(args.path, args.json, args.check, args.verbose)
    data = report()
    _warn(data["settings"]["problems"])
    emit(_json(data) if args.json else _format(data, args.verbose))
    return _check_status(data) if args.check else CHECK_OK


def report() -> dict[str, Any]:
    """``status()`` as a *new* process of this environment would see it: whether it loads the
    hotfix at interpreter start, and what would apply once it imports Megatron-FSDP."""
    data = reporting.status()
    pth = [os.path.join(d, bootstrap.PTH_NAME) for d in _site_dirs()
           if os.path.isfile(os.path.join(d, bootstrap.PTH_NAME))]
    on_path = bootstrap.SITECUSTOMIZE_DIR in os.environ.get("PYTHONPATH", "").split(os.pathsep)
    opted_out = variables.switch(os.environ.get(settings.BOOTSTRAP, "")) is False
    loaded_via = ("sitecustomize" if on_path else "pth" if pth and not opted_out else None)
    data["scope"] = "a new Python process of this environment"
    data["hotfix"] = ("off" if data["settings"]["mode"] == "off" else
                      "armed" if loaded_via else "not loaded")
    data["hotfix_meaning"] = reporting.HOTFIX_STATES[data["hotfix"]]
    data["loaded_via"] = loaded_via
    data["bootstrap"] = {"pth_files": pth, "pth_active": bool(pth) and not opted_out,
                         "sitecustomize_on_pythonpath": on_path,
                         "variables": {name: os.environ.get(name)
                                       for name in settings.ALL_VARIABLES}}
    data["unfixed"] = _unfixed(data)
    data["verdict"] = reporting.verdict(data, data["hotfix"])
    return data


def _site_dirs() -> list[str]:
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return dirs


def _unfixed(data: dict[str, Any]) -> list[str]:
    """Every affected copy that a training process here would run unfixed, and why: a copy
    refused, a fix failed, disabled, off or unverified, or fixes that would apply but that no
    new process loads (no ``.pth``, no sitecustomize bootstrap)."""
    problems = []
    for copy in data["copies"]:
        name = f"{copy['copy']} {copy['version'] or '?'} at {copy['path']}"
        if copy["refused"]:
            problems.append(f"{name}: refused ({copy['reason']})")
        for fix, state in copy["fixes"].items():
            if state["state"] in (FixState.FAILED, FixState.DISABLED, FixState.OFF,
                                  FixState.UNVERIFIED):
                problems.append(f"{name}: {fix} {state['state']} ({state['reason']})")
        waiting = [fix for fix, state in copy["fixes"].items()
                   if state["state"] == FixState.WOULD_APPLY]
        if waiting and data.get("hotfix") == "not loaded":
            problems.append(f"{name}: {', '.join(waiting)} would apply, but "
                            f"{reporting.UNPROTECTING['not loaded']}")
        problems += [f"{name}: release defect {defect['name']} not repaired (no fix repairs it; "
                     f"{defect['configuration']})"
                     for defect in copy.get("release_defects", [])
                     if defect["fix"] is None and not reporting.refused_when_built(defect, copy)]
    return problems


def _folder_status(path: str, as_json: bool, check: bool, verbose: bool) -> int:
    """``status --path DIR``: every copy in DIR, judged from its source."""
    try:
        data = tree.judge(path)
    except tree.TreeError as exc:
        if as_json:
            print(json.dumps({"path": path, "error": str(exc), "copies": [], "v2_copies": []}))
        print(f"mfsdp-hotfix status --path: {exc}", file=sys.stderr)
        return exc.exit_status
    _warn(data["settings"]["problems"])
    data["unfixed"] = _unfixed(data)
    data["verdict"] = reporting.verdict(data, None)
    if as_json:
        emit(_json(data))
        return _check_status(data) if check else CHECK_OK
    lines = _verdict_lines(data["verdict"])
    lines += _copies_lines(data, verbose)
    lines.append(f"mfsdp-hotfix {data['mfsdp_hotfix']}, for {data['scope']}"
                 + (" (labels from the dist-info beside each copy only)" if verbose else ""))
    lines += _tail(data, verbose)
    emit("\n".join(lines))
    return _check_status(data) if check else CHECK_OK


def _check_status(data: dict[str, Any]) -> int:
    """``--check``: 1 exactly when the first line says NOT protected."""
    return CHECK_UNFIXED if data["verdict"]["protected"] is False else CHECK_OK


def _json(data: dict[str, Any]) -> str:
    """``status --json``: the verdict first (``| head`` shows the answer), the rest sorted."""
    def ordered(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: ordered(value[key]) for key in sorted(value)}
        return [ordered(item) for item in value] if isinstance(value, list) else value
    return json.dumps({"verdict": data["verdict"], **ordered(data)}, indent=2)


def _warn(problems: list[str]) -> None:
    """The settings' warnings on stderr, but those the bootstrap of this process wrote already
    (a misspelt name, told at interpreter start)."""
    for problem in problems:
        if not variables.told(problem):
            print(f"{variables.WARNING}{problem}", file=sys.stderr)


def _format(data: dict[str, Any], verbose: bool) -> str:
    boot = data["bootstrap"]
    how = {"pth": "at interpreter start by " + ", ".join(boot["pth_files"]),
           "sitecustomize": "at interpreter start by the sitecustomize on PYTHONPATH"}
    lines = _verdict_lines(data["verdict"])
    lines += _copies_lines(data, verbose)
    for fix, why in data["failures"].items():
        lines.append(f"  FAILED {fix}: {why}")
    armed = data["hotfix"] == "armed"
    lines.append(f"mfsdp-hotfix {data['mfsdp_hotfix']}, in {data['scope']}: the hotfix is "
                 f"{data['hotfix']}" + (f" {how[data['loaded_via']]}" if armed else "")
                 + (f": {data['hotfix_meaning']}" if verbose or not armed else ""))
    disabled = ", ".join(data["settings"]["disabled_fixes"])
    if disabled:
        lines.append(f"  {settings.DISABLED_FIXES}: {disabled}")
    lines += _tail(data, verbose)
    return "\n".join(lines)


def _verdict_lines(verdict: dict[str, Any]) -> list[str]:
    """The answer: its first line, then its details indented (:mod:`..verdict_text`)."""
    return block(verdict["line"], verdict["details"]).splitlines()


def _copies_lines(data: dict[str, Any], verbose: bool) -> list[str]:
    """One short line per copy, or (``verbose``) each copy's shapes, notes, fixes and defects."""
    lines = []
    if verbose and data["copies"]:
        lines.append(f"Megatron-FSDP copies ({reporting.SHAPE_MEANING}):")
    for copy in data["copies"]:
        lines += _copy_lines(copy) if verbose else [_copy_line(copy, data.get("hotfix"))]
        if verbose:
            lines += [f"    {name} states {version} (not used as the label)"
                      for name, version in copy.get("package_info", {}).items()]
    lines += _v2_lines(data["v2_copies"], verbose)
    return lines


def _tail(data: dict[str, Any], verbose: bool) -> list[str]:
    if verbose:
        return (["Left unfixed:"] + [f"  {p}" for p in data["unfixed"]]) if data["unfixed"] \
            else []
    return ["(--verbose: each copy's code shapes, fixes and release defects; --json: "
            "everything)"] if data["copies"] else []


def _copy_line(copy: dict[str, Any], hotfix: str | None) -> str:
    """``- megatron-fsdp 0.6.1 (era C): ordered-drain, zero1-accumulate would apply; at PATH``;
    a refused copy: what is left as shipped, what still applies, and what to use instead."""
    by_state: dict[str, list[str]] = {}
    for fix, state in copy["fixes"].items():
        if state["state"] != FixState.NOT_NEEDED:
            by_state.setdefault(state["state"], []).append(fix)
    left = ", ".join(by_state.pop(FixState.REFUSED, [])) if copy["refused"] else ""
    parts = [f"{', '.join(names)} {state}" for state, names in by_state.items()]
    unrepaired = [defect for defect in copy.get("release_defects", []) if defect["fix"] is None
                  and not reporting.refused_when_built(defect, copy)]
    parts += [f"{defect['name']} NOT repaired" for defect in unrepaired]
    if copy["refused"]:
        parts = ([f"REFUSED: {left + ' ' if left else ''}left as shipped"] + parts
                 + reporting.remedies(copy, hotfix) + ["--verbose: why"])
    else:
        parts += [f"for {defect['name']} use {defect['workarounds'][0]}" for defect in unrepaired]
    notes = len(copy["notes"])
    return (f"- {reporting.name(copy)}: {'; '.join(parts) or 'needs none of the fixes'}"
            + (f" ({notes} note{'s' if notes > 1 else ''}: --verbose)" if notes else "")
            + f"; at {copy['path']}")


def _copy_lines(copy: dict[str, Any]) -> list[str]:
    """One copy's verdict, shapes, notes and fixes, as ``status --verbose`` prints them."""
    lines = [f"- {copy['copy']} {copy['version'] or '(no version metadata)'}: "
             + (f"REFUSED: {copy['reason']}" if copy["refused"] else
                f"era {copy['era']}, {copy['defect']}"),
             f"    path: {copy['path']}"]
    if copy["without_hotfix"]:
        lines.append(f"    without the hotfix: {copy['without_hotfix']}")
    for name, found in copy["functions"].items():
        lines.append(f"    {_shape_line(name, found, copy['fingerprints'].get(name), copy)}")
    if copy.get("pool_size_text"):
        lines.append(f"    gradient pool slots (N): {copy['pool_size_text']}")
    for note in copy["notes"]:
        lines.append(f"    note: {note}")
    for fix, state in copy["fixes"].items():
        lines.append(f"    {fix}: {state['state']} ({state['reason']})")
    for defect in copy.get("release_defects", []):
        refused = reporting.refused_when_built(defect, copy)
        lines += [f"    release defect {defect['name']}: "
                  + ("repaired" if defect["repaired"] else
                     "refused when a model is built" if refused else "NOT repaired")
                  + (f" ({defect['fix']}: {defect['fix_state']})" if defect["fix"] else
                     f" (no fix repairs it; {_carrier_words(defect['carrier'])})"),
                  f"      when: {defect['configuration']}",
                  f"      symptom: {defect['symptom']}",
                  "      without the fix: " + "; or ".join(defect["workarounds"]),
                  f"      upstream fix: {defect['upstream']}",
                  f"      not covered: {defect['not_covered']}"]
    return lines


def _carrier_words(carrier: dict[str, Any]) -> str:
    """``_bucket_group_gradient_reduce: the code of megatron-core 0.14``: where the copy's code
    has the defect."""
    name = registry.short_name(carrier["function"])
    if carrier["shape"] is None:
        return f"{name} has a code shape the hotfix does not know: the copy may have it"
    return f"{name}: {_shape_words(carrier['shape'])}"


def _v2_lines(v2_copies: list[dict[str, Any]], verbose: bool) -> list[str]:
    return [f"- {v2['copy']} {v2['version'] or '(no version metadata)'}"
            + (" (imported)" if v2["imported"] else "")
            + f": the hotfix does {v2['hotfix']} here"
            + (f": {v2['reason']}\n    path: {v2['path']}" if verbose else
               f" (--verbose: why); at {v2['path']}")
            for v2 in v2_copies]


def _shape_line(qualname: str, found: dict[str, Any], fingerprint: str | None,
                copy: dict[str, Any]) -> str:
    """``main_grad_getter: as shipped in megatron-fsdp 0.4.0-0.5.1 (and megatron-core
    0.17.0-0.18.2; unguarded)``: the copy's own distribution first."""
    name = registry.short_name(qualname)
    if found["shape"] is None:
        return f"{name}: unknown shape (" + (f"fingerprint {fingerprint[:12]})" if fingerprint
                                             else "not found)")
    if found["as_shipped_in"]:
        own: list[str] = []
        other: list[str] = []
        for part in found["as_shipped_in"].split(", "):
            (own if part.startswith(f"{copy['distribution']} ") else other).append(part)
        shipped = ", ".join(own or other)
        also = ", ".join(other if own else [])
        return (f"{name}: as shipped in {shipped} ("
                + (f"and {also}; " if also else "") + f"{found['implies']})")
    return (f"{name}: {_shape_words(found['shape'])}, recognised by {found['matched_by']} "
            f"({found['implies']})")


def _shape_words(shape: str) -> str:
    """``the code of megatron-core 0.14`` for a shape named after a megatron-core release, else
    the shape's own name (``drains before fetching``)."""
    if re.fullmatch(r"\d+\.\d+", shape):  # shapes are named after megatron-core releases
        return f"the code of megatron-core {shape}"
    return shape
