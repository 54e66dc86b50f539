"""The command line (``python3 benchmarks/safe_choices --help``): a GPU call (``--out``), or, on
any machine, the plan (``--dry``) and the markdown table of a result (``--report``); a worker
process is this command with ``--serve``."""

from __future__ import annotations

import argparse
import json
import os
import sys

PACKAGE = os.path.dirname(os.path.abspath(__file__))
# run as a folder, Python puts the package's own folder first on sys.path: its modules are
# imported by the package's name
if sys.path[0] == PACKAGE:
    sys.path[0] = os.path.dirname(PACKAGE)

import safe_choices  # noqa: E402
from safe_choices.measure import setup  # noqa: E402
from safe_choices.plan import GROUPS, SIZES, plan, turns, unit_params  # noqa: E402
from safe_choices.record import run_call  # noqa: E402
from safe_choices.report import render_markdown  # noqa: E402
from safe_choices.worker import serve  # noqa: E402


def parser():
    ap = argparse.ArgumentParser(description=safe_choices.__doc__.split("\n")[0])
    ap.add_argument("--out", help="the one JSON to write")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 1 repetition")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 3; smoke 1)")
    ap.add_argument("--groups", default=None,
                    help="comma list of release:ZeRO, in run order (default: "
                         + ",".join(GROUPS["full"]) + ")")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=220.0,
                    help="no group starts that would not finish within this many seconds")
    ap.add_argument("--hard-limit-s", type=float, default=300.0,
                    help="no turn starts that could end later than this (the machine's "
                         "limit, less TransformerEngine's setup)")
    ap.add_argument("--ready-timeout-s", type=float, default=150.0,
                    help="per worker start-up (imports, build, first warm-up)")
    ap.add_argument("--turn-timeout-s", type=float, default=120.0)
    ap.add_argument("--wheels", default=os.path.join(safe_choices.VALIDATION, "wheels"))
    ap.add_argument("--dry", action="store_true", help="print the plan and exit (no GPU)")
    ap.add_argument("--report", metavar="JSON", help="print the markdown table of a result")
    ap.add_argument("--serve", help=argparse.SUPPRESS)  # a worker: its spec as JSON
    return ap


def print_plan(groups, size):
    """``--dry``: the groups' turns in run order, and the model's size."""
    print(f"{len(groups)} groups, {sum(len(turns(g)) for g in groups)} turns, "
          f"{size['units'] * unit_params(size['hidden'], size['ffn'])} parameters")
    for g in groups:
        for rep, i in turns(g):
            print(f"{g['group']} rep{rep} {g['workers'][i]['variant']}")


def main(argv=None):
    ap = parser()
    a = ap.parse_args(argv)
    if a.serve:
        spec = json.loads(a.serve)
        serve(lambda info: setup(spec, info))
    if a.report:
        with open(a.report) as f:
            print(render_markdown(json.load(f)))
        return 0
    mode = "smoke" if a.smoke else "full"
    size = dict(SIZES[mode])
    size.update({k: v for k, v in (("steps", a.steps), ("warmup", a.warmup)) if v is not None})
    reps = a.reps if a.reps is not None else (1 if a.smoke else 3)
    groups = plan(a.groups.split(",") if a.groups else GROUPS[mode], reps, size)
    if a.dry:
        print_plan(groups, size)
        return 0
    if not a.out:
        ap.error("--out is required")
    return run_call(a, mode, size, reps, groups)


if __name__ == "__main__":
    sys.exit(main())
