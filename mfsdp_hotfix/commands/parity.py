"""``mfsdp-hotfix parity --out DIR -- LAUNCH COMMAND``: the user's own Megatron-LM job run for a
few iterations as given (Megatron-FSDP with the hotfix, as the user runs it) and as a reference
(Megatron's own DDP), every iteration compared; ``--compare A B`` compares two logs.

Everything is decided before anything runs: the script is recognised, the runs are planned
(``parity.plan``), ``--out`` is probed by creating a file in it (as ``audit`` probes its own).
The runs go one after the other, each one launch of the user's command (``parity.launch``)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..audit.verdicts import SIGNALLED
from ..parity.floors import FLOORS
from .audit import folder_problem, make_folders
from .exits import CANNOT_START, PARITY_CANNOT_COMPARE, PARITY_MATCH, PARITY_MISMATCH, USAGE_ERROR
from .output import reader_gone
from .run import add_command_argument, command_after_dashes

if TYPE_CHECKING:
    from ..parity.launch import Outcome
    from ..parity.plan import Plan

NAME = "parity"
HELP = "compare your job with Megatron's own DDP, every iteration"
USAGE: str | None = ("mfsdp-hotfix parity --out DIR [--iters N] [--timeout S] [--with-shipped] "
                     "[--shrink LAYERS] [--json] -- LAUNCH COMMAND\n"
                     "       mfsdp-hotfix parity --compare REFERENCE_LOG CANDIDATE_LOG [--json]")
DESCRIPTION = ("Run LAUNCH COMMAND (torchrun/srun/python ... pretrain_gpt.py ARGS) for a few "
               "iterations twice: as given, and as a reference rewritten to Megatron's own DDP "
               "(distributed optimizer, fused wgrad accumulation off; same layout, seed and "
               "data, MFSDP_HOTFIX=0). Every loss and the grad norm of every iteration are "
               "compared; the first line says MATCH, MISMATCH or CANNOT COMPARE. Every output "
               "of the runs goes into DIR; the user's checkpoint, TensorBoard and data folders "
               f"are never written. Exit status: {PARITY_MATCH} MATCH, {PARITY_MISMATCH} "
               f"MISMATCH, {PARITY_CANNOT_COMPARE} CANNOT COMPARE, {USAGE_ERROR} when nothing "
               "was run (a usage error or a command parity refuses).")
VERDICT_STATUS = {"MATCH": PARITY_MATCH, "MISMATCH": PARITY_MISMATCH,
                  "CANNOT COMPARE": PARITY_CANNOT_COMPARE}
DEFAULT_ITERS, DEFAULT_TIMEOUT = 3, 1800.0
RUN_FOLDERS = ("candidate", "reference", "shipped")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", metavar="DIR",
                        help="folder for every output of the runs (a missing one is created)")
    parser.add_argument("--iters", type=_positive, default=DEFAULT_ITERS, metavar="N",
                        help=f"iterations per run (default {DEFAULT_ITERS}); with --load, past "
                             "the checkpoint's iteration")
    parser.add_argument("--timeout", type=_seconds, default=DEFAULT_TIMEOUT, metavar="S",
                        help=f"seconds each run may take before it counts as hung and is "
                             f"ended (default {DEFAULT_TIMEOUT:.0f})")
    parser.add_argument("--with-shipped", action="store_true",
                        help="a third run: your command with MFSDP_HOTFIX=0, to show what the "
                             "hotfix changes")
    parser.add_argument("--shrink", type=_positive, metavar="LAYERS",
                        help="run both sides with LAYERS layers (when the DDP reference does "
                             "not fit); said in the verdict")
    parser.add_argument("--no-deterministic", dest="deterministic", action="store_false",
                        help="do not add Megatron's --deterministic-mode")
    parser.add_argument("--overwrite", action="store_true",
                        help="delete the run folders of an earlier check in DIR first")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the runs' command lines and what was changed; run nothing")
    parser.add_argument("--json", action="store_true",
                        help="the verdict as one JSON object on stdout")
    parser.add_argument("--compare", nargs=2, metavar=("REFERENCE_LOG", "CANDIDATE_LOG"),
                        help="compare two finished logs instead of running anything")
    parser.add_argument("--precision", choices=sorted(FLOORS),
                        help="with --compare: the precision the logs were trained in (read "
                             "from Megatron-LM's argument dump in the logs when not given)")
    add_command_argument(parser)


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, not {text}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {text}")
    return value


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.compare:
        if args.cmd:
            parser.error("--compare takes two logs and no command after --")
        return _compare_logs(args)
    if args.cmd and args.cmd[0] != "--":
        parser.error(f"put -- before the launch command: {parser.prog} --out DIR -- "
                     f"{' '.join(args.cmd[:3])} ...")
    if args.out is None:
        parser.error(f"the following arguments are required: --out (e.g. {parser.prog} --out "
                     "parity-check -- torchrun ... pretrain_gpt.py ...)")
    command = command_after_dashes(args.cmd, parser, "--out DIR")
    return _check(args, command)


def _refuse(message: str) -> int:
    print(f"mfsdp-hotfix parity: {message}; nothing was run", file=sys.stderr)
    return USAGE_ERROR


def _check(args: argparse.Namespace, command: list[str]) -> int:
    from ..parity.job_command import Refused, split_command
    from ..parity.outputs import inside_user_data
    from ..parity.plan import make_plan

    out = os.path.abspath(args.out)
    try:
        job = split_command(command)
        plan = make_plan(job, out, args.iters, args.with_shipped, args.deterministic,
                         args.shrink, os.environ)
    except Refused as exc:
        return _refuse(str(exc))
    if args.dry_run:
        _say_plan(plan, print)
        return 0
    problem = inside_user_data(out, job.args) or _out_problem(args.out, out, args.overwrite)
    if problem:
        return _refuse(f"--out {args.out}: {problem}")
    _say_plan(plan, say)
    created = make_folders(out)
    if created:
        say(f"created the folder {created[-1]} for the runs")
    for name in RUN_FOLDERS:
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)  # --overwrite (else absent)
    return _run_plan(plan, args)


def say(line: str) -> None:
    """A progress line, on stderr: stdout holds the verdict alone (its first line is the
    answer) or the JSON. A reader that went away (``2>&1 | head``) raises BrokenPipeError,
    which ends the runs (``cli.main`` then exits 141)."""
    print(f"parity: {line}", file=sys.stderr, flush=True)


def _say_plan(plan: Plan, say: Callable[[str], None]) -> None:
    """The runs, what was changed for all of them and for the reference, each command line."""
    from ..parity.plan import describe

    say(f"{len(plan.runs)} runs, iterations {plan.first} to {plan.last}, one after the other")
    for note in plan.every_run:
        say(f"  every run: {note}")
    for note in plan.reference:
        say(f"  reference: {note}")
    for each in plan.runs:
        say(f"  {each.name} ({each.title}): {describe(each)}")


def _run_plan(plan: Plan, args: argparse.Namespace) -> int:
    from .. import processes
    from ..parity.launch import run as launch
    from ..parity.plan import describe

    outcomes: dict[str, Outcome] = {}
    try:
        with processes.supervised() as children:
            for each in plan.runs:
                os.makedirs(each.folder, exist_ok=True)
                with open(os.path.join(each.folder, "command.txt"), "w") as f:
                    f.write(describe(each) + "\n")
                say(f"{each.name}: starting ({each.title}); output in {each.log}")
                try:
                    outcomes[each.name] = launch(children, each.command,
                                                 dict(os.environ, **each.env), each.log,
                                                 args.timeout, say, each.name, plan.last,
                                                 reader_gone)
                except OSError as exc:
                    print(f"mfsdp-hotfix parity: cannot start {each.command[0]!r}: {exc} (the "
                          f"runs' folder: {os.path.dirname(each.folder)})", file=sys.stderr)
                    return CANNOT_START
                say(_ended(each.name, outcomes[each.name]))
    except KeyboardInterrupt:
        return _stopped("SIGINT (Ctrl-C)", SIGNALLED + signal.SIGINT, args.out)
    except processes.Stopped as exc:
        return _stopped(signal.Signals(exc.signum).name, SIGNALLED + exc.signum, args.out)
    return _verdict(plan, outcomes, args)


def _stopped(what: str, status: int, out: str) -> int:
    print(f"mfsdp-hotfix parity: stopped by {what}: every run's processes were ended; the "
          f"output so far is in {out}", file=sys.stderr)
    return status


def _ended(name: str, outcome: Outcome) -> str:
    if outcome.timed_out:
        return (f"{name}: HUNG: no end within {outcome.elapsed:.0f} s (--timeout); "
                + (f"last iteration {outcome.last_iteration}" if outcome.last_iteration
                   is not None else "no iteration printed") + "; its processes were ended")
    return f"{name}: exit status {outcome.status} after {outcome.elapsed:.0f} s"


def _verdict(plan: Plan, outcomes: dict[str, Outcome], args: argparse.Namespace) -> int:
    from ..parity.outcome import judge

    lines, data = judge(plan, outcomes)
    if args.json:
        print(json.dumps(data, indent=1, sort_keys=False))
    else:
        print("\n".join(lines))
    return VERDICT_STATUS[data["verdict"]]


def _compare_logs(args: argparse.Namespace) -> int:
    from ..parity.outcome import judge_logs

    try:
        lines, data = judge_logs(args.compare[0], args.compare[1], args.precision)
    except OSError as exc:
        return _refuse(f"--compare: cannot read {exc.filename}: {exc.strerror}")
    print(json.dumps(data, indent=1) if args.json else "\n".join(lines))
    return VERDICT_STATUS[data["verdict"]]


def _out_problem(out: str, path: str, overwrite: bool) -> str | None:
    """Why the runs cannot go into ``--out`` (None: fine): probed by creating a file there (or
    in the nearest folder above, where it would be made), before anything runs."""
    from ..audit.rank_files import probe

    if os.path.exists(path) and not os.path.isdir(path):
        return "is a file: give a folder (it is created when missing)"
    earlier = [name for name in RUN_FOLDERS if os.path.exists(os.path.join(path, name))]
    if earlier and not overwrite:
        return (f"holds the runs of an earlier check ({', '.join(earlier)}); give a new folder, "
                "or add --overwrite to delete them first")
    return folder_problem(path, "for the runs") or probe(os.path.join(path, "probe"))
