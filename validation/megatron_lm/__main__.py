"""The command line (``python3 validation/megatron_lm --help``): a GPU call (``--out``), or, on
any machine, the plan (``--dry``), the summaries of raw records and their markdown tables."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

PACKAGE = os.path.dirname(os.path.abspath(__file__))
VALIDATION = os.path.dirname(PACKAGE)
# run as a folder, Python puts the package's own folder first on sys.path: its modules are
# imported by the package's name, the scripts beside it (comparison, workdir, ...) by theirs
if os.path.abspath(sys.path[0]) == PACKAGE:
    sys.path[0] = VALIDATION

import case_selection  # noqa: E402

import megatron_lm  # noqa: E402
from megatron_lm.arguments import pretrain_args  # noqa: E402
from megatron_lm.plan import GROUPS, RELEASES, UNIT_TESTS, selected  # noqa: E402
from megatron_lm.record import run_call  # noqa: E402
from megatron_lm.summary import joined, read, reference_summary, summary  # noqa: E402
from megatron_lm.tables import reference_tables, report_tables  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(megatron_lm.__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--dry", action="store_true", help="print the plan (id and command line)")
    p.add_argument("--summary", metavar="JSON", nargs="+",
                   help="print the summary of raw records (one session's calls, in order)")
    p.add_argument("--report", metavar="JSON", help="print the markdown tables of a summary")
    p.add_argument("--reference-summary", metavar="JSON", nargs="+",
                   help="print the summary of the runs judged against a reference (raw records)")
    p.add_argument("--reference-report", metavar="JSON",
                   help="print the markdown tables of a reference summary")
    case_selection.add_arguments(p, RELEASES, GROUPS, workers=10)
    p.add_argument("--case-timeout", type=float, default=240.0)
    p.add_argument("--unit-timeout", type=float, default=300.0)
    return case_selection.parse(p, argv)


def print_plan(a: argparse.Namespace) -> None:
    """``--dry``: each run's id and its command line."""
    for planned in selected(a.releases, a.groups, a.only):
        line = (("mfsdp-hotfix run -- " if planned["variant"] == "hotfix" else "")
                + "torchrun --nproc-per-node 1 -m pytest "
                f"{UNIT_TESTS[planned['release']]}/FILE, each file in its own process"
                if planned["group"] == "unit" else " ".join(pretrain_args(planned)))
        print(planned["id"], line)


def records(paths: list[str]) -> dict[str, Any]:
    """Raw records joined in the order given, each named by its file's name."""
    return joined([read(path) for path in paths], [os.path.basename(path) for path in paths])


def main() -> None:
    args = parse()
    if args.dry:
        print_plan(args)
    elif args.summary:
        print(json.dumps(summary(records(args.summary)), indent=1))
    elif args.reference_summary:
        print(json.dumps(reference_summary(records(args.reference_summary)), indent=1))
    elif args.reference_report:
        with open(args.reference_report) as f:
            print(reference_tables(json.load(f)))
    elif args.report:
        with open(args.report) as f:
            print(report_tables(json.load(f)))
    elif not args.out:
        sys.exit("--out is required")
    else:
        run_call(args)


if __name__ == "__main__":
    main()
