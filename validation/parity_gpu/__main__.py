"""The command line (``python3 validation/parity_gpu --help``): a GPU call (``--out``), or, on any
machine, every command line (``--dry``), their check by the releases' own argument parsers
(``--check-args``) and the tables of records (``--report``)."""

from __future__ import annotations

import argparse
import os
import sys

PACKAGE = os.path.dirname(os.path.abspath(__file__))
VALIDATION = os.path.dirname(PACKAGE)
# run as a folder, Python puts the package's own folder first on sys.path: its modules are
# imported by the package's name, the scripts beside it (engine, workdir, ...) by theirs
if os.path.abspath(sys.path[0]) == PACKAGE:
    sys.path[0] = VALIDATION
# mfsdp_hotfix (its noise floors, the process helpers) where it is not installed: after
# site-packages, so that an installed copy (the GPU call's, `pip install .`) is the one used
if os.path.dirname(VALIDATION) not in sys.path:
    sys.path.append(os.path.dirname(VALIDATION))

import case_selection  # noqa: E402

import parity_gpu  # noqa: E402
from parity_gpu.plan import GROUPS, RELEASES, selected  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(parity_gpu.__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", default="", help="the record (.json.gz), rewritten as cases end")
    p.add_argument("--dry", action="store_true", help="print every case's command line")
    p.add_argument("--check-args", metavar="RELEASE=DIR", action="append", default=[],
                   help="check each case's pretrain_gpt.py arguments with the release's own "
                   "parser (DIR: the unpacked megatron-core wheel)")
    p.add_argument("--report", metavar="RECORD", nargs="+", help="print the markdown tables")
    case_selection.add_arguments(p, RELEASES, GROUPS, workers=12)
    return case_selection.parse(p, argv)


def print_plan(a: argparse.Namespace) -> None:
    """``--dry``: each case's id, what it adds to the environment, and its command line."""
    from parity_gpu.command import command

    for c in selected(a.releases, a.groups, a.only):
        argv, _, added = command(c, f"src/{c['release']}/pretrain_gpt.py",
                                 f"rel/{c['release']}", f"cases/{c['id']}/parity")
        env = " ".join(f"{k}={v}" for k, v in sorted(added.items()) if k != "PYTHONPATH")
        print(f"{c['id']} (expected {c['expected'] or 'recorded'}, about "
              f"{c['estimate_s']:.0f} s)\n  {env} {' '.join(argv)}")


def check_args(a: argparse.Namespace) -> None:
    """Every run of every selected case (the command's own plan: the candidate, the reference it
    rewrites to Megatron's DDP, the shipped run) through the release's ``parse_and_validate_args``
    with the environment the command gives that run."""
    from megatron_lm.arguments import parse_check

    from mfsdp_hotfix.parity.job_command import split_command
    from mfsdp_hotfix.parity.plan import make_plan
    from parity_gpu.command import launch

    dirs = dict(item.split("=", 1) for item in a.check_args)
    failed = 0
    for c in selected(a.releases, a.groups, a.only):
        if c["release"] not in dirs:
            continue
        job = split_command(launch(c, "pretrain_gpt.py"))
        plan = make_plan(job, "/nonexistent/parity", c["iterations"], c["shipped"], True, None,
                         {})
        for run in plan.runs:
            try:
                parsed = parse_check(dirs[c["release"]], c, args=run.command[
                    len(job.launcher) + 1:], env={k: v for k, v in run.env.items()
                                                  if k != "PYTHONPATH"})  # the capture's
                print(f"ok   {c['id']} {run.name}: microbatches={parsed['num_microbatches']} "
                      + " ".join(f"{k}={parsed[k]}" for k in (
                          "use_megatron_fsdp", "gradient_accumulation_fusion",
                          "deterministic_mode", "ckpt_format")))
            except RuntimeError as exc:
                failed += 1
                print(f"FAIL {c['id']} {run.name}: {str(exc)[-1500:]}")
    sys.exit(1 if failed else 0)


def main() -> None:
    args = parse()
    if args.dry:
        print_plan(args)
    elif args.check_args:
        check_args(args)
    elif args.report:
        from parity_gpu.record import read
        from parity_gpu.tables import report

        print(report([read(path) for path in args.report]))
    elif not args.out:
        sys.exit("--out is required")
    else:
        from parity_gpu.record import run_call

        run_call(args)


if __name__ == "__main__":
    main()
