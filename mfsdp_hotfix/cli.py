"""``mfsdp-hotfix``: status, selftest, run, audit, bootstrap-path and help.

``status`` and ``bootstrap-path`` work without torch; ``selftest`` needs torch and a
Megatron-FSDP copy; ``run`` starts a command with the sitecustomize bootstrap on PYTHONPATH;
``audit`` does the same with the on-the-job audit on and summarises its rank files.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import site
import sys
from typing import Any

from . import bootstrap, installer, reporting, settings, status, tree, variables
from .__about__ import __version__
from .selftest.gpu_spec import LAYERS as GPU_LAYERS
from .selftest.protocol import DEFAULT as DEFAULT_PROTOCOL
from .selftest.protocol import PROTOCOLS

# Exit status of a usage error (argparse's): no command, an unknown one, a bad option.
USAGE_ERROR = 2
# Exit codes of ``status --check``.
CHECK_OK, CHECK_UNFIXED = 0, 1
# Exit codes of ``selftest``: PASS, FAIL (a fix failed), and CANNOT RUN here (no torch, no
# numpy; --gpu: no CUDA GPU), a word of its own so that a grep for FAIL counts broken fixes only.
SELFTEST_PASS, SELFTEST_FAIL, SELFTEST_CANNOT_RUN = 0, 1, 2
CANNOT_RUN = "CANNOT RUN"

GPU_ONLY = ("gpus", "layer", "delay_ms", "zero", "dtype", "timeout")
# A reader that closed the pipe early (``mfsdp-hotfix status | head -1``): the shell's status
# for a command killed by SIGPIPE.
BROKEN_PIPE = 141
# ``run`` and ``audit`` when COMMAND cannot be started (the shell's status for a command not
# found or not executable).
CANNOT_START = 127
DESCRIPTION = ("Runtime repair of Megatron-FSDP's gradient double-buffer race. 'status' and "
               "'bootstrap-path' work without torch; 'selftest' needs torch and a Megatron-FSDP "
               "copy; 'run' starts a command with the hotfix loaded in every Python process; "
               "'audit' does the same with the on-the-job audit on and summarises it.")


class _CommandListFormatter(argparse.HelpFormatter):
    """One line per command: argparse measures the command names without the indent they are
    printed with, so the longest (bootstrap-path) would wrap its help onto a line of its own."""

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        for subaction in self._iter_indented_subactions(action):
            self._action_max_length = max(self._action_max_length, self._current_indent + len(
                self._format_action_invocation(subaction)))


def main(argv: list[str] | None = None) -> int:
    """``mfsdp-hotfix``; a closed stdout (``| head``) ends it quietly with status 141 (``status``
    keeps its own)."""
    try:
        try:
            code = _main(argv)
        finally:  # also after argparse's exit (--help, usage errors)
            sys.stdout.flush()
    except BrokenPipeError:
        # Nothing more can be shown; keep the interpreter's own flush at exit quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE
    return code


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="mfsdp-hotfix", description=DESCRIPTION,
                                     formatter_class=_CommandListFormatter)
    parser.add_argument("--version", action="version", version=f"mfsdp-hotfix {__version__}",
                        help="print the version and exit")
    commands = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    show = commands.add_parser(
        "status", help="affected? protected? then each copy found and its fixes",
        description="For a new Python process of this environment: first one line, whether a "
                    "Megatron-FSDP copy is affected and whether it is protected (or what to "
                    "use instead), then one line per copy found and how the hotfix is loaded. "
                    "Warnings go to stderr. Needs no torch.")
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
    test = commands.add_parser(
        "selftest", help="prove the fix on this install (CPU, 2 ranks)",
        description="Train a small model with this environment's torch and Megatron-FSDP on CPU "
                    "(2 gloo ranks, fused wgrad, fsdp_double_buffer=True), once with "
                    "MFSDP_HOTFIX=0 and once with the hotfix; installs nothing. The last line "
                    "is 'selftest: PASS: ...' (exit 0), 'selftest: FAIL: ...' (exit 1: a fix "
                    "failed) or 'selftest: CANNOT RUN: ...' (exit 2: no torch or numpy here, "
                    "or the copy asked for cannot be imported).")
    test.add_argument("--path", help="folder put first on sys.path of the test processes, "
                                     "e.g. an unpacked release (default: as installed); "
                                     "refused if it is not a folder")
    test.add_argument("--flavour", choices=["auto", "standalone", "core"], default="auto",
                      help="which Megatron-FSDP copy to test: 'standalone' (megatron_fsdp), "
                           "'core' (the copy vendored in megatron-core) or 'auto' (megatron-"
                           "core's when importable, else megatron_fsdp; default)")
    test.add_argument("--json", action="store_true",
                      help="print the results as one JSON object on stdout (progress, table "
                           "and the verdict line go to stderr)")
    test.add_argument("--protocol", choices=list(PROTOCOLS), default=DEFAULT_PROTOCOL,
                      help="how the 2 microbatches of each step are driven: 'megatron-lm' "
                           "(no_sync() around every microbatch but the last, as Megatron-LM and "
                           "Megatron-Bridge do; default) or 'auto-sync' (fully_shard's default "
                           "sync_model_each_microbatch=True); also with --gpu")
    test.add_argument("--audit", action="store_true",
                      help="run both phases with the on-the-job audit on and check that its "
                           "counts equal the stand-in's; with --json, print {\"phases\": [...]} "
                           "(with --gpu the audit is always on)")
    gpu = test.add_argument_group(
        "GPU mode", "--gpu runs the same before/after on this machine's GPU(s): 1 GPU as a fake "
        "2-rank group with NCCL work semantics, several as NCCL ranks (torchrun); real "
        "TransformerEngine layers when transformer_engine is importable; each reduce-scatter "
        "made slow; every run compared bit for bit with the same run under "
        "CUDA_LAUNCH_BLOCKING=1, and the on-the-job audit on. PASS: with the hotfix the "
        "gradients are bit-identical and the audit saw >0 slot reuses, none unordered. Exit 2 "
        "when it cannot run here (no CUDA GPU).")
    gpu.add_argument("--gpu", action="store_true", help="run on the GPU(s) instead of the CPU")
    gpu.add_argument("--gpus", type=int, metavar="N",
                     help="how many GPUs to use (default: all visible; 1: fake 2-rank group)")
    gpu.add_argument("--layer", choices=list(GPU_LAYERS), default="auto", metavar="LAYER",
                     help="'te-layernorm-mlp' (te.LayerNormMLP), 'te-linear' (te.Linear), "
                          "'emulated' (TransformerEngine's fused-wgrad contract in PyTorch) or "
                          "'auto' (te-layernorm-mlp when transformer_engine is importable, else "
                          "emulated; default)")
    gpu.add_argument("--delay-ms", type=float, default=20.0, metavar="MS",
                     help="slow-reduce-scatter fault: GPU sleep enqueued before each "
                          "reduce-scatter, calibrated with CUDA events (default 20; 0: none)")
    gpu.add_argument("--zero", type=int, choices=[2, 3], default=3,
                     help="ZeRO stage: 3 shards parameters too, 2 gradients only (default 3)")
    gpu.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                     help="parameter dtype (default fp32)")
    gpu.add_argument("--timeout", type=float, default=300.0, metavar="S",
                     help="seconds each run may take before it is killed (default 300)")
    run = commands.add_parser("run", help="run a command with the hotfix on every process",
                              usage="mfsdp-hotfix run -- COMMAND [ARGS...]",
                              description="Run COMMAND with the hotfix's sitecustomize first on "
                                          "PYTHONPATH, so that it and every Python process it "
                                          "starts load the hotfix (for environments that do not "
                                          "process site-packages .pth files).")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="COMMAND",
                     help="the command and its arguments, after --")
    audit = commands.add_parser(
        "audit", help="run a job with the on-the-job audit, then summarise it",
        usage="mfsdp-hotfix audit --out PATH -- COMMAND [ARGS...]",
        description="Run COMMAND (e.g. torchrun ... train.py) like 'mfsdp-hotfix run', with "
                    "MFSDP_HOTFIX_AUDIT=PATH: every rank writes PATH.rank<N>.json. Then print a "
                    "summary of them; the last line is 'audit: <VERDICT>: ...' (UNORDERED, "
                    "CRASH, WRONG GRADIENTS, UNWATCHED, INCOMPLETE, NOT CHECKED, ordered, "
                    "UNWRITABLE or NO DATA). Exit status: 3 for a finding (UNORDERED, CRASH, "
                    "WRONG GRADIENTS) whatever the "
                    "command's status; else the command's when it failed; else 0 only for "
                    "ordered, 4 when nothing or not everything was checked; 2 when nothing was "
                    "run (an --out where no file can be created, or rank files of an earlier "
                    "run there without --overwrite).")
    audit.add_argument("--out", required=True, metavar="PATH",
                       help="path prefix of the rank files (PATH.rank<N>.json); a missing "
                            "folder is created (and said so)")
    audit.add_argument("--overwrite", action="store_true",
                       help="delete rank files PATH.rank<N>.json of an earlier run before "
                            "running (without it, their presence stops the audit before it "
                            "runs anything)")
    audit.add_argument("cmd", nargs=argparse.REMAINDER, metavar="COMMAND",
                       help="the command and its arguments, after --")
    commands.add_parser("bootstrap-path", help="print the folder to prepend to PYTHONPATH",
                        description="Print the folder holding the hotfix's sitecustomize, for "
                                    "job scripts: PYTHONPATH=$(mfsdp-hotfix bootstrap-path)"
                                    ":$PYTHONPATH")
    guide = commands.add_parser("help", help="print the commands, or one command's help",
                                usage="mfsdp-hotfix help [COMMAND]",
                                description="Print the list of commands, or with COMMAND that "
                                            "command's options (as 'mfsdp-hotfix COMMAND "
                                            "--help' does).")
    guide.add_argument("topic", nargs="?", metavar="COMMAND",
                       choices=[name for name in commands.choices if name != "help"],
                       help="one of the commands above")
    args, extra = parser.parse_known_args(argv)
    if extra:  # argparse would blame the top-level parser, and show its usage
        (commands.choices[args.command] if args.command else parser).error(
            f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:  # a usage error, with the list of commands
        sys.stderr.write(parser.format_help())
        parser.exit(USAGE_ERROR, "mfsdp-hotfix: error: name a COMMAND (see above; 'mfsdp-hotfix "
                                 "help COMMAND' shows its options)\n")
    if args.command == "help":
        print((commands.choices[args.topic] if args.topic else parser).format_help(), end="")
        return 0
    if args.command == "status":
        return _status(args.json, args.check, args.path, args.verbose)
    if args.command == "selftest":
        _note_audit_not_passed_on(args.json)
        if args.path is not None:  # a mistyped --path must not test the installed copy instead
            try:
                tree.readable_folder(args.path)
            except tree.TreeError as exc:
                return _selftest_cannot_run(f"--path {exc}. Nothing was tested", args.json,
                                            "gpu" if args.gpu else "cpu")
        if args.gpu:
            return _gpu_selftest(args)
        given = [f"--{name.replace('_', '-')}" for name in GPU_ONLY
                 if getattr(args, name) != test.get_default(name)]
        if given:
            test.error(f"{', '.join(given)} only apply with --gpu")
        return _selftest(args.path, args.flavour, args.json, args.audit, args.protocol)
    if args.command == "run":
        return _run(args.cmd, run)
    if args.command == "audit":
        return _audit(args.out, args.cmd, audit, args.overwrite)
    print(bootstrap.SITECUSTOMIZE_DIR)
    return 0


def report() -> dict[str, Any]:
    """``status()`` as a *new* process of this environment would see it: whether it loads the
    hotfix at interpreter start, and what would apply once it imports Megatron-FSDP."""
    data = status()
    pth = [os.path.join(d, bootstrap.PTH_NAME) for d in _site_dirs()
           if os.path.isfile(os.path.join(d, bootstrap.PTH_NAME))]
    on_path = bootstrap.SITECUSTOMIZE_DIR in os.environ.get("PYTHONPATH", "").split(os.pathsep)
    opted_out = os.environ.get(settings.BOOTSTRAP, "").strip().lower() in {"0", "off", "false",
                                                                           "no"}
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
            if state["state"] in ("failed", "disabled", "off", "unverified"):
                problems.append(f"{name}: {fix} {state['state']} ({state['reason']})")
        waiting = [fix for fix, state in copy["fixes"].items() if state["state"] == "would apply"]
        if waiting and data.get("hotfix") == "not loaded":
            problems.append(f"{name}: {', '.join(waiting)} would apply, but "
                            f"{reporting.UNPROTECTING['not loaded']}")
        problems += [f"{name}: release defect {defect['name']} not repaired (no fix repairs it; "
                     f"{defect['configuration']})"
                     for defect in copy.get("release_defects", []) if defect["fix"] is None]
    return problems


def _status(as_json: bool, check: bool, path: str | None, verbose: bool) -> int:
    if path is not None:
        return _folder_status(path, as_json, check, verbose)
    data = report()
    _warn(data["settings"]["problems"])
    _emit(_json(data) if as_json else _format(data, verbose))
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


def _emit(text: str) -> None:
    """Print ``text``; a reader that went away (``status --check | head -1``) took what it
    wanted: the rest is dropped quietly and the command keeps its own exit status."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _warn(problems: list[str]) -> None:
    """The settings' warnings on stderr, but those the bootstrap of this process wrote already
    (a misspelt name, told at interpreter start)."""
    for problem in problems:
        if not variables.told(problem):
            print(f"mfsdp-hotfix status: warning: {problem}", file=sys.stderr)


def _format(data: dict[str, Any], verbose: bool) -> str:
    boot = data["bootstrap"]
    how = {"pth": "at interpreter start by " + ", ".join(boot["pth_files"]),
           "sitecustomize": "at interpreter start by the sitecustomize on PYTHONPATH"}
    lines = [data["verdict"]["line"]]
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
        if state["state"] != "not needed":
            by_state.setdefault(state["state"], []).append(fix)
    left = ", ".join(by_state.pop(installer.REFUSED, [])) if copy["refused"] else ""
    parts = [f"{', '.join(names)} {state}" for state, names in by_state.items()]
    unrepaired = [defect for defect in copy.get("release_defects", []) if defect["fix"] is None]
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
        lines += [f"    release defect {defect['name']}: "
                  + ("repaired" if defect["repaired"] else "NOT repaired")
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
    name = carrier["function"].rsplit(".", 1)[-1]
    shape = carrier["shape"]
    if shape is None:
        return f"{name} has a code shape the hotfix does not know: the copy may have it"
    return f"{name}: the code of megatron-core {shape}" if re.fullmatch(r"\d+\.\d+", shape) \
        else f"{name}: {shape}"


def _v2_lines(v2_copies: list[dict[str, Any]], verbose: bool) -> list[str]:
    return [f"- {v2['copy']} {v2['version'] or '(no version metadata)'}"
            + (" (imported)" if v2["imported"] else "")
            + f": the hotfix does {v2['hotfix']} here"
            + (f": {v2['reason']}\n    path: {v2['path']}" if verbose else
               f" (--verbose: why); at {v2['path']}")
            for v2 in v2_copies]


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
        _emit(_json(data))
        return _check_status(data) if check else CHECK_OK
    lines = [data["verdict"]["line"]]
    lines += _copies_lines(data, verbose)
    lines.append(f"mfsdp-hotfix {data['mfsdp_hotfix']}, for {data['scope']}"
                 + (" (labels from the dist-info beside each copy only)" if verbose else ""))
    lines += _tail(data, verbose)
    _emit("\n".join(lines))
    return _check_status(data) if check else CHECK_OK


def _shape_line(qualname: str, found: dict[str, Any], fingerprint: str | None,
                copy: dict[str, Any]) -> str:
    """``main_grad_getter: as shipped in megatron-fsdp 0.4.0-0.5.1 (and megatron-core
    0.17.0-0.18.2; unguarded)``: the copy's own distribution first."""
    name = qualname.rsplit(".", 1)[-1]
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
    shape = found["shape"]
    if re.fullmatch(r"\d+\.\d+", shape):  # shapes are named after megatron-core releases
        shape = f"the code of megatron-core {shape}"
    return f"{name}: {shape}, recognised by {found['matched_by']} ({found['implies']})"


def _note_audit_not_passed_on(as_json: bool) -> None:
    """``mfsdp-hotfix audit -- mfsdp-hotfix selftest`` ends NO DATA: say why, before it runs."""
    if os.environ.get(settings.AUDIT, "").strip():
        print(f"selftest: note: {settings.AUDIT} is set (as 'mfsdp-hotfix audit' sets it), but "
              "the selftest does not pass it to its workers: it runs the same ranks without and "
              "with the hotfix, whose rank files would overwrite each other, so an audit around "
              "the selftest finds no rank file (NO DATA). 'mfsdp-hotfix selftest --audit' audits "
              "each run in a folder of its own and checks the audit's counts against the "
              "selftest's own.", file=sys.stderr if as_json else sys.stdout, flush=True)


def _selftest(path: str | None, flavour: str, as_json: bool, audit: bool,
              protocol: str = DEFAULT_PROTOCOL) -> int:
    """``selftest`` (and ``--audit``: both phases with the audit on, and PASS also needs the
    audit's counts to equal the stand-in's in each phase)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return _selftest_cannot_run(
            "no torch in this environment. The selftest runs on this environment's own torch "
            "and Megatron-FSDP and installs nothing; to try it on a machine without them, use a "
            "fresh virtual environment (README, 'Try it').", as_json, "cpu")
    try:
        import numpy  # noqa: F401
    except ImportError:
        return _selftest_cannot_run(
            "no numpy in this environment. torch.distributed's all_gather_object, which "
            "Megatron-FSDP calls, needs it on CPU (gloo); `pip install numpy`, or use a fresh "
            "virtual environment (README, 'Try it').", as_json, "cpu")
    from .selftest.selftest import audit_phase, cannot_run, conclusion, run_selftest

    # With --json, stdout carries only the JSON; progress and the table go to stderr.
    runs = run_selftest(path=path, flavour=flavour, out=sys.stderr if as_json else sys.stdout,
                        audit=audit, protocol=protocol)
    blocked = cannot_run(runs)
    if blocked:  # said already, as the last line
        if as_json:
            print(json.dumps({"verdict": CANNOT_RUN, "conclusion": blocked, "mode": "cpu",
                              "cannot_run": blocked.split(": ", 2)[2]}))
        return SELFTEST_CANNOT_RUN
    passed, line = conclusion(runs)
    if as_json:
        results = ({"phases": [audit_phase(name, result) for name, result in runs]} if audit
                   else {name: result.to_dict() for name, result in runs})
        print(json.dumps({"verdict": "PASS" if passed else "FAIL", "conclusion": line,
                          **results}, default=str))
    return SELFTEST_PASS if passed else SELFTEST_FAIL


def _selftest_cannot_run(why: str, as_json: bool, mode: str) -> int:
    """``selftest: CANNOT RUN: <why>`` on stderr (and with ``--json`` as the JSON's verdict)."""
    line = f"selftest: {CANNOT_RUN}: {why}"
    if as_json:
        print(json.dumps({"verdict": CANNOT_RUN, "conclusion": line, "mode": mode,
                          "cannot_run": why}))
    print(line, file=sys.stderr)
    return SELFTEST_CANNOT_RUN


def _gpu_selftest(args: argparse.Namespace) -> int:
    """``selftest --gpu``: the runs, the table and the verdict line (the audit is always on)."""
    out = sys.stderr if args.json else sys.stdout

    def cannot_run(why: str) -> int:
        line = (f"selftest: {CANNOT_RUN}: the GPU selftest cannot run here: {why}. It needs this "
                "environment's torch with CUDA and at least one visible GPU; without a GPU, "
                "run `mfsdp-hotfix selftest` (CPU)")
        if args.json:
            print(json.dumps({"verdict": CANNOT_RUN, "conclusion": line, "mode": "gpu",
                              "cannot_run": why}))
        print(line, file=out)
        return SELFTEST_CANNOT_RUN

    try:
        import torch  # noqa: F401
    except ImportError:
        return cannot_run("no torch in this environment")
    from .selftest import gpu

    try:
        visible, _ = gpu.probe_cuda()
        plan = gpu.build_plan(visible, args.gpus, args.layer, gpu.te_importable(),
                              flavour=args.flavour, zero=args.zero, delay_ms=args.delay_ms,
                              dtype=args.dtype, timeout_s=args.timeout,
                              protocol=args.protocol)
    except gpu.CannotRun as exc:
        return cannot_run(str(exc))
    results = gpu.run_gpu_selftest(plan, path=args.path, out=out, progress=sys.stderr)
    data = gpu.to_json(plan, results)
    if args.json:
        print(json.dumps(data, default=str))
    return SELFTEST_PASS if data["verdict"] == "PASS" else SELFTEST_FAIL


def _audit(out: str, command: list[str], parser: argparse.ArgumentParser,
           overwrite: bool) -> int:
    """``audit``: the command with the bootstrap and MFSDP_HOTFIX_AUDIT, then a summary.
    Rank files of an earlier run at the same path are evidence: without ``--overwrite`` they
    stop the audit before anything runs."""
    import subprocess

    from .audit import report as audit_report

    command = _command(command, parser, f"--out {out}")
    path = os.path.abspath(out)
    problem = _out_problem(out, path)
    earlier = audit_report.rank_files(path)
    if not problem and earlier and not overwrite:
        problem = (f"rank files of an earlier run are there ({_names(earlier)}); give a new "
                   "path, or add --overwrite to delete them first")
    if problem:
        print(f"mfsdp-hotfix audit: --out {out}: {problem}; nothing was run", file=sys.stderr)
        return USAGE_ERROR
    for name in earlier.values():  # --overwrite: a summary of this run only
        try:
            os.remove(name)
        except OSError as exc:
            print(f"mfsdp-hotfix audit: cannot remove {name} from an earlier run ({exc}); "
                  "the summary may include it", file=sys.stderr)
    created = _make_folders(os.path.dirname(path))
    env = dict(os.environ, PYTHONPATH=_bootstrap_path(), **{settings.AUDIT: path})
    try:
        child = subprocess.Popen(command, env=env)
    except OSError as exc:
        for folder in created:  # nothing ran: leave nothing behind (but what another put there)
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        print(f"mfsdp-hotfix audit: cannot start {command[0]!r}: {exc}", file=sys.stderr)
        return CANNOT_START
    if created:
        print(f"mfsdp-hotfix audit: created the folder {created[0]} for the rank files",
              file=sys.stderr)
    while True:
        try:
            status = child.wait()
            break
        except KeyboardInterrupt:  # the command got the same signal; let it finish
            continue
    reports, unreadable = audit_report.read_rank_files(path)
    verdict, lines = audit_report.summarise(reports, path, None if reports or unreadable
                                            else audit_report.probe(path))
    print(f"mfsdp-hotfix audit: {len(reports)} rank file(s) {path}.rank<N>.json"
          + (f" ({len(earlier)} from an earlier run deleted first: --overwrite)" if earlier
             else ""))
    for line in lines + [f"unreadable: {name}" for name in unreadable]:
        print(f"  {line}")
    meaning, todo, _ = audit_report.VERDICTS[verdict]
    print(f"audit: {verdict}: {meaning}" + ("" if verdict == "ordered" else f"; {todo}")
          + f" (command exit status {status})")
    return audit_report.exit_status(verdict, status)


def _names(files: dict[int, str]) -> str:
    names = [os.path.basename(name) for _, name in sorted(files.items())]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _make_folders(folder: str) -> list[str]:
    """Make ``folder`` and the folders above it that are missing; returns those made, deepest
    first (removed again if the command cannot be started)."""
    missing = []
    while not os.path.isdir(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    for made in reversed(missing):
        os.mkdir(made)
    return missing


def _out_problem(out: str, path: str) -> str | None:
    """Why the rank files ``PATH.rank<N>.json`` cannot go where ``--out`` says (None: fine):
    probed by creating a file, before anything runs."""
    from .audit import report as audit_report

    prefix = "--out takes a path prefix, the rank files are PATH.rank<N>.json"
    if out.endswith(("/", os.sep)) or os.path.isdir(path):
        return f"is a folder ({prefix}): name a run inside it, e.g. {os.path.join(path, 'run1')}"
    if os.path.exists(path):
        return (f"is an existing file ({prefix}, not a file to write): give a path that does "
                "not exist yet")
    folder = os.path.dirname(path)
    parent = folder
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is a file, so the folder {folder} for the rank files cannot exist"
    return audit_report.probe(path)


def _command(command: list[str], parser: argparse.ArgumentParser, options: str = ""
             ) -> list[str]:
    """COMMAND after ``--``; none is a usage error of ``parser`` (the command's own), with an
    example that has the ``options`` given."""
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        verb = parser.prog.split()[-1]
        parser.error(f"{verb} needs a command: {parser.prog} {options}{' ' if options else ''}"
                     "-- torchrun ... train.py")
    return command


def _bootstrap_path() -> str:
    """PYTHONPATH with the sitecustomize bootstrap first."""
    entries = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    return os.pathsep.join([bootstrap.SITECUSTOMIZE_DIR] + entries)


def _run(command: list[str], parser: argparse.ArgumentParser) -> int:
    command = _command(command, parser)
    os.environ["PYTHONPATH"] = _bootstrap_path()
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"mfsdp-hotfix run: cannot start {command[0]!r}: {exc}", file=sys.stderr)
        return CANNOT_START


def _site_dirs() -> list[str]:
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return dirs
