"""``mfsdp-hotfix audit --out PATH -- COMMAND``: COMMAND as ``run`` starts it, with the on-the-job
audit on (every rank writes ``PATH.rank<N>.json``), then the summary of the rank files and its
verdict. Where ``--out`` points is probed, and its missing folders made, before anything runs."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from .. import processes, settings
from ..verdict_text import block, first_line
from .exits import CANNOT_START, USAGE_ERROR
from .run import add_command_argument, command_after_dashes, pythonpath_with_bootstrap

# How long a stopped audit waits, after SIGTERM, for the command (torchrun stops its ranks on
# SIGTERM, and each rank's audit writes its file at exit) before it kills what is left.
STOP_GRACE_S = 10.0
NAME = "audit"
HELP = "run a job with the on-the-job audit, then summarise it"
USAGE: str | None = "mfsdp-hotfix audit --out PATH -- COMMAND [ARGS...]"
DESCRIPTION = ("Run COMMAND (e.g. torchrun ... train.py) like 'mfsdp-hotfix run', with "
               "MFSDP_HOTFIX_AUDIT=PATH: every rank writes PATH.rank<N>.json. Then print a "
               "summary of them; the last line is 'audit: <VERDICT>: ...' (UNORDERED, CRASH, "
               "WRONG GRADIENTS, UNWATCHED, INCOMPLETE, NOT CHECKED, ordered, UNWRITABLE or NO "
               "DATA). Exit status: 3 for a finding (UNORDERED, CRASH, WRONG GRADIENTS) whatever "
               "the command's status; else the command's when it failed; else 0 only for "
               "ordered, 4 when nothing or not everything was checked; 2 when nothing was run "
               "(an --out where no file can be created, or rank files of an earlier run there "
               "without --overwrite).")


def add_arguments(audit: argparse.ArgumentParser) -> None:
    audit.add_argument("--out", required=True, metavar="PATH",
                       help="path prefix of the rank files (PATH.rank<N>.json); a missing "
                            "folder is created (and said so)")
    audit.add_argument("--overwrite", action="store_true",
                       help="delete rank files PATH.rank<N>.json of an earlier run before "
                            "running (without it, their presence stops the audit before it "
                            "runs anything)")
    add_command_argument(audit)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``audit``: the command with the bootstrap and MFSDP_HOTFIX_AUDIT, then a summary.
    Rank files of an earlier run at the same path are evidence: without ``--overwrite`` they
    stop the audit before anything runs. Stopped (Ctrl-C, SIGTERM, SIGHUP), the audit gives the
    command ``STOP_GRACE_S`` to end, kills what is left of it, shows the summary of the rank
    files written so far, and exits with the signal's status."""
    from ..audit.rank_files import rank_files

    out, overwrite = args.out, args.overwrite
    command = command_after_dashes(args.cmd, parser, f"--out {out}")
    path = os.path.abspath(out)
    problem = _out_problem(out, path)
    earlier = rank_files(path)
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
    created = make_folders(os.path.dirname(path))
    env = dict(os.environ, PYTHONPATH=pythonpath_with_bootstrap(), **{settings.AUDIT: path})
    stopped: BaseException | None = None
    child = None
    try:
        with processes.supervised(grace_s=STOP_GRACE_S) as children:
            try:  # in this terminal's process group: a Ctrl-C reaches the command as always
                child = children.start(command, own_session=False, env=env)
            except OSError as exc:
                for folder in created:  # nothing ran: leave nothing behind (but what another
                    with contextlib.suppress(OSError):  # put there)
                        os.rmdir(folder)
                print(f"mfsdp-hotfix audit: cannot start {command[0]!r}: {exc}",
                      file=sys.stderr)
                return CANNOT_START
            if created:
                print(f"mfsdp-hotfix audit: created the folder {created[0]} for the rank files",
                      file=sys.stderr)
            status = child.wait()
    except (KeyboardInterrupt, processes.Stopped) as exc:  # the command is ended by now
        stopped = exc
        status = child.returncode if child is not None and child.returncode is not None else 1
    code = _summary(path, len(earlier), status)
    if stopped is not None:  # what the rank files hold so far is shown; the stop is the status
        raise stopped
    return code


def _summary(path: str, deleted: int, status: int) -> int:
    """The verdict on the rank files the command's ranks wrote, first (the command's exit
    ``status`` in it), then what it means and the summary of the files, indented; returns the
    audit's exit status."""
    from ..audit.rank_files import probe, read_rank_files
    from ..audit.summary import summarise
    from ..audit.verdicts import GLANCE, VERDICTS, exit_status

    reports, unreadable = read_rank_files(path)
    verdict, lines = summarise(reports, path, None if reports or unreadable else probe(path))
    meaning, todo, _ = VERDICTS[verdict]
    state, first_todo = GLANCE[verdict]
    details = [meaning] + ([] if verdict == "ordered" else [f"to do: {todo}"])
    if reports or deleted:
        details.append(f"{len(reports)} rank file(s) {path}.rank<N>.json"
                       + (f" ({deleted} from an earlier run deleted first: --overwrite)"
                          if deleted else ""))
    details += lines + [f"unreadable: {name}" for name in unreadable]
    told = f"(command exit status {status})"
    first = first_line(f"audit: {verdict}: {state}", f"{first_todo} {told}")
    print(block(first, details if first.endswith(told) else [told[1:-1], *details]))
    return exit_status(verdict, status)


def _names(files: dict[int, str]) -> str:
    names = [os.path.basename(name) for _, name in sorted(files.items())]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def make_folders(folder: str) -> list[str]:
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
    from ..audit.rank_files import probe

    prefix = "--out takes a path prefix, the rank files are PATH.rank<N>.json"
    if out.endswith(("/", os.sep)) or os.path.isdir(path):
        return f"is a folder ({prefix}): name a run inside it, e.g. {os.path.join(path, 'run1')}"
    if os.path.exists(path):
        return (f"is an existing file ({prefix}, not a file to write): give a path that does "
                "not exist yet")
    folder = os.path.dirname(path)
    return folder_problem(folder, "for the rank files") or probe(path)


def folder_problem(folder: str, purpose: str) -> str | None:
    """Why ``folder`` cannot exist (a file where it or a folder above it would be), or None."""
    parent = folder
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is a file, so the folder {folder} {purpose} cannot exist"
    return None
